/* The C interface of int4q's kernels (int4_gemv.c, int4_gemv_rows.c, int4_w4a8.c, int4_w4a8_rows.c,
 * int4_dequant.c, gram_bf16.c, gptq_columns.c, refine_codes.c, grid_scores.c, grid_search.c, grid_fits.c,
 * rtn_minmax.c, decode_attention.c, causal_attention.c, decode_attention_int8.c) to their operators
 * (int4_ops.cpp, gemv_rows_ops.cpp, w4a8_ops.cpp, refine_ops.cpp, grid_ops.cpp, attention_ops.cpp,
 * kv_int8_ops.cpp), and the vector paths they choose between at run time. The sources may be
 * compiled as C or as C++; the interface has C linkage either way. */
#ifndef INT4Q_H
#define INT4Q_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define INT4Q_X86 1
#else
#define INT4Q_X86 0
#endif

#define INT4Q_PORTABLE 0    /* plain C */
#define INT4Q_AVX512 1      /* AVX-512 F, BW, VL and VBMI */
#define INT4Q_AVX512_BF16 2 /* and AVX512_BF16 */

/* The fp32 value of bf16 bits (exact). */
static inline float int4q_bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f rounded to the nearest bf16, ties to even; every NaN becomes 0x7FC0. */
static inline uint16_t int4q_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x for x <= 0 as Cephes' expf computes it (x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6
 * polynomial, times 2^n), for the vector kernels: x is first raised to INT4Q_EXPF_FLOOR, so the
 * smallest result is about 1e-38; ln2 is split in two for an exact n ln2. */
#define INT4Q_EXPF_FLOOR (-87.3f)
#define INT4Q_LOG2E 1.44269504088896341f
#define INT4Q_LN2_HIGH 0.693359375f
#define INT4Q_LN2_LOW (-2.12194440e-4f)
static const float int4q_expf_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if INT4Q_X86
#include <immintrin.h>

/* The sum of a vector's eight floats (for the AVX2 kernels). */
__attribute__((target("avx2,fma"))) static inline float int4q_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x as above for x <= 0, sixteen at a time (for the AVX-512 kernels). */
__attribute__((target("avx512f"))) static inline __m512 int4q_exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(INT4Q_EXPF_FLOOR));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(INT4Q_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(INT4Q_LN2_HIGH), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(INT4Q_LN2_LOW), r);
    __m512 p = _mm512_set1_ps(int4q_expf_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(int4q_expf_poly[i]));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif

