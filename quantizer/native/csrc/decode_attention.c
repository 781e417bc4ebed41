/* One query's attention over a bf16 KV cache, computed in fp32 (the int8 decode step's attention):
 * out[h] = bf16(sum_l p_l v[h / group][l] / sum_l p_l), p_l = exp(s_l - max s), s_l = scale * q[h] . k[h / group][l],
 * with group = heads / kv_heads query heads sharing each cached head. Every bf16 value widens to fp32
 * exactly; the sums are fp32 in an order of this file's choosing, and the result is rounded once.
 *
 * The cache is read once per cached head, not once per query head: a part takes the whole group of
 * query heads over up to INT4Q_ATTEND_CHUNK positions, and the parts of a head are merged after
 * (each rescaled by e^(its max - the overall max)). The chunks depend only on the length, so the
 * result does not depend on how parts are spread over threads.
 *
 * Three paths, chosen at run time: AVX-512 BF16 for head dimensions that are multiples of 64 (each
 * score's products exact by vdpbf16ps, sixteen positions' dot products reduced together; the
 * values widened to fp32 once per tile of up to six query heads); AVX2 + FMA for multiples of 8;
 * plain C otherwise. The vector paths' exp is int4q.h's degree-6 polynomial after range reduction,
 * within a few ulp of expf.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

#define TOP INT4Q_PART_TOP
#define TOTAL INT4Q_PART_TOTAL
#define ACC INT4Q_PART_ACC

/* A part in plain C: qf fp32 [group][dim], scores scratch [group][INT4Q_ATTEND_CHUNK]. */
static void part_portable(const float *qf, int64_t group, const uint16_t *k, const uint16_t *v, int64_t count,
                          int64_t dim, int64_t k_step, int64_t v_step, float scale, float *scores, float *part) {
    for (int64_t j = 0; j < group; j++) {
        float *s = scores + j * INT4Q_ATTEND_CHUNK, *out = part + j * (dim + ACC), top = -INFINITY, total = 0;
        for (int64_t l = 0; l < count; l++) {
            float dot = 0;
            for (int64_t d = 0; d < dim; d++) dot += qf[j * dim + d] * int4q_bf16_to_float(k[l * k_step + d]);
            s[l] = dot * scale;
            top = s[l] > top ? s[l] : top;
        }
        for (int64_t l = 0; l < count; l++) {
            s[l] = expf(s[l] - top);
            total += s[l];
        }
        for (int64_t d = 0; d < dim; d++) out[ACC + d] = 0;
        for (int64_t l = 0; l < count; l++)
            for (int64_t d = 0; d < dim; d++) out[ACC + d] += s[l] * int4q_bf16_to_float(v[l * v_step + d]);
        out[TOP] = top;
        out[TOTAL] = total;
    }
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

/* Scores of one head in place to their weights; returns their sum. */
AVX2 static float weigh(float *s, int64_t count, float top) {
    __m256 sums = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= count; l += 8) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + l), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + l, p);
        sums = _mm256_add_ps(sums, p);
    }
    float total = int4q_sum8(sums);
    for (; l < count; l++) {
        s[l] = expf(s[l] - top);
        total += s[l];
    }
    return total;
}

