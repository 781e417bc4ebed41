/* The int8-activation matmul (W4A8) read from the checkpoint's own row-major layout, for CPUs with
 * AVX2 but no AVX-512 (whose int4 linears keep that layout; see int4_gemv_rows.c): out[m][c] =
 * bf16(sum_k x[m][k] * ((q - 8) * scale + zero)), each row's activations rounded to int8 per weight
 * group as int4_w4a8.c rounds them, so both operators compute the same sums.
 *
 * Per row and group g: xscale * scale * (sum xq q - 8 sum xq) + zero * sum x. The first sum is
 * exact in int32: vpmaddubsw multiplies the unsigned codes by the signed activations in pairs
 * (|pair| <= 2 * 15 * 127, no saturation), vpmaddwd widens to int32. Byte j of a channel's row
 * holds codes 2j (low nibble) and 2j + 1 (high), so the activations come split into their even and
 * odd elements (int4q_w4a8_split): one 32-byte step of a row is 64 codes, its low nibbles against
 * 32 even activations and its high nibbles against the 32 odd ones.
 *
 * A step spans one group (group_size >= 64, one int32 sum per group) or two (group_size 32, the
 * vector's halves scaled apart). Only where int4q_w4a8_rows_available().
 */
#include <stdint.h>

#include "int4q.h"

#define ROWS 4        /* output channels per pass, sharing the activations' loads */
#define STEP 32       /* bytes of a channel's row per step: 64 codes */
#define SLAB 64       /* groups whose factors are computed at once (even, for group_size 32) */
#define LINE 64       /* bytes per cache line */

/* xq int8 [k] (natural order) -> even, odd int8 [k / 2]: its even and odd elements. */
void int4q_w4a8_split(const int8_t *xq, int64_t k, int8_t *even, int8_t *odd) {
    for (int64_t j = 0; j < k / 2; j++) {
        even[j] = xq[2 * j];
        odd[j] = xq[2 * j + 1];
    }
}

#if INT4Q_X86
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

/* The even and odd elements of 16 bf16 values, as 8 floats each. */
AVX2 static inline void load_pairs(const uint16_t *x, __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)x);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* a, b int32 [8] each (in [-127, 127]) -> 16 int8 at dst, in order. */
AVX2 static inline void store_codes(__m256i a, __m256i b, int8_t *dst) {
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    const __m256i bytes = _mm256_packs_epi16(words, words);
    _mm_storel_epi64((__m128i *)dst, _mm256_castsi256_si128(bytes));
    _mm_storel_epi64((__m128i *)(dst + 8), _mm256_extracti128_si256(bytes, 1));
}

/* One group of x (group_size % 32 == 0) rounded as int4_w4a8.c's quantize_group rounds it (the
 * sum of x in another order), its codes written as their even and odd elements. */
AVX2 static void quantize_group_split(const uint16_t *x, int64_t group_size, int8_t *even, int8_t *odd,
                                      float *xscale, int32_t *xqsum, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < group_size; i += 16) {
        __m256 e, o;
        load_pairs(x + i, &e, &o);
        sum = _mm256_add_ps(sum, _mm256_add_ps(e, o));
        amax = _mm256_max_ps(amax, _mm256_max_ps(_mm256_andnot_ps(sign, e), _mm256_andnot_ps(sign, o)));
    }
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
    const __m256 inv = _mm256_set1_ps(top > 0 ? 127.0f / top : 0.0f);
    __m256i qsum = _mm256_setzero_si256();
    for (int64_t i = 0; i < group_size; i += 32) {
        __m256 e0, o0, e1, o1;
        load_pairs(x + i, &e0, &o0);
        load_pairs(x + i + 16, &e1, &o1);
        /* nearest even, as rintf */
        const __m256i qe0 = _mm256_cvtps_epi32(_mm256_mul_ps(e0, inv));
        const __m256i qo0 = _mm256_cvtps_epi32(_mm256_mul_ps(o0, inv));
        const __m256i qe1 = _mm256_cvtps_epi32(_mm256_mul_ps(e1, inv));
        const __m256i qo1 = _mm256_cvtps_epi32(_mm256_mul_ps(o1, inv));
        store_codes(qe0, qe1, even + i / 2);
        store_codes(qo0, qo1, odd + i / 2);
        qsum = _mm256_add_epi32(qsum, _mm256_add_epi32(_mm256_add_epi32(qe0, qo0), _mm256_add_epi32(qe1, qo1)));
    }
    __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4E));
    q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xB1));
    *xscale = top / 127.0f;
    *xqsum = _mm_cvtsi128_si32(q4);
    *xsum = int4q_sum8(sum);
}

