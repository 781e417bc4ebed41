/* Round-to-nearest on min/max grids stored in bf16, in one pass over a bf16 weight
 * (methods/minmax.py): per group, lo and hi; asymmetric scale = (hi - lo) / 15 and
 * zero = lo + 8 * scale, symmetric scale = max(-lo / 8, hi / 7, 0) and zero 0, each rounded to
 * bf16; the nearest codes on that stored grid (a scale of 0 takes code 8); and per row the error
 * statistics of the fp32 values (q - 8) * scale + zero: the sum of squared weights, the sum of
 * squared errors (both fp64, element j of a row into lane j % 8 in order, the lanes then pairwise;
 * groups are multiples of 8) and the largest absolute error. The AVX-512 path takes the same
 * operations in the same order, so both write the same bits.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

#define LANES 8
#define MID 8.0f
#define QMAX 15.0f

static inline __attribute__((always_inline)) double lanes_total(const double *v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* The bf16 (scale, zero) of a group from its lowest and highest value. */
static inline __attribute__((always_inline)) void stored_grid(float lo, float hi, int symmetric, uint16_t *scale,
                                                              uint16_t *zero) {
    if (symmetric) {
        const float a = -lo / MID, b = hi / (QMAX - MID), s = a > b ? a : b;
        *scale = int4q_float_to_bf16(s < 0.0f ? 0.0f : s);
        *zero = 0;
    } else {
        const float s = (hi - lo) / QMAX;
        *scale = int4q_float_to_bf16(s);
        *zero = int4q_float_to_bf16(lo + MID * s);
    }
}

static void minmax_portable(const uint16_t *w, uint8_t *codes, uint16_t *scale, uint16_t *zero, double *stats,
                            int64_t k, int64_t group, int64_t first, int64_t last, int symmetric) {
    const int64_t groups = k / group;
    for (int64_t i = first; i < last; i++) {
        const uint16_t *wi = w + i * k;
        uint8_t *ci = codes + i * k;
        double signal[LANES] = {0}, noise[LANES] = {0};
        float worst[LANES] = {0};
        for (int64_t gi = 0; gi < groups; gi++) {
            const uint16_t *wg = wi + gi * group;
            float low[LANES], high[LANES];
            for (int l = 0; l < LANES; l++) low[l] = high[l] = int4q_bf16_to_float(wg[l]);
            for (int64_t j0 = LANES; j0 < group; j0 += LANES)
                for (int l = 0; l < LANES; l++) {
                    const float v = int4q_bf16_to_float(wg[j0 + l]);
                    low[l] = v < low[l] ? v : low[l];
                    high[l] = v > high[l] ? v : high[l];
                }
            float lo = low[0], hi = high[0];
            for (int l = 1; l < LANES; l++) {
                lo = low[l] < lo ? low[l] : lo;
                hi = high[l] > hi ? high[l] : hi;
            }
            stored_grid(lo, hi, symmetric, scale + i * groups + gi, zero + i * groups + gi);
            const float s = int4q_bf16_to_float(scale[i * groups + gi]), z = int4q_bf16_to_float(zero[i * groups + gi]);
            const float safe = s == 0.0f ? 1.0f : s;
            for (int64_t j0 = 0; j0 < group; j0 += LANES)
                for (int l = 0; l < LANES; l++) {
                    const float v = int4q_bf16_to_float(wg[j0 + l]);
                    float q = rintf((v - z) / safe + MID);
                    q = q < 0.0f ? 0.0f : (q > QMAX ? QMAX : q);
                    q = s == 0.0f ? MID : q;
                    ci[gi * group + j0 + l] = (uint8_t)q;
                    const float err = (q - MID) * s + z - v, size = fabsf(err);
                    worst[l] = size > worst[l] ? size : worst[l];
                    signal[l] += (double)v * (double)v;
                    noise[l] += (double)err * (double)err;
                }
        }
        float largest = 0.0f;
        for (int l = 0; l < LANES; l++) largest = worst[l] > largest ? worst[l] : largest;
        stats[3 * i] = lanes_total(signal);
        stats[3 * i + 1] = lanes_total(noise);
        stats[3 * i + 2] = largest;
    }
}