/* part_portable with dim % 8 == 0; row: scratch fp32 [dim] for the widened key or value. */
AVX2 static void part_avx2(const float *qf, int64_t group, const uint16_t *k, const uint16_t *v, int64_t count,
                           int64_t dim, int64_t k_step, int64_t v_step, float scale, float *scores, float *row,
                           float *part) {
    for (int64_t l = 0; l < count; l++) {
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(row + d, widen8(k + l * k_step + d));
        for (int64_t j = 0; j < group; j++) {
            __m256 dot = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8)
                dot = _mm256_fmadd_ps(_mm256_loadu_ps(qf + j * dim + d), _mm256_loadu_ps(row + d), dot);
            scores[j * INT4Q_ATTEND_CHUNK + l] = int4q_sum8(dot) * scale;
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *s = scores + j * INT4Q_ATTEND_CHUNK, *out = part + j * (dim + ACC), top = -INFINITY;
        for (int64_t l = 0; l < count; l++) top = s[l] > top ? s[l] : top;
        out[TOP] = top;
        out[TOTAL] = weigh(s, count, top);
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(out + ACC + d, _mm256_setzero_ps());
    }
    for (int64_t l = 0; l < count; l++) {
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(row + d, widen8(v + l * v_step + d));
        for (int64_t j = 0; j < group; j++) {
            const __m256 p = _mm256_set1_ps(scores[j * INT4Q_ATTEND_CHUNK + l]);
            float *acc = part + j * (dim + ACC) + ACC;
            for (int64_t d = 0; d < dim; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(row + d), _mm256_loadu_ps(acc + d)));
        }
    }
}

#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TILE_HEADS 6 /* query heads of a value tile at most: 6 heads x 64 dimensions in 24 accumulators */

/* Sixteen vectors' lane sums, as one vector in their order. */
BF16 static inline __m512 lane_sums16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

/* Scaled scores of one query head (q bf16 [dim], dim % 32 == 0) against positions [0, count):
 * each product exact (vdpbf16ps), the sums fp32. Returns the largest. */
BF16 static float scores_bf16(const uint16_t *q, const uint16_t *k, int64_t count, int64_t dim, int64_t k_step,
                              float scale, float *s) {
    const __m512 step = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= count; l += 16) {
        __m512 acc[16];
        for (int p = 0; p < 16; p++) acc[p] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512bh a = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 16
            for (int p = 0; p < 16; p++)
                acc[p] = _mm512_dpbf16_ps(acc[p], a, (__m512bh)_mm512_loadu_si512(k + (l + p) * k_step + d));
        }
        const __m512 scores = _mm512_mul_ps(lane_sums16(acc), step);
        _mm512_storeu_ps(s + l, scores);
        top = _mm512_max_ps(top, scores);
    }
    float largest = _mm512_reduce_max_ps(top);
    for (; l < count; l++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                                   (__m512bh)_mm512_loadu_si512(k + l * k_step + d));
        s[l] = _mm512_reduce_add_ps(acc) * scale;
        largest = s[l] > largest ? s[l] : largest;
    }
    return largest;
}

/* Scores [0, count) in place to their weights e^(s - top); returns their sum. */
BF16 static float weigh16(float *s, int64_t count, float top) {
    __m512 sums = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l += 16) {
        const __mmask16 live = count - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - l)) - 1);
        const __m512 e = int4q_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + l), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(s + l, live, e);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(live, e));
    }
    return _mm512_reduce_add_ps(sums);
}

/* acc[j] += sum_l w[j][l] v[l][0, 64) for `heads` query heads (a constant where inlined): each value
 * widened to fp32 once per tile, the weights fp32; w at INT4Q_ATTEND_CHUNK floats per head, acc at
 * acc_step. */
BF16 static inline __attribute__((always_inline)) void value_tile(int heads, const float *w, const uint16_t *v,
                                                                  int64_t count, int64_t v_step, float *acc,
                                                                  int64_t acc_step) {
    __m512 sums[TILE_HEADS][4];
    for (int j = 0; j < heads; j++)
        for (int i = 0; i < 4; i++) sums[j][i] = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l++) {
        __m512 x[4];
        for (int i = 0; i < 4; i++)
            x[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + l * v_step + 16 * i))), 16));
#pragma GCC unroll 6
        for (int j = 0; j < heads; j++) {
            const __m512 p = _mm512_set1_ps(w[j * INT4Q_ATTEND_CHUNK + l]);
            for (int i = 0; i < 4; i++) sums[j][i] = _mm512_fmadd_ps(p, x[i], sums[j][i]);
        }
    }
    for (int j = 0; j < heads; j++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + j * acc_step + 16 * i, sums[j][i]);
}