/* f[g - g0] = scale[g] * xscale[g] for groups [g0, g1) of one channel; returns the sum over them of
 * zero * xsum - 8 * f * xqsum (the terms that need no codes). */
AVX2 static inline __attribute__((always_inline)) float channel_factors(
    const uint16_t *scale, const uint16_t *zero, const float *xscale, const int32_t *xqsum, const float *xsum,
    int64_t g0, int64_t g1, float *f) {
    __m256 bias = _mm256_setzero_ps();
    int64_t g = g0;
    for (; g + 8 <= g1; g += 8) {
        const __m256 s = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(scale + g))), 16));
        const __m256 z = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(zero + g))), 16));
        const __m256 fs = _mm256_mul_ps(s, _mm256_loadu_ps(xscale + g));
        _mm256_storeu_ps(f + g - g0, fs);
        bias = _mm256_fmadd_ps(z, _mm256_loadu_ps(xsum + g), bias);
        bias = _mm256_fnmadd_ps(_mm256_mul_ps(fs, _mm256_set1_ps(8.0f)),
                                _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xqsum + g))), bias);
    }
    float tail = 0;
    for (; g < g1; g++) {
        f[g - g0] = int4q_bf16_to_float(scale[g]) * xscale[g];
        tail += int4q_bf16_to_float(zero[g]) * xsum[g] - 8.0f * f[g - g0] * (float)xqsum[g];
    }
    return int4q_sum8(bias) + tail;
}

/* The int32 pair sums of one step: the codes of 32 row bytes against 32 even and 32 odd activations. */
AVX2 static inline __m256i step_dot(const uint8_t *bytes, __m256i even, __m256i odd) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i b = _mm256_loadu_si256((const __m256i *)bytes);
    const __m256i low = _mm256_and_si256(b, nibble), high = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, even), _mm256_maddubs_epi16(high, odd));
    return _mm256_madd_epi16(pairs, ones);
}

/* Channels [c0, c0 + nr) of one activation row (nr <= ROWS); `ahead` prefetches the next pass. */
AVX2 static inline __attribute__((always_inline)) void pass_avx2(
    const int8_t *even, const int8_t *odd, const float *xscale, const int32_t *xqsum, const float *xsum,
    const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, uint16_t *out, int64_t k,
    int64_t group_size, int64_t c0, const int nr, int ahead) {
    const int64_t half = k / 2, groups = k / group_size, group_bytes = group_size / 2;
    float f[ROWS][SLAB], bias[ROWS];
    __m256 y[ROWS];
    for (int r = 0; r < nr; r++) y[r] = _mm256_setzero_ps(), bias[r] = 0;
    for (int64_t g0 = 0; g0 < groups; g0 += SLAB) {
        const int64_t g1 = g0 + SLAB < groups ? g0 + SLAB : groups;
        for (int r = 0; r < nr; r++) {
            const int64_t c = c0 + r;
            bias[r] += channel_factors(scale + c * groups, zero + c * groups, xscale, xqsum, xsum, g0, g1, f[r]);
        }
        /* one span: a group of >= 64 codes, or two groups of 32 */
        const int64_t span_groups = group_size >= 64 ? 1 : 2, span_bytes = span_groups * group_bytes;
        for (int64_t g = g0; g < g1; g += span_groups) {
            __m256i dot[ROWS];
            for (int r = 0; r < nr; r++) dot[r] = _mm256_setzero_si256();
            for (int64_t j = g * group_bytes; j < g * group_bytes + span_bytes; j += STEP) {
                const __m256i xe = _mm256_loadu_si256((const __m256i *)(even + j));
                const __m256i xo = _mm256_loadu_si256((const __m256i *)(odd + j));
                if (ahead && j % LINE == 0)
                    for (int r = 0; r < nr; r++)
                        _mm_prefetch((const char *)(packed + (c0 + nr + r) * half + j), _MM_HINT_T0);
                for (int r = 0; r < nr; r++)
                    dot[r] = _mm256_add_epi32(dot[r], step_dot(packed + (c0 + r) * half + j, xe, xo));
            }
            for (int r = 0; r < nr; r++) {
                const __m256 factor = span_groups == 1 ? _mm256_broadcast_ss(&f[r][g - g0])
                                                       : _mm256_set_m128(_mm_broadcast_ss(&f[r][g - g0 + 1]),
                                                                         _mm_broadcast_ss(&f[r][g - g0]));
                y[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), factor, y[r]);
            }
        }
    }
    for (int r = 0; r < nr; r++) out[c0 + r] = int4q_float_to_bf16(int4q_sum8(y[r]) + bias[r]);
}

