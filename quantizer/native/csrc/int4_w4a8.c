/* The int8-activation matmul (W4A8): out[m][c] = bf16(sum_k x[m][k] * ((q - 8) * scale + zero)) with
 * each row's activations rounded to int8 per weight group, read straight from tinygemm's CPU int4
 * layout (see int4_dequant.c), for any number of rows.
 *
 * Per row and group g, x is taken as xscale * xq with xq = rint(x * 127 / max|x|) in [-127, 127].
 * Then sum_k x w = xscale * scale * (sum xq q - 8 sum xq) + zero * sum x: the first sum is exact in
 * int32 (vpdpbusd: unsigned codes times signed activations), the zero term uses the exact fp32 sum
 * of x, so the only approximation is the activations' rounding to int8.
 *
 * Four consecutive k-rows of a block are 128 contiguous bytes (byte d of a row: channel d low
 * nibble, channel d + 32 high). One two-source byte permute gathers, for 16 byte columns, the four
 * rows of each column into one dword; its low nibbles are then the four codes of channels d..d+15
 * (one vpdpbusd lane each) and its high nibbles, masked in place, 16 times those of d+32..d+47.
 *
 * Needs AVX-512 F, BW, VBMI and VNNI, checked at run time; elsewhere int4q_w4a8_available() is 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "int4q.h"

#define BLOCK 64 /* output channels per block of the layout */
#define RUN 32   /* bytes per (block, k) run */
#define MAX_ROWS 6 /* rows per register tile: 12 int32 and 12 fp32 accumulators */
#define PREFETCH_BYTES 2048 /* ahead in a block's stream, for the rows of a multi-row pass */
#define PREFETCH_ROW_BYTES 4096 /* ahead in a block's stream, for a one-pass tile (decode) */
#define PREFETCH_GROUPS 2 /* a block's scales and zeros this many groups ahead, for a one-pass tile */
#define ONE_PASS_ROWS 4 /* the most rows that go through a block in one pass (16 int32 accumulators) */
#define ONE_PASS_LIMIT 16 /* up to this many rows (decode, batched decode) take one-pass tiles; more, the two-pass
                           * ones (no faster or slower at 32 and 128 rows) */

/* The scalar quantization of one group (any group size). */
static void quantize_group(const uint16_t *x, int64_t group_size, int8_t *xq, float *xscale, int32_t *xqsum,
                           float *xsum) {
    float amax = 0, sum = 0;
    for (int64_t i = 0; i < group_size; i++) {
        const float v = int4q_bf16_to_float(x[i]);
        sum += v;
        amax = fabsf(v) > amax ? fabsf(v) : amax; /* as fmaxf, without its call */
    }
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t qsum = 0;
    for (int64_t i = 0; i < group_size; i++) {
        const int32_t q = (int32_t)rintf(int4q_bf16_to_float(x[i]) * inv);
        xq[i] = (int8_t)q;
        qsum += q;
    }
    *xscale = amax / 127.0f;
    *xqsum = qsum;
    *xsum = sum;
}

#if INT4Q_X86
#include <immintrin.h>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni")))

/* bf16 bits of 16 floats, rounded to nearest even (NaN -> 0x7FC0), in a 256-bit vector. */
VNNI static inline __m256i to_bf16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* acc += the dword dot products of w (unsigned bytes) and x (signed bytes). As inline assembly
 * because GCC copies each accumulator of the intrinsic to another register and back every step. */
VNNI static inline __m512i dot_accumulate(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* quantize_group for group_size % 16 == 0, 16 lanes at a time (the sum of x in another order). */
VNNI static void quantize_group_simd(const uint16_t *x, int64_t group_size, int8_t *xq, float *xscale,
                                     int32_t *xqsum, float *xsum) {
    __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < group_size; i += 16) {
        const __m512 v = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16));
        sum = _mm512_add_ps(sum, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(top > 0 ? 127.0f / top : 0.0f);
    __m512i qsum = _mm512_setzero_si512();
    for (int64_t i = 0; i < group_size; i += 16) {
        const __m512 v = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16));
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv)); /* nearest even, as rintf */
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtepi32_epi8(q));
        qsum = _mm512_add_epi32(qsum, q);
    }
    *xscale = top / 127.0f;
    *xqsum = _mm512_reduce_add_epi32(qsum);
    *xsum = _mm512_reduce_add_ps(sum);
}