BF16 static void value_tiles(int heads, const float *w, const uint16_t *v, int64_t count, int64_t v_step,
                             float *acc, int64_t acc_step) {
    switch (heads) {
    case 1: value_tile(1, w, v, count, v_step, acc, acc_step); break;
    case 2: value_tile(2, w, v, count, v_step, acc, acc_step); break;
    case 3: value_tile(3, w, v, count, v_step, acc, acc_step); break;
    case 4: value_tile(4, w, v, count, v_step, acc, acc_step); break;
    case 5: value_tile(5, w, v, count, v_step, acc, acc_step); break;
    default: value_tile(TILE_HEADS, w, v, count, v_step, acc, acc_step); break;
    }
}

/* part_portable for dim % 64 == 0 with AVX-512 BF16, from q bf16 [group][dim]. */
BF16 static void part_bf16(const uint16_t *q, int64_t group, const uint16_t *k, const uint16_t *v, int64_t count,
                           int64_t dim, int64_t k_step, int64_t v_step, float scale, float *scores, float *part) {
    for (int64_t j = 0; j < group; j++) {
        float *s = scores + j * INT4Q_ATTEND_CHUNK, *out = part + j * (dim + ACC);
        out[TOP] = scores_bf16(q + j * dim, k, count, dim, k_step, scale, s);
        out[TOTAL] = weigh16(s, count, out[TOP]);
    }
    for (int64_t j = 0; j < group; j += TILE_HEADS) {
        const int heads = group - j < TILE_HEADS ? (int)(group - j) : TILE_HEADS;
        for (int64_t d = 0; d < dim; d += 64)
            value_tiles(heads, scores + j * INT4Q_ATTEND_CHUNK, v + d, count, v_step, part + j * (dim + ACC) + ACC + d,
                        dim + ACC);
    }
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

/* 1 when the AVX-512 BF16 path runs for this head dimension (the CPU and level check is the causal
 * kernel's: AVX-512 F, BW, VL and BF16). */
static int bf16_path(int64_t dim) {
#if INT4Q_X86
    return dim % 64 == 0 && int4q_causal_available();
#else
    (void)dim;
    return 0;
#endif
}

void int4q_attend_part(const uint16_t *q, int64_t group, const uint16_t *k, const uint16_t *v, int64_t begin,
                       int64_t end, int64_t dim, int64_t k_step, int64_t v_step, float scale, float *scratch,
                       float *part) {
    k += begin * k_step;
    v += begin * v_step;
#if INT4Q_X86
    if (bf16_path(dim)) {
        part_bf16(q, group, k, v, end - begin, dim, k_step, v_step, scale, scratch, part);
        return;
    }
#endif
    float *qf = scratch, *row = qf + group * dim, *scores = row + dim;
    for (int64_t i = 0; i < group * dim; i++) qf[i] = int4q_bf16_to_float(q[i]);
#if INT4Q_X86
    if (int4q_attend_vector(dim)) {
        part_avx2(qf, group, k, v, end - begin, dim, k_step, v_step, scale, scores, row, part);
        return;
    }
#endif
    part_portable(qf, group, k, v, end - begin, dim, k_step, v_step, scale, scores, part);
}

void int4q_attend_merge(const float *parts, int64_t count, int64_t part_step, int64_t dim, float *acc,
                        uint16_t *out) {
    float top = -INFINITY, total = 0;
    for (int64_t c = 0; c < count; c++) top = parts[c * part_step + TOP] > top ? parts[c * part_step + TOP] : top;
    for (int64_t d = 0; d < dim; d++) acc[d] = 0;
    for (int64_t c = 0; c < count; c++) {
        const float *part = parts + c * part_step, weight = expf(part[TOP] - top);
        total += part[TOTAL] * weight;
        for (int64_t d = 0; d < dim; d++) acc[d] += part[ACC + d] * weight;
    }
    for (int64_t d = 0; d < dim; d++) out[d] = int4q_float_to_bf16(acc[d] / total);
}
