/* Causal attention of a whole sequence from position 0 (a prefill), bf16 in and out, fp32 inside:
 * out[i] = bf16(sum_{l <= i} p_il v[l] / sum_{l <= i} p_il), p_il = exp(s_il - max_l s_il),
 * s_il = scale * q[i] . k[l]: every product exact and the sums fp32. Each weight meets the values as
 * two bf16 numbers, its rounding and the rounding of what that leaves, so it carries 16 of fp32's
 * 24 bits (PyTorch's own bf16 attention rounds it once, to 8).
 *
 * A task is one block of INT4Q_CAUSAL_ROWS queries of one head. Its scores come from the head's
 * keys packed as dimension pairs (word (p, l) holds k[l][2p] low, k[l][2p + 1] high, positions
 * padded to INT4Q_CAUSAL_KEYS), so that one vdpbf16ps of a broadcast query word with 16 words adds
 * two dimensions' products to 16 scores; its output from the values packed as position pairs
 * (word (t, d) holds v[2t][d] low, v[2t + 1][d] high, dimensions padded to INT4Q_CAUSAL_DIMS), so
 * that a broadcast word of two weights meets 16 dimensions. Only keys up to the block's last query
 * are visited.
 *
 * Needs AVX-512 F and BF16, checked at run time (int4q_causal_available); elsewhere the caller
 * uses PyTorch's attention. Registered as a PyTorch operator by attention_ops.cpp.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

#define SCORE_ROWS 8  /* queries per score tile: 8 x 48 scores in 24 accumulators */
#define VALUE_ROWS 12 /* queries per value tile: 12 x 32 outputs in 24 accumulators */

#if INT4Q_X86
#include <immintrin.h>

#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* Scores of queries [r0, r0 + 8) of the block (rows past `rows` repeat the last one and are not
 * stored) against keys [j0, j0 + 48): s[r][j] = q[r] . k[j], unscaled. */
BF16 static void score_tile(const uint32_t *q, int64_t q_step, int64_t rows, int64_t r0, const uint32_t *keys,
                            int64_t key_stride, int64_t pairs, int64_t j0, float *s, int64_t s_step) {
    __m512 acc[SCORE_ROWS][3];
    const uint32_t *row[SCORE_ROWS];
    for (int r = 0; r < SCORE_ROWS; r++) {
        row[r] = q + (r0 + r < rows ? r0 + r : rows - 1) * q_step;
        for (int v = 0; v < 3; v++) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *k = keys + p * key_stride + j0;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k + 16);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(k + 32);
#pragma GCC unroll 8
        for (int r = 0; r < SCORE_ROWS; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)row[r][p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
        }
    }
    for (int r = 0; r < SCORE_ROWS && r0 + r < rows; r++)
        for (int v = 0; v < 3; v++) _mm512_storeu_ps(s + (r0 + r) * s_step + j0 + 16 * v, acc[r][v]);
}

/* Row i's weights from its scores [0, i]: e = exp(scale (s - max)) as bf16(e) into high[0, i] and
 * bf16(e - bf16(e)) into low[0, i], zeros into both up to `width`; returns the fp32 sum of e. */
BF16 static float weigh_row(const float *s, int64_t i, int64_t width, float scale, uint16_t *high, uint16_t *low) {
    const int64_t n = i + 1;
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + l));
    const __mmask16 tail = (__mmask16)((1u << (n - l)) - 1);
    top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + l));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale), step = _mm512_set1_ps(scale);
    __m512 sums = _mm512_setzero_ps();
    for (l = 0; l < width; l += 16) {
        const __mmask16 live = l + 16 <= n ? (__mmask16)0xFFFF : l < n ? (__mmask16)((1u << (n - l)) - 1) : 0;
        const __m512 e = _mm512_maskz_mov_ps(live, int4q_exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, s + l),
                                                                                   step, shift)));
        sums = _mm512_add_ps(sums, e);
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
        const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
        _mm256_storeu_si256((__m256i *)(high + l), rounded);
        _mm256_storeu_si256((__m256i *)(low + l), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, widened)));
    }
    return _mm512_reduce_add_ps(sums);
}

/* Outputs of queries [r0, r0 + 12) of the block, dimensions [d0, d0 + 32), over position pairs
 * [0, pairs): sum_t (high[r][t] + low[r][t]) . v[t][d], divided by the row's total and rounded. */
BF16 static void value_tile(const uint32_t *high, const uint32_t *low, int64_t w_step, int64_t rows, int64_t r0,
                            const uint32_t *values, int64_t value_stride, int64_t pairs, int64_t d0, int64_t dim,
                            const float *totals, uint16_t *out, int64_t out_step) {
    __m512 acc[VALUE_ROWS][2];
    int64_t row[VALUE_ROWS];
    for (int r = 0; r < VALUE_ROWS; r++) {
        row[r] = (r0 + r < rows ? r0 + r : rows - 1) * w_step;
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < pairs; t++) {
        const uint32_t *v = values + t * value_stride + d0;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(v);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(v + 16);
#pragma GCC unroll 12
        for (int r = 0; r < VALUE_ROWS; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)high[row[r] + t]);
            const __m512bh c = (__m512bh)_mm512_set1_epi32((int)low[row[r] + t]);
            acc[r][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][0], c, b0), a, b0);
            acc[r][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][1], c, b1), a, b1);
        }
    }
    for (int r = 0; r < VALUE_ROWS && r0 + r < rows; r++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / totals[r0 + r]);
        for (int v = 0; v < 2; v++) {
            const int64_t d = d0 + 16 * v;
            if (d >= dim) break;
            const __mmask16 keep = dim - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dim - d)) - 1);
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][v], inverse));
            _mm256_mask_storeu_epi16(out + (r0 + r) * out_step + d, keep, y);
        }
    }
}
#endif