/* Rows [0, R) of 32 of block b's outputs: channels 16 half + (0..15) from the low nibbles (acc[r][0])
 * and 32 + 16 half + (0..15) from the high ones, masked in place (acc[r][1], 16 times the sum). */
VNNI static inline __attribute__((always_inline)) void rows_half(
    const int R, const int half, const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum,
    const uint8_t *src, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k, int64_t group_size, int64_t b) {
    uint8_t order[64];
    for (int p = 0; p < 64; p++) { /* byte p = row p % 4 of byte column 16 half + p / 4 */
        const int column = 16 * half + p / 4, row = p % 4;
        order[p] = (uint8_t)(64 * (row / 2) + 32 * (row % 2) + column);
    }
    const __m512i gather = _mm512_loadu_si512(order);
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    const __m512i zero_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t groups = k / group_size;
    __m512 y[MAX_ROWS][2];
    for (int r = 0; r < R; r++) y[r][0] = y[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[MAX_ROWS][2]; /* from -8 (-128 high) times the group's sum of xq: sum xq (q - 8) */
        for (int r = 0; r < R; r++) {
            const int32_t qsum = xqsum[r * groups + g];
            acc[r][0] = _mm512_set1_epi32(-8 * qsum), acc[r][1] = _mm512_set1_epi32(-128 * qsum);
        }
        const uint8_t *rows = src + g * group_size * RUN;
        const int8_t *xg = xq + g * group_size;
        for (int64_t kk = 0; kk < group_size; kk += 4) {
            if (half == 0) { /* the first pass brings the block's weights in; the second finds them cached */
                _mm_prefetch((const char *)(rows + kk * RUN + PREFETCH_BYTES), _MM_HINT_T0);
                _mm_prefetch((const char *)(rows + kk * RUN + PREFETCH_BYTES + 64), _MM_HINT_T0);
            }
            const __m512i a = _mm512_loadu_si512(rows + kk * RUN), c = _mm512_loadu_si512(rows + kk * RUN + 64);
            const __m512i p = _mm512_permutex2var_epi8(a, gather, c);
            const __m512i w0 = _mm512_and_si512(p, low), w1 = _mm512_and_si512(p, high);
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xg + r * k + kk, sizeof four);
                const __m512i xs = _mm512_set1_epi32(four);
                acc[r][0] = dot_accumulate(acc[r][0], w0, xs);
                acc[r][1] = dot_accumulate(acc[r][1], w1, xs);
            }
        }
        const uint16_t *params = sz + (g * n + b * BLOCK) * 2; /* (scale, zero) per channel */
        for (int j = 0; j < 2; j++) {
            const __m512i pairs = _mm512_loadu_si512(params + 2 * (32 * j + 16 * half));
            const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, zero_mask));
            for (int r = 0; r < R; r++) {
                const int64_t at = r * groups + g;
                const __m512 dot = _mm512_cvtepi32_ps(acc[r][j]);
                const __m512 unit = _mm512_set1_ps(j ? xscale[at] * (1.0f / 16) : xscale[at]);
                y[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(scale, unit), dot,
                                          _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[at]), y[r][j]));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        uint16_t *dst = out + r * n + b * BLOCK + 16 * half;
        _mm256_storeu_si256((__m256i *)dst, to_bf16(y[r][0]));
        _mm256_storeu_si256((__m256i *)(dst + 32), to_bf16(y[r][1]));
    }
}

/* Rows [0, R) of block b's 64 outputs, in two halves over the same (cached) weights. */
VNNI static inline __attribute__((always_inline)) void rows_block(
    const int R, const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum, const uint8_t *src,
    const uint16_t *sz, uint16_t *out, int64_t n, int64_t k, int64_t group_size, int64_t b) {
    rows_half(R, 0, xq, xscale, xqsum, xsum, src, sz, out, n, k, group_size, b);
    rows_half(R, 1, xq, xscale, xqsum, xsum, src, sz, out, n, k, group_size, b);
}

