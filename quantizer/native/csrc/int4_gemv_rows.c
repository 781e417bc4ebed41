/* The decode matmul for one activation row read from the checkpoint's own row-major layout, for
 * CPUs whose tinygemm layout int4q does not decode (AVX2 without AVX-512): out[c] = bf16(sum_k
 * x[k] * ((q - 8) * scale + zero)), accumulated in fp32.
 *
 * Byte j of a channel's row holds codes 2j (low nibble) and 2j + 1 (high nibble), so x is split
 * once per call into its even and odd elements (xe, xo, fp32): a byte's low nibbles multiply xe,
 * its high nibbles xo. Per group the sum is factored as scale * sum x q + (zero - 8 scale) * sum x;
 * each product of a bf16 x and a code is exact in fp32. Channels are taken ROWS at a time, so the
 * loads of x serve ROWS weight rows.
 *
 * AVX2 and FMA where the CPU has them and int4q_max_level() is above INT4Q_PORTABLE; plain C
 * otherwise (the same sums, in another order). Registered by gemv_rows_ops.cpp.
 */
#include <stdint.h>

#include "int4q.h"

#define ROWS 4          /* channels per pass */
#define STEP_BYTES 8    /* bytes of a row per vector step: 16 codes */
#define PREFETCH_EVERY 64 /* bytes: one cache line */

static void rows_portable(const float *xe, const float *xo, const float *xsum, const uint8_t *packed,
                          const uint16_t *scale, const uint16_t *zero, uint16_t *out, int64_t k, int64_t group_size,
                          int64_t first, int64_t last) {
    const int64_t half = k / 2, groups = k / group_size;
    for (int64_t c = first; c < last; c++) {
        const uint8_t *row = packed + c * half;
        float y = 0;
        for (int64_t g = 0; g < groups; g++) {
            float dot = 0;
            for (int64_t j = g * group_size / 2; j < (g + 1) * group_size / 2; j++)
                dot += xe[j] * (float)(row[j] & 0x0F) + xo[j] * (float)(row[j] >> 4);
            const float s = int4q_bf16_to_float(scale[c * groups + g]);
            const float z = int4q_bf16_to_float(zero[c * groups + g]);
            y += s * dot + (z - 8.0f * s) * xsum[g];
        }
        out[c] = int4q_float_to_bf16(y);
    }
}

#if INT4Q_X86
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

/* Channels [c0, c0 + nr), nr <= ROWS. */
AVX2 static inline __attribute__((always_inline)) void rows_avx2(
    const float *xe, const float *xo, const float *xsum, const uint8_t *packed, const uint16_t *scale,
    const uint16_t *zero, uint16_t *out, int64_t k, int64_t group_size, int64_t c0, const int nr) {
    const int64_t half = k / 2, groups = k / group_size, group_bytes = group_size / 2;
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    __m256 y[ROWS];
    float bias[ROWS];
    for (int r = 0; r < nr; r++) y[r] = _mm256_setzero_ps(), bias[r] = 0;
    for (int64_t g = 0; g < groups; g++) {
        __m256 low[ROWS], high[ROWS]; /* separate chains, so the FMAs of a step do not wait on each other */
        for (int r = 0; r < nr; r++) low[r] = high[r] = _mm256_setzero_ps();
        for (int64_t j = g * group_bytes; j < (g + 1) * group_bytes; j += STEP_BYTES) {
            const __m256 even = _mm256_loadu_ps(xe + j), odd = _mm256_loadu_ps(xo + j);
            if (j % PREFETCH_EVERY == 0) /* the next ROWS channels' bytes at this offset, a pass ahead */
                for (int r = 0; r < nr; r++)
                    _mm_prefetch((const char *)(packed + (c0 + nr + r) * half + j), _MM_HINT_T0);
            for (int r = 0; r < nr; r++) {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(packed + (c0 + r) * half + j)));
                low[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, nibble)), even, low[r]);
                high[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), odd, high[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const float s = int4q_bf16_to_float(scale[(c0 + r) * groups + g]);
            const float z = int4q_bf16_to_float(zero[(c0 + r) * groups + g]);
            y[r] = _mm256_fmadd_ps(_mm256_add_ps(low[r], high[r]), _mm256_set1_ps(s), y[r]);
            bias[r] += (z - 8.0f * s) * xsum[g];
        }
    }
    for (int r = 0; r < nr; r++) out[c0 + r] = int4q_float_to_bf16(int4q_sum8(y[r]) + bias[r]);
}

AVX2 static void rows_vector(const float *xe, const float *xo, const float *xsum, const uint8_t *packed,
                             const uint16_t *scale, const uint16_t *zero, uint16_t *out, int64_t k,
                             int64_t group_size, int64_t first, int64_t last) {
    int64_t c = first;
    for (; c + ROWS <= last; c += ROWS) rows_avx2(xe, xo, xsum, packed, scale, zero, out, k, group_size, c, ROWS);
    for (; c < last; c++) rows_avx2(xe, xo, xsum, packed, scale, zero, out, k, group_size, c, 1);
}
#endif

/* 1 when this CPU has AVX2 and FMA and int4q_max_level() allows vectors. */
int int4q_gemv_rows_level(void) {
#if INT4Q_X86
    if (int4q_max_level() > INT4Q_PORTABLE && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 1;
#endif
    return 0;
}

/* x bf16 [k] -> xe, xo fp32 [k / 2] (its even and odd elements) and xsum fp32 [k / group_size]
 * (each group's sum, in order). */
void int4q_split_row(const uint16_t *x, int64_t k, int64_t group_size, float *xe, float *xo, float *xsum) {
    for (int64_t j = 0; j < k / 2; j++) {
        xe[j] = int4q_bf16_to_float(x[2 * j]);
        xo[j] = int4q_bf16_to_float(x[2 * j + 1]);
    }
    int4q_group_sums(x, k, group_size, xsum);
}

/* Output channels [first, last): packed uint8 [n, k / 2] row-major nibbles, scale and zero bf16
 * [n, k / group_size], out bf16 [n]; group_size % 16 == 0, k % group_size == 0. */
void int4q_gemv_rows(const float *xe, const float *xo, const float *xsum, const uint8_t *packed,
                     const uint16_t *scale, const uint16_t *zero, uint16_t *out, int64_t k, int64_t group_size,
                     int64_t first, int64_t last) {
#if INT4Q_X86
    if (int4q_gemv_rows_level()) {
        rows_vector(xe, xo, xsum, packed, scale, zero, out, k, group_size, first, last);
        return;
    }
#endif
    rows_portable(xe, xo, xsum, packed, scale, zero, out, k, group_size, first, last);
}