/* 1 when this CPU runs the kernel (AVX-512 F and BF16) and int4q_max_level() allows it. */
int int4q_causal_available(void) {
#if INT4Q_X86
    return int4q_max_level() >= INT4Q_AVX512_BF16 && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* Queries [first, first + rows) of one head (rows <= INT4Q_CAUSAL_ROWS): q bf16 rows of `dim` (even)
 * at q_step elements apart (even, as is q's offset); keys packed [dim / 2][key_stride] (key_stride a
 * multiple of INT4Q_CAUSAL_KEYS, at least first + rows rounded up to it); values packed [positions
 * rounded up to even / 2][value_stride] (value_stride a multiple of INT4Q_CAUSAL_DIMS, at least dim);
 * scratch with R = INT4Q_CAUSAL_ROWS: scores fp32 [R][key_stride], weights bf16 [2][R][key_stride],
 * totals fp32 [R]; out bf16 rows of `dim` at out_step elements apart. Only where
 * int4q_causal_available(). */
void int4q_causal_block(const uint16_t *q, int64_t q_step, int64_t first, int64_t rows, int64_t dim,
                        const uint32_t *keys, int64_t key_stride, const uint32_t *values, int64_t value_stride,
                        float scale, float *scores, uint16_t *weights, float *totals, uint16_t *out,
                        int64_t out_step) {
#if INT4Q_X86
    const int64_t end = first + rows, width = (end + INT4Q_CAUSAL_KEYS - 1) / INT4Q_CAUSAL_KEYS * INT4Q_CAUSAL_KEYS;
    const uint32_t *qw = (const uint32_t *)(q + first * q_step);
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS)
        for (int64_t j0 = 0; j0 < width; j0 += INT4Q_CAUSAL_KEYS)
            score_tile(qw, q_step / 2, rows, r0, keys, key_stride, dim / 2, j0, scores, key_stride);
    uint16_t *high = weights, *low = weights + INT4Q_CAUSAL_ROWS * key_stride;
    for (int64_t r = 0; r < rows; r++)
        totals[r] = weigh_row(scores + r * key_stride, first + r, width, scale, high + r * key_stride,
                              low + r * key_stride);
    for (int64_t r0 = 0; r0 < rows; r0 += VALUE_ROWS)
        for (int64_t d0 = 0; d0 < dim; d0 += INT4Q_CAUSAL_DIMS)
            value_tile((const uint32_t *)high, (const uint32_t *)low, key_stride / 2, rows, r0, values, value_stride,
                       (end + 1) / 2, d0, dim, totals, out + first * out_step, out_step);
#else
    (void)q, (void)q_step, (void)first, (void)rows, (void)dim, (void)keys, (void)key_stride, (void)values,
        (void)value_stride, (void)scale, (void)scores, (void)weights, (void)totals, (void)out, (void)out_step;
#endif
}

/* Keys bf16 [positions] rows of `dim` at k_step elements apart -> words [dim / 2][key_stride],
 * zeros past the positions. */
void int4q_causal_pack_keys(const uint16_t *k, int64_t k_step, int64_t positions, int64_t dim, int64_t key_stride,
                            uint32_t *keys) {
    for (int64_t p = 0; p < dim / 2; p++) {
        uint32_t *dst = keys + p * key_stride;
        for (int64_t l = 0; l < positions; l++)
            dst[l] = (uint32_t)k[l * k_step + 2 * p] | (uint32_t)k[l * k_step + 2 * p + 1] << 16;
        for (int64_t l = positions; l < key_stride; l++) dst[l] = 0;
    }
}

/* Values bf16 [positions] rows of `dim` at v_step elements apart -> words [(positions + 1) / 2]
 * [value_stride], zeros past the positions and the dimensions. */
void int4q_causal_pack_values(const uint16_t *v, int64_t v_step, int64_t positions, int64_t dim, int64_t value_stride,
                              uint32_t *values) {
    for (int64_t t = 0; t < (positions + 1) / 2; t++) {
        const uint16_t *even = v + 2 * t * v_step, *odd = 2 * t + 1 < positions ? even + v_step : 0;
        uint32_t *dst = values + t * value_stride;
        for (int64_t d = 0; d < dim; d++) dst[d] = (uint32_t)even[d] | (odd ? (uint32_t)odd[d] << 16 : 0u);
        for (int64_t d = dim; d < value_stride; d++) dst[d] = 0;
    }
}