/* Rows [0, R) (R <= ONE_PASS_ROWS) of block b's 64 outputs in one pass over its weights: both halves'
 * permutes of each 128-byte run and four independent accumulators a row, so the weights are read once, as one
 * stream (up to ONE_PASS_LIMIT rows take several such tiles, the later ones finding the block cached). Software prefetches run PREFETCH_ROW_BYTES ahead in it and
 * PREFETCH_GROUPS ahead in the scales and zeros (four lines a group, n * 4 bytes apart): a model larger than
 * the caches decodes 10-15 % faster with them (docs/benchmarks/vs-llamacpp.md). Each row's sums are
 * rows_half's: exact int32 dot products, then the same fp32 steps. */
VNNI static inline __attribute__((always_inline)) void rows_one_pass(
    const int R, const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum, const uint8_t *src,
    const uint16_t *sz, uint16_t *out, int64_t n, int64_t k, int64_t group_size, int64_t b) {
    uint8_t order[2][64];
    for (int half = 0; half < 2; half++)
        for (int p = 0; p < 64; p++) {
            const int column = 16 * half + p / 4, row = p % 4;
            order[half][p] = (uint8_t)(64 * (row / 2) + 32 * (row % 2) + column);
        }
    const __m512i gather0 = _mm512_loadu_si512(order[0]), gather1 = _mm512_loadu_si512(order[1]);
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    const __m512i zero_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    const int64_t groups = k / group_size;
    __m512 y[ONE_PASS_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++) y[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[ONE_PASS_ROWS][4]; /* i = 2 half + j, from -8 (-128 high) times the group's sum of xq */
        for (int r = 0; r < R; r++) {
            const int32_t qsum = xqsum[r * groups + g];
            acc[r][0] = acc[r][2] = _mm512_set1_epi32(-8 * qsum);
            acc[r][1] = acc[r][3] = _mm512_set1_epi32(-128 * qsum);
        }
        const uint8_t *rows = src + g * group_size * RUN;
        if (g + PREFETCH_GROUPS < groups) {
            const char *later = (const char *)(sz + ((g + PREFETCH_GROUPS) * n + b * BLOCK) * 2);
            for (int line = 0; line < 4; line++) _mm_prefetch(later + 64 * line, _MM_HINT_T0);
        }
        for (int64_t kk = 0; kk < group_size; kk += 4) {
            _mm_prefetch((const char *)(rows + kk * RUN + PREFETCH_ROW_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(rows + kk * RUN + PREFETCH_ROW_BYTES + 64), _MM_HINT_T0);
            const __m512i a = _mm512_loadu_si512(rows + kk * RUN), c = _mm512_loadu_si512(rows + kk * RUN + 64);
            const __m512i p0 = _mm512_permutex2var_epi8(a, gather0, c), p1 = _mm512_permutex2var_epi8(a, gather1, c);
            const __m512i w[4] = {_mm512_and_si512(p0, low), _mm512_and_si512(p0, high), _mm512_and_si512(p1, low),
                                  _mm512_and_si512(p1, high)};
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * k + g * group_size + kk, sizeof four);
                const __m512i xs = _mm512_set1_epi32(four);
                for (int i = 0; i < 4; i++) acc[r][i] = dot_accumulate(acc[r][i], w[i], xs);
            }
        }
        const uint16_t *params = sz + (g * n + b * BLOCK) * 2;
        for (int i = 0; i < 4; i++) { /* i = 2 half + j: channels 32 j + 16 half */
            const int half = i / 2, j = i % 2;
            const __m512i pairs = _mm512_loadu_si512(params + 2 * (32 * j + 16 * half));
            const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, zero_mask));
            for (int r = 0; r < R; r++) {
                const int64_t at = r * groups + g;
                const __m512 unit = _mm512_set1_ps(j ? xscale[at] * (1.0f / 16) : xscale[at]);
                y[r][i] = _mm512_fmadd_ps(_mm512_mul_ps(scale, unit), _mm512_cvtepi32_ps(acc[r][i]),
                                          _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[at]), y[r][i]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(out + r * n + b * BLOCK + 32 * (i % 2) + 16 * (i / 2)), to_bf16(y[r][i]));
}

