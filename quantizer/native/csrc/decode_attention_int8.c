/* One query's attention over an int8 KV cache (the decode step's `--kv-cache int8`), in layouts made for
 * integer dot products. Each cached value row (one position of one head) is int8 codes times an fp32
 * scale, the largest magnitude / 127; each key row the same per block of 32 dimensions (keys have
 * channels far larger than the others, and one scale a row leaves the rest a few levels). Per cached head:
 *   keys          uint8 [positions / 16][dim / 4][16][4]: sixteen positions' codes + 128 side by side,
 *                 four dimensions at a time, so that one vpdpbusd gives sixteen positions' partial dot
 *                 products;
 *   key scales    fp32 [positions / 16][dim / 32][16]: a block's scales of sixteen positions together;
 *   values        int8 [positions / 2][dim][2]: two positions' codes side by side, so that one vpdpwssd
 *                 adds two positions' weighted values to sixteen dimensions;
 *   value scales  fp32 [positions].
 * The query heads are int8 codes times a scale each (int4q_attend_quantize_query). A score is the sum over
 * key blocks of the block's integer dot product times its key scale, times the query's and the attention's
 * scales; the softmax is fp32; the weights
 * times the values' scales are rounded to int16 against their largest in the part (within 2^-16 of it)
 * and the weighted sum of values is an exact integer sum, times that unit. The parts and their merge are
 * decode_attention.c's.
 *
 * Head dimensions are multiples of 32. Two paths, chosen at run time: AVX-512 with VNNI, and plain C (the
 * same integers, exact) where the CPU lacks it.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

#define CODE_LIMIT 127.0f    /* the largest magnitude of a code */
#define KEY_OFFSET 128       /* added to the keys' codes, so that they are unsigned */
#define WEIGHT_LIMIT 32767.0f /* the largest int16 weight */
#define BLOCK 16             /* positions of a key block */
#define KEY_DIMS INT4Q_KV_KEY_DIMS

static inline float larger(float a, float b) { return a > b ? a : b; }

/* The scale of a row x bf16 [dim] and its codes, code d written to out[d * step]. */
static float quantize_row(const uint16_t *x, int64_t dim, int8_t *out, int64_t step) {
    float largest = 0;
    for (int64_t d = 0; d < dim; d++) largest = larger(largest, fabsf(int4q_bf16_to_float(x[d])));
    const float scale = largest / CODE_LIMIT;
    for (int64_t d = 0; d < dim; d++) {
        const float code = largest > 0 ? rintf(int4q_bf16_to_float(x[d]) / scale) : 0.0f;
        out[d * step] = (int8_t)(code > CODE_LIMIT ? CODE_LIMIT : code < -CODE_LIMIT ? -CODE_LIMIT : code);
    }
    return scale;
}

/* Where position p's scale of key block b is, in a head's key scales. */
static inline int64_t key_scale_at(int64_t p, int64_t b, int64_t dim) {
    return p / BLOCK * (dim / KEY_DIMS) * BLOCK + b * BLOCK + p % BLOCK;
}

void int4q_kv_int8_store(const uint16_t *k, const uint16_t *v, int64_t dim, int64_t position, uint8_t *keys,
                         float *key_scales, int8_t *values, float *value_scales) {
    int8_t codes[KEY_DIMS];
    uint8_t *block = keys + position / BLOCK * BLOCK * dim + position % BLOCK * 4;
    for (int64_t b = 0; b < dim / KEY_DIMS; b++) {
        key_scales[key_scale_at(position, b, dim)] = quantize_row(k + b * KEY_DIMS, KEY_DIMS, codes, 1);
        for (int64_t i = 0; i < KEY_DIMS; i++) {
            const int64_t d = b * KEY_DIMS + i;
            block[d / 4 * BLOCK * 4 + d % 4] = (uint8_t)(codes[i] + KEY_OFFSET);
        }
    }
    value_scales[position] = quantize_row(v, dim, values + position / 2 * 2 * dim + position % 2, 2);
}

void int4q_attend_quantize_query(const uint16_t *q, int64_t heads, int64_t dim, int8_t *codes, float *scales,
                                 int32_t *sums) {
    for (int64_t h = 0; h < heads; h++) {
        scales[h] = quantize_row(q + h * dim, dim, codes + h * dim, 1);
        for (int64_t b = 0; b < dim / KEY_DIMS; b++) {
            int32_t *sum = sums + h * (dim / KEY_DIMS) + b;
            *sum = 0;
            for (int64_t d = b * KEY_DIMS; d < (b + 1) * KEY_DIMS; d++) *sum += codes[h * dim + d];
        }
    }
}

