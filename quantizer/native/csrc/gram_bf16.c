/* The Gram matrix of bf16 rows, C = beta * C + alpha * x^T x, for GPTQ's Hessians: every product
 * exact, the sums in fp32, and only the tiles on and above the diagonal computed (the caller
 * mirrors the upper triangle once it reads C).
 *
 * x comes as row pairs, packed by column panel: panel q (columns [48 q, 48 q + 48)) is a run of
 * npairs * 48 words (panel_words) in which pair p's 48 words are contiguous, and word j of them
 * holds x[2p][48 q + j] in its low half and x[2p + 1][48 q + j] in its high half (zeros beyond k,
 * and a zero row pads an odd row count). Then one vdpbf16ps of a broadcast word of column i with
 * 16 words of columns j..j+15 adds x[2p][i] x[2p][j] + x[2p+1][i] x[2p+1][j] to 16 entries of
 * row i. A tile is 8 rows by 48 columns of C: 24 accumulators, fed from 3 loads and 8 broadcasts
 * per row pair, each stream contiguous in memory. The pairs come in chunks (INT4Q_GRAM_PAIRS: C
 * is read and written once a chunk) and the rows in blocks (INT4Q_GRAM_ROWS: a block's words of
 * a chunk stay in L2 while a thread's panels pass over them).
 *
 * Needs AVX-512 F and BF16, checked at run time; elsewhere int4q_gram_available() is 0 and the
 * caller uses ATen's fp32 GEMM. Registered as a PyTorch operator by int4_ops.cpp.
 */
#include <stdint.h>

#include "int4q.h"

#define TILE_ROWS 8

#if INT4Q_X86
#include <immintrin.h>

/* One tile: rows [i0, i0 + 8) by columns [j0, j0 + 48) of C over pairs [p0, p1). The accumulators
 * never leave registers: the epilogue is in the same function. */
__attribute__((target("avx512f,avx512bf16")))
static void tile(const uint32_t *pairs, int64_t panel_words, int64_t p0, int64_t p1, int64_t i0, int64_t j0,
                 float *c, int64_t k, float alpha, float beta) {
    const uint32_t *rows = pairs + i0 / INT4Q_GRAM_PANEL * panel_words + i0 % INT4Q_GRAM_PANEL;
    const uint32_t *columns = pairs + j0 / INT4Q_GRAM_PANEL * panel_words;
    __m512 acc[TILE_ROWS][3];
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS; r++)
        for (int v = 0; v < 3; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; p++) {
        const uint32_t *row = rows + p * INT4Q_GRAM_PANEL, *column = columns + p * INT4Q_GRAM_PANEL;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(column);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(column + 16);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(column + 32);
#pragma GCC unroll 8
        for (int r = 0; r < TILE_ROWS; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)row[r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
        }
    }
    const __m512 scale_new = _mm512_set1_ps(alpha), scale_old = _mm512_set1_ps(beta);
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS; r++) {
        if (i0 + r >= k) break;
        for (int v = 0; v < 3; v++) {
            const int64_t j = j0 + 16 * v;
            if (j >= k) break;
            const __mmask16 valid = k - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1);
            float *dst = c + (i0 + r) * k + j;
            const __m512 old = _mm512_maskz_loadu_ps(valid, dst);
            _mm512_mask_storeu_ps(dst, valid, _mm512_fmadd_ps(scale_new, acc[r][v], _mm512_mul_ps(scale_old, old)));
        }
    }
}
#endif

/* 1 when this CPU runs the kernel (AVX-512 F and BF16) and int4q_max_level() allows it. */
int int4q_gram_available(void) {
#if INT4Q_X86
    return int4q_max_level() >= INT4Q_AVX512_BF16 && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* The tiles of column panel `panel` (columns [48 panel, 48 panel + 48) of C [k, k] fp32 row-major)
 * on and above the diagonal whose rows lie in [i_begin, i_end), over packed row pairs [p0, p1)
 * whose panels are panel_words apart: C = beta * C + alpha * the pairs' Gram. Only where
 * int4q_gram_available(). The caller walks row blocks in its outer loop, so that one block's
 * words of every pair stay in L2 while the panels pass over them. */
void int4q_gram_block(const uint32_t *pairs, int64_t p0, int64_t p1, int64_t panel_words, float *c, int64_t k,
                      float alpha, float beta, int64_t i_begin, int64_t i_end, int64_t panel) {
#if INT4Q_X86
    const int64_t j0 = INT4Q_GRAM_PANEL * panel;
    const int64_t last = j0 + INT4Q_GRAM_PANEL < k ? j0 + INT4Q_GRAM_PANEL : k;
    for (int64_t i0 = i_begin; i0 < i_end && i0 < last; i0 += TILE_ROWS)
        tile(pairs, panel_words, p0, p1, i0, j0, c, k, alpha, beta);
#else
    (void)pairs, (void)p0, (void)p1, (void)panel_words, (void)c, (void)k, (void)alpha, (void)beta, (void)i_begin,
        (void)i_end, (void)panel;
#endif
}