/* rows_one_pass with the row count a constant, so that its loops unroll. */
#define ONE_PASS_OF(R)                                                                                             \
    VNNI static void one_pass_##R(const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum,  \
                                  const uint8_t *src, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k,     \
                                  int64_t group_size, int64_t b) {                                                \
        rows_one_pass(R, xq, xscale, xqsum, xsum, src, sz, out, n, k, group_size, b);                              \
    }
ONE_PASS_OF(1)
ONE_PASS_OF(2)
ONE_PASS_OF(3)
ONE_PASS_OF(4)

VNNI static void block_w4a8(const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum, int64_t m,
                            const uint8_t *src, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k,
                            int64_t group_size, int64_t b) {
    const int64_t groups = k / group_size;
#define ROWS(R) rows_block(R, xq + r * k, xscale + r * groups, xqsum + r * groups, xsum + r * groups, src, sz, \
                           out + r * n, n, k, group_size, b)
    if (m <= ONE_PASS_LIMIT) {
#define ONE(R) one_pass_##R(xq + r * k, xscale + r * groups, xqsum + r * groups, xsum + r * groups, src, sz, \
                            out + r * n, n, k, group_size, b)
        for (int64_t r = 0; r < m; r += ONE_PASS_ROWS) {
            switch (m - r < ONE_PASS_ROWS ? m - r : ONE_PASS_ROWS) {
            case 1: ONE(1); break;
            case 2: ONE(2); break;
            case 3: ONE(3); break;
            default: ONE(4); break;
            }
        }
#undef ONE
        return;
    }
    int64_t r = 0;
    for (; r + MAX_ROWS <= m; r += MAX_ROWS) ROWS(MAX_ROWS);
    switch (m - r) {
    case 5: ROWS(5); break;
    case 4: ROWS(4); break;
    case 3: ROWS(3); break;
    case 2: ROWS(2); break;
    case 1: ROWS(1); break;
    default: break;
    }
#undef ROWS
}
#endif

/* Row x bf16 [k] -> xq int8 [k] and, per group, xscale, xqsum (sum of xq) and xsum (sum of x, fp32). */
void int4q_quantize_row(const uint16_t *x, int64_t k, int64_t group_size, int8_t *xq, float *xscale,
                        int32_t *xqsum, float *xsum) {
    const int simd = group_size % 16 == 0 && int4q_w4a8_available();
    for (int64_t g = 0; g < k / group_size; g++) {
        const int64_t at = g * group_size;
#if INT4Q_X86
        if (simd) {
            quantize_group_simd(x + at, group_size, xq + at, xscale + g, xqsum + g, xsum + g);
            continue;
        }
#endif
        quantize_group(x + at, group_size, xq + at, xscale + g, xqsum + g, xsum + g);
    }
}

/* 1 when this CPU runs the W4A8 kernel (AVX-512 F, BW, VL, VBMI and VNNI) and int4q_max_level() allows it. */
int int4q_w4a8_available(void) {
#if INT4Q_X86
    return int4q_dequant_level() >= INT4Q_AVX512 && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

/* Output blocks [first, last) of m rows: xq int8 [m][k], xscale/xqsum/xsum [m][k / group_size] from
 * int4q_quantize_row, pack and sz as in int4_dequant.c, out bf16 [m][n]; n % 64 == 0,
 * group_size % 4 == 0, k % group_size == 0. Only where int4q_w4a8_available(). */
void int4q_w4a8_blocks(const int8_t *xq, const float *xscale, const int32_t *xqsum, const float *xsum, int64_t m,
                       const uint8_t *pack, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k,
                       int64_t group_size, int64_t first, int64_t last) {
#if INT4Q_X86
    for (int64_t b = first; b < last; b++)
        block_w4a8(xq, xscale, xqsum, xsum, m, pack + b * k * RUN, sz, out, n, k, group_size, b);
#else
    (void)xq, (void)xscale, (void)xqsum, (void)xsum, (void)m, (void)pack, (void)sz, (void)out, (void)n, (void)k,
        (void)group_size, (void)first, (void)last;
#endif
}