#if INT4Q_X86
/* Eight bf16 weights as fp32. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m256 eight(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* minmax_portable's loops with lane l of each vector as its lane l: the same operations, in order. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void minmax_avx512(
    const uint16_t *w, uint8_t *codes, uint16_t *scale, uint16_t *zero, double *stats, int64_t k, int64_t group,
    int64_t first, int64_t last, int symmetric) {
    const int64_t groups = k / group;
    const __m256 mid = _mm256_set1_ps(MID), qmax = _mm256_set1_ps(QMAX), zeros = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = first; i < last; i++) {
        const uint16_t *wi = w + i * k;
        uint8_t *ci = codes + i * k;
        __m512d signal = _mm512_setzero_pd(), noise = _mm512_setzero_pd();
        __m256 worst = zeros;
        for (int64_t gi = 0; gi < groups; gi++) {
            const uint16_t *wg = wi + gi * group;
            __m256 low = eight(wg), high = low;
            for (int64_t j0 = LANES; j0 < group; j0 += LANES) {
                const __m256 v = eight(wg + j0);
                low = _mm256_min_ps(v, low);  /* v < low ? v : low */
                high = _mm256_max_ps(v, high);
            }
            float lows[LANES], highs[LANES];
            _mm256_storeu_ps(lows, low);
            _mm256_storeu_ps(highs, high);
            float lo = lows[0], hi = highs[0];
            for (int l = 1; l < LANES; l++) {
                lo = lows[l] < lo ? lows[l] : lo;
                hi = highs[l] > hi ? highs[l] : hi;
            }
            stored_grid(lo, hi, symmetric, scale + i * groups + gi, zero + i * groups + gi);
            const float s1 = int4q_bf16_to_float(scale[i * groups + gi]);
            const float z1 = int4q_bf16_to_float(zero[i * groups + gi]);
            const __m256 s = _mm256_set1_ps(s1), z = _mm256_set1_ps(z1), safe = _mm256_set1_ps(s1 == 0.0f ? 1.0f : s1);
            for (int64_t j0 = 0; j0 < group; j0 += LANES) {
                const __m256 v = eight(wg + j0);
                __m256 q = _mm256_round_ps(_mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(v, z), safe), mid),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q = _mm256_blendv_ps(q, zeros, _mm256_cmp_ps(q, zeros, _CMP_LT_OQ));
                q = _mm256_blendv_ps(q, qmax, _mm256_cmp_ps(q, qmax, _CMP_GT_OQ));
                if (s1 == 0.0f) q = mid;
                _mm_storel_epi64((__m128i *)(ci + gi * group + j0), _mm256_cvtepi32_epi8(_mm256_cvttps_epi32(q)));
                const __m256 err = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, mid), s), z), v);
                const __m256 size = _mm256_andnot_ps(sign, err);
                worst = _mm256_blendv_ps(worst, size, _mm256_cmp_ps(size, worst, _CMP_GT_OQ));
                const __m512d vd = _mm512_cvtps_pd(v), ed = _mm512_cvtps_pd(err);
                signal = _mm512_add_pd(signal, _mm512_mul_pd(vd, vd));
                noise = _mm512_add_pd(noise, _mm512_mul_pd(ed, ed));
            }
        }
        double signals[LANES], noises[LANES];
        float worsts[LANES];
        _mm512_storeu_pd(signals, signal);
        _mm512_storeu_pd(noises, noise);
        _mm256_storeu_ps(worsts, worst);
        float largest = 0.0f;
        for (int l = 0; l < LANES; l++) largest = worsts[l] > largest ? worsts[l] : largest;
        stats[3 * i] = lanes_total(signals);
        stats[3 * i + 1] = lanes_total(noises);
        stats[3 * i + 2] = largest;
    }
}
#endif

/* Rows [first, last) of w bf16 [rows, k] (k a multiple of group, group of 8): codes uint8 [rows, k], scale and
 * zero bf16 [rows, k / group], stats fp64 [rows, 3] (sum of squared weights, sum of squared
 * errors, largest absolute error). */
void int4q_rtn_minmax(const uint16_t *w, uint8_t *codes, uint16_t *scale, uint16_t *zero, double *stats, int64_t k,
                      int64_t group, int64_t first, int64_t last, int symmetric) {
#if INT4Q_X86
    if (int4q_max_level() >= INT4Q_AVX512 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
        minmax_avx512(w, codes, scale, zero, stats, k, group, first, last, symmetric);
        return;
    }
#endif
    minmax_portable(w, codes, scale, zero, stats, k, group, first, last, symmetric);
}