/* Head j's weights w (fp32 [count], in place) times the values' scales, as int16 units of the returned
 * unit into w16 [count rounded up to even] (the pad 0). */
static float weights_int16(float *w, const float *vs, int64_t count, int16_t *w16) {
    float largest = 0;
    for (int64_t l = 0; l < count; l++) largest = larger(largest, w[l] *= vs[l]);
    const float unit = largest / WEIGHT_LIMIT;
    for (int64_t l = 0; l < count; l++) w16[l] = largest > 0 ? (int16_t)rintf(w[l] / unit) : 0;
    if (count % 2) w16[count] = 0;
    return unit;
}

/* A part in plain C; scores scratch fp32 [group][INT4Q_ATTEND_CHUNK], w16 int16 [INT4Q_ATTEND_CHUNK]. */
static void part_portable(const int8_t *q, const float *q_scales, int64_t group, const uint8_t *keys, const float *ks,
                          const int8_t *values, const float *vs, int64_t count, int64_t dim, float scale,
                          float *scores, int16_t *w16, float *part) {
    for (int64_t j = 0; j < group; j++) {
        float *s = scores + j * INT4Q_ATTEND_CHUNK, *out = part + j * (dim + INT4Q_PART_ACC), top = -INFINITY;
        float total = 0;
        for (int64_t l = 0; l < count; l++) {
            const uint8_t *block = keys + l / BLOCK * BLOCK * dim + l % BLOCK * 4;
            float score = 0;
            for (int64_t b = 0; b < dim / KEY_DIMS; b++) {
                int32_t dot = 0;
                for (int64_t d = b * KEY_DIMS; d < (b + 1) * KEY_DIMS; d++)
                    dot += q[j * dim + d] * (block[d / 4 * BLOCK * 4 + d % 4] - KEY_OFFSET);
                score += (float)dot * ks[key_scale_at(l, b, dim)];
            }
            s[l] = score * (scale * q_scales[j]);
            top = larger(top, s[l]);
        }
        for (int64_t l = 0; l < count; l++) total += s[l] = expf(s[l] - top);
        const float unit = weights_int16(s, vs, count, w16);
        for (int64_t d = 0; d < dim; d++) {
            int32_t sum = 0;
            for (int64_t l = 0; l < count; l++) sum += w16[l] * values[l / 2 * 2 * dim + 2 * d + l % 2];
            out[INT4Q_PART_ACC + d] = (float)sum * unit;
        }
        out[INT4Q_PART_TOP] = top;
        out[INT4Q_PART_TOTAL] = total;
    }
}

#if INT4Q_X86
#include <immintrin.h>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* acc + the dot products of a's unsigned and b's signed bytes, four to a lane (vpdpbusd); and of
 * a's and b's int16 pairs (vpdpwssd). In assembly so that the accumulator stays in its register:
 * GCC 12 copies it around each intrinsic's call, which spills a tile's accumulators. */
VNNI static inline __m512i dot_bytes(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

VNNI static inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

#define SCORE_HEADS 8 /* query heads of a score tile at most */
#define VALUE_HEADS 6 /* query heads of a value tile at most: 6 heads x 64 dimensions in 24 accumulators */
#define PREFETCH_BYTES 4096 /* ahead in the keys' and the values' streams */

/* Scores of `heads` query heads (a constant where inlined) against positions [0, count) into s (fp32,
 * INT4Q_ATTEND_CHUNK per head; lanes past count -inf); returns each head's largest in top. */
VNNI static inline __attribute__((always_inline)) void score_tile(int heads, const int8_t *q, const float *q_scales,
                                                                  const int32_t *q_sums, const uint8_t *keys,
                                                                  const float *ks, int64_t count, int64_t dim,
                                                                  float scale, float *s, float *top) {
    __m512 tops[SCORE_HEADS];
    for (int h = 0; h < heads; h++) tops[h] = _mm512_set1_ps(-INFINITY);
    const int64_t blocks = dim / KEY_DIMS;
    for (int64_t l = 0; l < count; l += BLOCK) {
        const uint8_t *block = keys + l * dim;
        __m512 sums[SCORE_HEADS];
        for (int h = 0; h < heads; h++) sums[h] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            __m512i acc[SCORE_HEADS];
            for (int h = 0; h < heads; h++) acc[h] = _mm512_setzero_si512();
            for (int64_t g = b * KEY_DIMS / 4; g < (b + 1) * KEY_DIMS / 4; g++) {
                _mm_prefetch((const char *)(block + g * BLOCK * 4 + PREFETCH_BYTES), _MM_HINT_T0);
                const __m512i k = _mm512_loadu_si512(block + g * BLOCK * 4);
#pragma GCC unroll 8
                for (int h = 0; h < heads; h++) {
                    int32_t four;
                    memcpy(&four, q + h * dim + 4 * g, sizeof four);
                    acc[h] = dot_bytes(acc[h], k, _mm512_set1_epi32(four));
                }
            }
            const __m512 key_scales = _mm512_loadu_ps(ks + (l / BLOCK * blocks + b) * BLOCK);
            for (int h = 0; h < heads; h++) {
                const __m512i dot = _mm512_sub_epi32(acc[h], _mm512_set1_epi32(KEY_OFFSET * q_sums[h * blocks + b]));
                sums[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), key_scales, sums[h]);
            }
        }
        const __mmask16 live = count - l >= BLOCK ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - l)) - 1);
        for (int h = 0; h < heads; h++) {
            __m512 x = _mm512_mul_ps(sums[h], _mm512_set1_ps(scale * q_scales[h]));
            x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, x);
            _mm512_storeu_ps(s + h * INT4Q_ATTEND_CHUNK + l, x);
            tops[h] = _mm512_max_ps(tops[h], x);
        }
    }
    for (int h = 0; h < heads; h++) top[h] = _mm512_reduce_max_ps(tops[h]);
}

