/* One query's attention over a bf16 KV cache, computed in fp32 (the int8 decode step's attention):
 * out[h] = bf16(sum_l p_l v[h / group][l] / sum_l p_l), p_l = exp(s_l - max s), s_l = scale * q[h] . k[h / group][l],
 * with group = heads / kv_heads query heads sharing each cached head. Every bf16 value widens to fp32
 * exactly; the sums are fp32 in an order of this file's choosing, and the result is rounded once.
 *
 * AVX2 + FMA where the CPU has them and the head dimension is a multiple of 8 (exp by a degree-6
 * polynomial after range reduction, within a few ulp of expf); plain C otherwise.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

/* One head, plain C: q fp32 [dim], scores scratch [length], acc scratch [dim]. */
static void head_portable(const float *q, const uint16_t *k, const uint16_t *v, int64_t length, int64_t dim,
                          int64_t k_step, int64_t v_step, float scale, float *scores, float *acc, uint16_t *out) {
    float top = -INFINITY;
    for (int64_t l = 0; l < length; l++) {
        float dot = 0;
        for (int64_t d = 0; d < dim; d++) dot += q[d] * int4q_bf16_to_float(k[l * k_step + d]);
        scores[l] = dot * scale;
        top = scores[l] > top ? scores[l] : top;
    }
    float total = 0;
    for (int64_t d = 0; d < dim; d++) acc[d] = 0;
    for (int64_t l = 0; l < length; l++) {
        const float p = expf(scores[l] - top);
        total += p;
        for (int64_t d = 0; d < dim; d++) acc[d] += p * int4q_bf16_to_float(v[l * v_step + d]);
    }
    for (int64_t d = 0; d < dim; d++) out[d] = int4q_float_to_bf16(acc[d] / total);
}

#if INT4Q_X86
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256 widen8(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

/* int4q.h's e^x for x <= 0, eight at a time. */
AVX2 static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(INT4Q_EXPF_FLOOR));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(INT4Q_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(INT4Q_LN2_HIGH), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(INT4Q_LN2_LOW), r);
    __m256 p = _mm256_set1_ps(int4q_expf_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(int4q_expf_poly[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

/* head_portable with dim % 8 == 0. */
AVX2 static void head_avx2(const float *q, const uint16_t *k, const uint16_t *v, int64_t length, int64_t dim,
                           int64_t k_step, int64_t v_step, float scale, float *scores, float *acc, uint16_t *out) {
    float top = -INFINITY;
    for (int64_t l = 0; l < length; l++) {
        __m256 dot = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d += 8)
            dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen8(k + l * k_step + d), dot);
        scores[l] = int4q_sum8(dot) * scale;
        top = scores[l] > top ? scores[l] : top;
    }
    __m256 sums = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= length; l += 8) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + l), _mm256_set1_ps(top)));
        _mm256_storeu_ps(scores + l, p);
        sums = _mm256_add_ps(sums, p);
    }
    float total = int4q_sum8(sums);
    for (; l < length; l++) {
        scores[l] = expf(scores[l] - top);
        total += scores[l];
    }
    for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(acc + d, _mm256_setzero_ps());
    for (l = 0; l < length; l++) {
        const __m256 p = _mm256_set1_ps(scores[l]);
        for (int64_t d = 0; d < dim; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, widen8(v + l * v_step + d), _mm256_loadu_ps(acc + d)));
    }
    for (int64_t d = 0; d < dim; d++) out[d] = int4q_float_to_bf16(acc[d] / total);
}
#endif

/* 1 when the vector path runs for this head dimension. */
int int4q_attend_vector(int64_t dim) {
#if INT4Q_X86
    return dim % 8 == 0 && int4q_gemv_rows_level();
#else
    (void)dim;
    return 0;
#endif
}

/* Query heads [first, last): q bf16 [heads][dim] (contiguous), k and v bf16 with head and position
 * strides (elements; each position's dim values contiguous), out bf16 [heads][dim]; scratch fp32
 * [length + 2 * dim]. heads % kv_heads == 0. */
void int4q_attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t heads, int64_t kv_heads,
                      int64_t length, int64_t dim, int64_t k_head_step, int64_t k_step, int64_t v_head_step,
                      int64_t v_step, float scale, float *scratch, uint16_t *out, int64_t first, int64_t last) {
    float *qf = scratch, *acc = scratch + dim, *scores = scratch + 2 * dim;
    const int64_t group = heads / kv_heads;
    for (int64_t h = first; h < last; h++) {
        for (int64_t d = 0; d < dim; d++) qf[d] = int4q_bf16_to_float(q[h * dim + d]);
        const uint16_t *kh = k + h / group * k_head_step, *vh = v + h / group * v_head_step;
#if INT4Q_X86
        if (int4q_attend_vector(dim)) {
            head_avx2(qf, kh, vh, length, dim, k_step, v_step, scale, scores, acc, out + h * dim);
            continue;
        }
#endif
        head_portable(qf, kh, vh, length, dim, k_step, v_step, scale, scores, acc, out + h * dim);
    }
}