AVX2 static void rows_avx2(const int8_t *even, const int8_t *odd, const float *xscale, const int32_t *xqsum,
                           const float *xsum, int64_t m, const uint8_t *packed, const uint16_t *scale,
                           const uint16_t *zero, uint16_t *out, int64_t n, int64_t k, int64_t group_size,
                           int64_t first, int64_t last) {
    const int64_t groups = k / group_size, half = k / 2;
    int64_t c = first;
    for (; c + ROWS <= last; c += ROWS)
        for (int64_t i = 0; i < m; i++)
            pass_avx2(even + i * half, odd + i * half, xscale + i * groups, xqsum + i * groups, xsum + i * groups,
                      packed, scale, zero, out + i * n, k, group_size, c, ROWS, i == 0 && c + 2 * ROWS <= last);
    for (; c < last; c++)
        for (int64_t i = 0; i < m; i++)
            pass_avx2(even + i * half, odd + i * half, xscale + i * groups, xqsum + i * groups, xsum + i * groups,
                      packed, scale, zero, out + i * n, k, group_size, c, 1, 0);
}
#endif

/* 1 when this CPU has AVX2 and FMA and int4q_max_level() allows vectors. */
int int4q_w4a8_rows_available(void) { return int4q_gemv_rows_level(); }

/* Row x bf16 [k] -> its int8 codes as even, odd [k / 2] (int4q_w4a8_split of int4q_quantize_row's)
 * and, per group, xscale, xqsum and xsum as int4q_quantize_row gives them (xsum summed in another
 * order where vectors are used); group_size % 32 == 0. */
void int4q_quantize_row_split(const uint16_t *x, int64_t k, int64_t group_size, int8_t *xq, int8_t *even,
                              int8_t *odd, float *xscale, int32_t *xqsum, float *xsum) {
#if INT4Q_X86
    if (int4q_w4a8_rows_available() && group_size % 32 == 0) {
        for (int64_t g = 0; g < k / group_size; g++)
            quantize_group_split(x + g * group_size, group_size, even + g * group_size / 2, odd + g * group_size / 2,
                                 xscale + g, xqsum + g, xsum + g);
        return;
    }
#endif
    int4q_quantize_row(x, k, group_size, xq, xscale, xqsum, xsum);
    int4q_w4a8_split(xq, k, even, odd);
}

/* Output channels [first, last) of m rows: even/odd int8 [m][k / 2] from int4q_w4a8_split of
 * int4q_quantize_row's codes, xscale/xqsum/xsum [m][k / group_size] from it; packed uint8
 * [n, k / 2] row-major nibbles, scale and zero bf16 [n, k / group_size], out bf16 [m][n];
 * group_size 32 with k % 64 == 0, or group_size % 64 == 0. Only where int4q_w4a8_rows_available(). */
void int4q_w4a8_rows(const int8_t *even, const int8_t *odd, const float *xscale, const int32_t *xqsum,
                     const float *xsum, int64_t m, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero,
                     uint16_t *out, int64_t n, int64_t k, int64_t group_size, int64_t first, int64_t last) {
#if INT4Q_X86
    rows_avx2(even, odd, xscale, xqsum, xsum, m, packed, scale, zero, out, n, k, group_size, first, last);
#else
    (void)even, (void)odd, (void)xscale, (void)xqsum, (void)xsum, (void)m, (void)packed, (void)scale, (void)zero,
        (void)out, (void)n, (void)k, (void)group_size, (void)first, (void)last;
#endif
}