VNNI static void score_tiles(int heads, const int8_t *q, const float *q_scales, const int32_t *q_sums,
                             const uint8_t *keys, const float *ks, int64_t count, int64_t dim, float scale, float *s,
                             float *top) {
#define TILE(n) score_tile(n, q, q_scales, q_sums, keys, ks, count, dim, scale, s, top)
    switch (heads) {
    case 1: TILE(1); break;
    case 2: TILE(2); break;
    case 3: TILE(3); break;
    case 4: TILE(4); break;
    case 5: TILE(5); break;
    case 6: TILE(6); break;
    case 7: TILE(7); break;
    default: TILE(SCORE_HEADS); break;
    }
#undef TILE
}

/* Scores [0, count) in place to their weights e^(s - top) (0 past count, up to the block's end); returns
 * their sum. */
VNNI static float weigh(float *s, int64_t count, float top) {
    __m512 sums = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l += BLOCK) {
        const __mmask16 live = count - l >= BLOCK ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - l)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, int4q_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(top))));
        _mm512_storeu_ps(s + l, e);
        sums = _mm512_add_ps(sums, e);
    }
    return _mm512_reduce_add_ps(sums);
}

/* part[h] ACC + [d, d + 16 vectors) = unit[h] * sum_l w16[h][l] v[l][...] for `heads` query heads and
 * `vectors` (constants where inlined); w16 at INT4Q_ATTEND_CHUNK per head. */
VNNI static inline __attribute__((always_inline)) void value_tile(int heads, int vectors, const int16_t *w16,
                                                                  const float *unit, const int8_t *values,
                                                                  int64_t pairs, int64_t dim, int64_t d, float *part,
                                                                  int64_t part_step) {
    __m512i sums[VALUE_HEADS][4];
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < vectors; i++) sums[h][i] = _mm512_setzero_si512();
    for (int64_t m = 0; m < pairs; m++) {
        const int8_t *row = values + m * 2 * dim + 2 * d;
        for (int i = 0; i < vectors; i += 2) _mm_prefetch((const char *)(row + PREFETCH_BYTES + 32 * i), _MM_HINT_T0);
        __m512i x[4];
        for (int i = 0; i < vectors; i++) x[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * i)));
#pragma GCC unroll 6
        for (int h = 0; h < heads; h++) {
            int32_t two;
            memcpy(&two, w16 + h * INT4Q_ATTEND_CHUNK + 2 * m, sizeof two);
            const __m512i w = _mm512_set1_epi32(two);
            for (int i = 0; i < vectors; i++) sums[h][i] = dot_pairs(sums[h][i], x[i], w);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < vectors; i++)
            _mm512_storeu_ps(part + h * part_step + INT4Q_PART_ACC + d + 16 * i,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(sums[h][i]), _mm512_set1_ps(unit[h])));
}