#ifdef __cplusplus
extern "C" {
#endif
/* The highest path the kernels may take (INT4Q_AVX512_BF16 unless lowered, to test the others). */
int int4q_max_level(void);

int int4q_gemv_available(void);
void int4q_group_sums(const uint16_t *x, int64_t k, int64_t group_size, float *xsum);
void int4q_gemv_blocks(const uint16_t *x, const float *xsum, const uint8_t *pack, const uint16_t *sz, uint16_t *out,
                       int64_t rows, int64_t n, int64_t k, int64_t group_size, int64_t first, int64_t last);

int int4q_gemv_rows_level(void);
void int4q_split_row(const uint16_t *x, int64_t k, int64_t group_size, float *xe, float *xo, float *xsum);
void int4q_gemv_rows(const float *xe, const float *xo, const float *xsum, const uint8_t *packed,
                     const uint16_t *scale, const uint16_t *zero, uint16_t *out, int64_t k, int64_t group_size,
                     int64_t first, int64_t last);

int int4q_w4a8_available(void);
void int4q_quantize_row(const uint16_t *x, int64_t k, int64_t group_size, int8_t *xq, float *xscale,
                        int32_t *xqsum, float *xsum);
void int4q_w4a8_blocks(const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum, int64_t m,
                       const uint8_t *pack, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k,
                       int64_t group_size, int64_t first, int64_t last);

int int4q_w4a8_rows_available(void);
void int4q_w4a8_split(const int8_t *xq, int64_t k, int8_t *even, int8_t *odd);
void int4q_quantize_row_split(const uint16_t *x, int64_t k, int64_t group_size, int8_t *xq, int8_t *even,
                              int8_t *odd, float *xscale, int32_t *xqsum, float *xsum);
void int4q_w4a8_rows(const int8_t *even, const int8_t *odd, const float *xscale, const int32_t *xqsum,
                     const float *xsum, int64_t m, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero,
                     uint16_t *out, int64_t n, int64_t k, int64_t group_size, int64_t first, int64_t last);

int int4q_attend_vector(int64_t dim);
#define INT4Q_ATTEND_CHUNK 256 /* positions of a part of int4q_attend_part, at most */
/* A part's result for one query head, fp32 [dim + 2]: its largest score, the sum of its weights, then the
 * weighted sum of values. */
#define INT4Q_PART_TOP 0
#define INT4Q_PART_TOTAL 1
#define INT4Q_PART_ACC 2
/* The attention of the group query heads sharing one cached head (q bf16 [group][dim]) over
 * positions [begin, end), end - begin <= INT4Q_ATTEND_CHUNK; k and v bf16 at k_step and v_step
 * elements per position. part fp32 [group][dim + 2]: per head its largest score, the sum of its
 * weights and the weighted sum of values. scratch fp32 [group * (dim + INT4Q_ATTEND_CHUNK) + dim]. */
void int4q_attend_part(const uint16_t *q, int64_t group, const uint16_t *k, const uint16_t *v, int64_t begin,
                       int64_t end, int64_t dim, int64_t k_step, int64_t v_step, float scale, float *scratch,
                       float *part);
/* The int8 KV cache (decode_attention_int8.c's layouts, per cached head: keys uint8 and values int8 of
 * `positions` x dim bytes, positions a multiple of 16 and dim of INT4Q_KV_KEY_DIMS; fp32 key scales
 * [positions][dim / INT4Q_KV_KEY_DIMS] and value scales [positions]). Stores one position's key and value
 * rows (bf16 [dim]) at `position`. */
#define INT4Q_KV_KEY_DIMS 32 /* dimensions of a key block with a scale of its own */
void int4q_kv_int8_store(const uint16_t *k, const uint16_t *v, int64_t dim, int64_t position, uint8_t *keys,
                         float *key_scales, int8_t *values, float *value_scales);
/* Query heads q bf16 [heads][dim] as int8 codes [heads][dim], their scales [heads] and their codes' sums
 * per key block [heads][dim / INT4Q_KV_KEY_DIMS]. */
void int4q_attend_quantize_query(const uint16_t *q, int64_t heads, int64_t dim, int8_t *codes, float *scales,
                                 int32_t *sums);
/* 1 when int4q_attend_part_int8 takes its vector path for this head dimension. */
int int4q_attend_int8_vector(int64_t dim);
/* int4q_attend_part over one cached head of the int8 cache (keys, values and their scales at the head's
 * start), the group's query heads as int4q_attend_quantize_query gives them; begin a multiple of
 * INT4Q_ATTEND_CHUNK. scratch fp32 [2 * group * INT4Q_ATTEND_CHUNK]. */
void int4q_attend_part_int8(const int8_t *q, const float *q_scales, const int32_t *q_sums, int64_t group,
                            const uint8_t *keys, const float *ks, const int8_t *values, const float *vs, int64_t begin,
                            int64_t end, int64_t dim, float scale, float *scratch, float *part);
/* One query head's count parts (part_step floats apart) merged and rounded to out bf16 [dim];
 * acc: scratch fp32 [dim]. */
void int4q_attend_merge(const float *parts, int64_t count, int64_t part_step, int64_t dim, float *acc,
                        uint16_t *out);

#define INT4Q_CAUSAL_ROWS 24 /* queries per task of int4q_causal_block */
#define INT4Q_CAUSAL_KEYS 48 /* positions of the packed keys' stride come in multiples of this */
#define INT4Q_CAUSAL_DIMS 32 /* dimensions of the packed values' stride come in multiples of this */
int int4q_causal_available(void);
void int4q_causal_block(const uint16_t *q, int64_t q_step, int64_t first, int64_t rows, int64_t dim,
                        const uint32_t *keys, int64_t key_stride, const uint32_t *values, int64_t value_stride,
                        float scale, float *scores, uint16_t *weights, float *totals, uint16_t *out,
                        int64_t out_step);
void int4q_causal_pack_keys(const uint16_t *k, int64_t k_step, int64_t positions, int64_t dim, int64_t key_stride,
                            uint32_t *keys);
void int4q_causal_pack_values(const uint16_t *v, int64_t v_step, int64_t positions, int64_t dim, int64_t value_stride,
                              uint32_t *values);
#define INT4Q_GRAM_PANEL 48  /* columns of C per panel of int4q_gram_block */
#define INT4Q_GRAM_PAIRS 512 /* row pairs per chunk */
#define INT4Q_GRAM_ROWS 192  /* rows of C per block */
int int4q_gram_available(void);
void int4q_gram_block(const uint32_t *pairs, int64_t p0, int64_t p1, int64_t panel_words, float *c, int64_t k,
                      float alpha, float beta, int64_t i_begin, int64_t i_end, int64_t panel);

void int4q_gptq_columns(float *w, const float *u, int64_t b, const float *scale, const float *zero, const float *safe,
                        const uint8_t *flat, float *codes, float *err, int64_t n, int64_t first, int64_t last,
                        int64_t r0, int64_t r1, int64_t qmax);

void int4q_refine_codes(int16_t *codes, const float *step, float *pull, const float *blocks, const float *rise,
                        const float *fall, int64_t groups, int64_t b, int64_t qmax, int64_t sweeps, int64_t r0,
                        int64_t r1);

void int4q_grid_scores(const float *x, const float *w, const float *scale, const float *zero, float *out,
                       int64_t groups, int64_t group, int64_t first, int64_t last, int64_t top);
void int4q_shrink_search(const float *x, const float *w, const float *lo, const float *hi, const float *sw,
                         const float *swx, const float *shrinks, int64_t count, int64_t groups, int64_t size,
                         int64_t first, int64_t last, int64_t top, int symmetric, float *scale_out, float *zero_out);
void int4q_stretch_search(const float *x, const float *w, const float *low, const float *span, const float *sum_w,
                          const float *sum_x, const float *sum_x2, const float *steps, int64_t count, int64_t size,
                          int64_t first, int64_t last, int64_t top, float *step_out, float *zero_out);
void int4q_signed_search(const float *x, const float *w, const float *top, const float *steps, int64_t count,
                         int64_t size, int64_t first, int64_t last, int64_t qtop, float *scale_out);
void int4q_grid_errors(const float *x, const float *w, const float *scales, const float *zeros, int64_t count,
                       int64_t m, int64_t groups, int64_t size, int64_t first, int64_t last, int64_t top, float *out);
void int4q_first_fit(const float *x, const double *steps, const double *lows, int64_t count, int64_t m_groups,
                     int64_t size, int64_t first, int64_t last, int64_t top, int symmetric, double slack,
                     int64_t *out);
void int4q_rtn_minmax(const uint16_t *w, uint8_t *codes, uint16_t *scale, uint16_t *zero, double *stats, int64_t k,
                      int64_t group, int64_t first, int64_t last, int symmetric);

int int4q_dequant_level(void);
void int4q_dequant_int4pack(const uint8_t *pack, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k,
                            int64_t group_size, int64_t first, int64_t last, int level);
#ifdef __cplusplus
}
#endif

#endif
