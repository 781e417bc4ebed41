/* The decode matmul for a few activation rows, each row's: out[c] = bf16(sum_k x[k] * ((q - 8) * scale + zero)),
 * from tinygemm's CPU int4 layout (see int4_dequant.c), accumulated in fp32.
 *
 * Per group the sum is factored as scale * sum x (q - 8) + zero * sum x. The codes become bf16
 * pairs (rows k and k + 1 of a channel) without arithmetic: the word 0x43QQ is the bf16 value
 * 128 + q, exact, so one vdpbf16ps per 16 channels and 2 rows accumulates sum x (128 + q), from
 * which sum x (q - 8) = that - 136 sum x. Every product is exact in fp32, so the result differs
 * from PyTorch's tinygemm (which rounds (q - 8) * scale + zero in fp32 first) only where the two
 * sums round to different bf16 values: under 1% of outputs in tests/test_runtime_gemv.py.
 *
 * Each block's weights are one sequential stream, left to the hardware prefetcher (software
 * prefetches measured slower on a Zen 4).
 *
 * Needs AVX-512 VBMI and BF16, checked at run time; elsewhere int4q_gemv_available() is 0 and the
 * runtime uses tinygemm. Registered as a PyTorch operator by int4_ops.cpp.
 */
#include <stdint.h>
#include <string.h>

#include "int4q.h"

#define BLOCK 64  /* output channels per block of the layout */
#define RUN 32    /* bytes per (block, k) run */

#if INT4Q_X86
#include <immintrin.h>

#define TILE 4 /* activation rows a pass over a block's weights serves */

/* The 64 outputs of block b for `rows` (1..TILE) activation rows x [rows, k] (row stride k), out row
 * stride n. Rows kk and kk + 1 of the block are 64 contiguous bytes; one byte permute orders them so that
 * unpacking a nibble vector with 0x43 bytes yields, for 16 channels, word pairs (row kk, row kk + 1):
 * lane i of the dot product is channel i of that quarter. Each row's sums are formed in the same order
 * whatever `rows` is, so a row's output does not depend on the rows beside it. */
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) static inline __attribute__((always_inline)) void
block_tile(const uint16_t *x, const float *xsum, const uint8_t *src, const uint16_t *sz, uint16_t *out, int64_t n,
           int64_t k, int64_t group_size, int64_t b, const int rows) {
    uint8_t order[64];
    for (int p = 0; p < 64; p++) {
        const int lane = p / 16, j = p % 16, row = j % 2;
        order[p] = (uint8_t)(32 * row + 4 * lane + (j < 8 ? j / 2 : 16 + (j - 8) / 2));
    }
    const __m512i interleave = _mm512_loadu_si512(order);
    const __m512i nibble = _mm512_set1_epi8(0x0F), high_byte = _mm512_set1_epi8(0x43);
    const __m512i zero_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t groups = k / group_size;
    __m512 y[TILE][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) y[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[TILE][4];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        const uint8_t *pairs_of_rows = src + g * group_size * RUN;
        for (int64_t kk = 0; kk < group_size; kk += 2) {
            const __m512i a = _mm512_permutexvar_epi8(interleave, _mm512_loadu_si512(pairs_of_rows + kk * RUN));
            const __m512i low = _mm512_and_si512(a, nibble);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
            const __m512bh w[4] = {(__m512bh)_mm512_unpacklo_epi8(low, high_byte),
                                   (__m512bh)_mm512_unpackhi_epi8(low, high_byte),
                                   (__m512bh)_mm512_unpacklo_epi8(high, high_byte),
                                   (__m512bh)_mm512_unpackhi_epi8(high, high_byte)};
            for (int r = 0; r < rows; r++) {
                uint32_t pair;
                memcpy(&pair, x + r * k + g * group_size + kk, sizeof pair);
                const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xs);
            }
        }
        const uint16_t *params = sz + (g * n + b * BLOCK) * 2; /* (scale, zero) per channel */
        for (int j = 0; j < 4; j++) {
            const __m512i pairs = _mm512_loadu_si512(params + 32 * j);
            const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, zero_mask));
            for (int r = 0; r < rows; r++) {
                const float total = xsum[r * groups + g];
                const __m512 sum = _mm512_set1_ps(total), bias = _mm512_set1_ps(-136.0f * total);
                y[r][j] = _mm512_fmadd_ps(scale, _mm512_add_ps(acc[r][j], bias), _mm512_fmadd_ps(zero, sum, y[r][j]));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_si512(out + r * n + b * BLOCK, (__m512i)_mm512_cvtne2ps_pbh(y[r][1], y[r][0]));
        _mm512_storeu_si512(out + r * n + b * BLOCK + 32, (__m512i)_mm512_cvtne2ps_pbh(y[r][3], y[r][2]));
    }
}

/* block_tile with the row count a constant, so that its loops unroll and its sums stay in registers. */
#define TILE_OF(R)                                                                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) static void block_tile_##R(                  \
        const uint16_t *x, const float *xsum, const uint8_t *src, const uint16_t *sz, uint16_t *out, int64_t n,     \
        int64_t k, int64_t group_size, int64_t b) {                                                                 \
        block_tile(x, xsum, src, sz, out, n, k, group_size, b, R);                                                  \
    }
TILE_OF(1)
TILE_OF(2)
TILE_OF(3)
TILE_OF(4)
#endif

/* 1 when this CPU runs the GEMV (AVX-512 F, BW, VL, VBMI and BF16) and int4q_max_level() allows it. */
int int4q_gemv_available(void) { return int4q_dequant_level() >= INT4Q_AVX512_BF16; }

/* xsum[g] = the fp32 sum of x's group g (k / group_size groups), in order. */
void int4q_group_sums(const uint16_t *x, int64_t k, int64_t group_size, float *xsum) {
    for (int64_t g = 0; g < k / group_size; g++) {
        float s = 0;
        for (int64_t i = 0; i < group_size; i++) s += int4q_bf16_to_float(x[g * group_size + i]);
        xsum[g] = s;
    }
}

/* Output blocks [first, last) of the product for `rows` rows: x bf16 [rows, k], xsum [rows, k / group_size]
 * from int4q_group_sums of each row, pack and sz as in int4_dequant.c, out bf16 [rows, n]; n % 64 == 0,
 * group_size even, k % group_size == 0. Each row's output is what it would be alone. Only where
 * int4q_gemv_available(). */
void int4q_gemv_blocks(const uint16_t *x, const float *xsum, const uint8_t *pack, const uint16_t *sz, uint16_t *out,
                       int64_t rows, int64_t n, int64_t k, int64_t group_size, int64_t first, int64_t last) {
#if INT4Q_X86
    const int64_t groups = k / group_size;
    for (int64_t b = first; b < last; b++)
        for (int64_t r = 0; r < rows; r += TILE) {
            const uint16_t *xr = x + r * k;
            const float *sr = xsum + r * groups;
            uint16_t *o = out + r * n;
            const uint8_t *src = pack + b * k * RUN;
            switch (rows - r < TILE ? rows - r : TILE) {
            case 1: block_tile_1(xr, sr, src, sz, o, n, k, group_size, b); break;
            case 2: block_tile_2(xr, sr, src, sz, o, n, k, group_size, b); break;
            case 3: block_tile_3(xr, sr, src, sz, o, n, k, group_size, b); break;
            default: block_tile_4(xr, sr, src, sz, o, n, k, group_size, b); break;
            }
        }
#else
    (void)x, (void)xsum, (void)pack, (void)sz, (void)out, (void)rows, (void)n, (void)k, (void)group_size,
        (void)first, (void)last;
#endif
}