VNNI static void value_tiles(int heads, int vectors, const int16_t *w16, const float *unit, const int8_t *values,
                             int64_t pairs, int64_t dim, int64_t d, float *part, int64_t part_step) {
#define TILE(n, k) value_tile(n, k, w16, unit, values, pairs, dim, d, part, part_step)
#define HEADS(k)                                                                                                   \
    switch (heads) {                                                                                               \
    case 1: TILE(1, k); break;                                                                                     \
    case 2: TILE(2, k); break;                                                                                     \
    case 3: TILE(3, k); break;                                                                                     \
    case 4: TILE(4, k); break;                                                                                     \
    case 5: TILE(5, k); break;                                                                                     \
    default: TILE(VALUE_HEADS, k); break;                                                                          \
    }
    if (vectors == 4) {
        HEADS(4)
    } else {
        HEADS(2)
    }
#undef HEADS
#undef TILE
}

/* weights_int16 sixteen at a time, s zero from count to the block's end (as weigh leaves it). */
VNNI static float weights_int16_vector(float *s, const float *vs, int64_t count, int16_t *w16) {
    __m512 largest = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l += BLOCK) {
        const __mmask16 live = count - l >= BLOCK ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - l)) - 1);
        const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(s + l), _mm512_maskz_loadu_ps(live, vs + l));
        _mm512_storeu_ps(s + l, w);
        largest = _mm512_max_ps(largest, w);
    }
    const float top = _mm512_reduce_max_ps(largest), unit = top / WEIGHT_LIMIT;
    for (int64_t l = 0; l < count; l += BLOCK) {
        const __m512i w = top > 0 ? _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(unit)))
                                  : _mm512_setzero_si512();
        _mm256_storeu_si256((__m256i *)(w16 + l), _mm512_cvtepi32_epi16(w));
    }
    return unit;
}

/* part_portable for dim % 32 == 0; w16 int16 [group][INT4Q_ATTEND_CHUNK]. */
VNNI static void part_vector(const int8_t *q, const float *q_scales, const int32_t *q_sums, int64_t group,
                             const uint8_t *keys, const float *ks, const int8_t *values, const float *vs,
                             int64_t count, int64_t dim, float scale, float *scores, int16_t *w16, float *part) {
    const int64_t part_step = dim + INT4Q_PART_ACC;
    float top[SCORE_HEADS], unit[VALUE_HEADS];
    for (int64_t j = 0; j < group; j += SCORE_HEADS) {
        const int heads = group - j < SCORE_HEADS ? (int)(group - j) : SCORE_HEADS;
        score_tiles(heads, q + j * dim, q_scales + j, q_sums + j * (dim / KEY_DIMS), keys, ks, count, dim, scale,
                    scores + j * INT4Q_ATTEND_CHUNK, top);
        for (int h = 0; h < heads; h++) {
            float *s = scores + (j + h) * INT4Q_ATTEND_CHUNK, *out = part + (j + h) * part_step;
            out[INT4Q_PART_TOP] = top[h];
            out[INT4Q_PART_TOTAL] = weigh(s, count, top[h]);
        }
    }
    for (int64_t j = 0; j < group; j += VALUE_HEADS) {
        const int heads = group - j < VALUE_HEADS ? (int)(group - j) : VALUE_HEADS;
        for (int h = 0; h < heads; h++)
            unit[h] = weights_int16_vector(scores + (j + h) * INT4Q_ATTEND_CHUNK, vs, count,
                                           w16 + (j + h) * INT4Q_ATTEND_CHUNK);
        for (int64_t d = 0; d < dim; d += 64)
            value_tiles(heads, dim - d >= 64 ? 4 : 2, w16 + j * INT4Q_ATTEND_CHUNK, unit, values, (count + 1) / 2,
                        dim, d, part + j * part_step, part_step);
    }
}
#endif

int int4q_attend_int8_vector(int64_t dim) {
#if INT4Q_X86
    return dim % KEY_DIMS == 0 && int4q_max_level() >= INT4Q_AVX512 && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
#else
    (void)dim;
    return 0;
#endif
}

void int4q_attend_part_int8(const int8_t *q, const float *q_scales, const int32_t *q_sums, int64_t group,
                            const uint8_t *keys, const float *ks, const int8_t *values, const float *vs, int64_t begin,
                            int64_t end, int64_t dim, float scale, float *scratch, float *part) {
    keys += begin * dim, values += begin * dim, ks += begin * (dim / KEY_DIMS), vs += begin;
    int16_t *w16 = (int16_t *)(scratch + group * INT4Q_ATTEND_CHUNK);
#if INT4Q_X86
    if (int4q_attend_int8_vector(dim)) {
        part_vector(q, q_scales, q_sums, group, keys, ks, values, vs, end - begin, dim, scale, scratch, w16, part);
        return;
    }
#endif
    (void)q_sums;
    part_portable(q, q_scales, group, keys, ks, values, vs, end - begin, dim, scale, scratch, w16, part);
}
