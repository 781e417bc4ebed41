/* The prefill dequantization: tinygemm's CPU int4 layout -> a bf16 weight [N][K].
 *
 * Input, as quantizer/packing.py describes it (AVX-512 layout, N a multiple of 64):
 *   pack [N/64][K][32] bytes, byte d of a run = channel d (low nibble) | channel d + 32 (high);
 *   sz   [K/group][N][2] bf16, (scale, zero) per group and channel.
 * Output: out[n][k] = bf16((float)(q - 8) * scale + zero), the product exact in fp32, one
 * round-to-nearest-even to bf16: bit for bit what packing.dequantize_int4pack computes (a NaN
 * comes out as the quiet NaN 0x7FC0).
 *
 * A (channel, group) has only 16 possible outputs, so each one is computed once into a table and
 * the codes index it. The vector paths are compiled for their instruction sets alone and chosen
 * at run time (int4q_dequant_level), so one build serves every x86-64 CPU. Registered as
 * torch.ops.int4q_native.dequant_int4pack by int4_ops.cpp.
 */
#include <string.h>

#include "int4q.h"

#define BLOCK 64  /* output channels per block of the layout */
#define RUN 32    /* bytes per (block, k) run */

static void fill_tables(uint16_t tables[BLOCK][16], const uint16_t *sz, int64_t n, int64_t b, int64_t g) {
    for (int ch = 0; ch < BLOCK; ch++) {
        const uint16_t *p = sz + (g * n + b * BLOCK + ch) * 2;
        float scale = int4q_bf16_to_float(p[0]), zero = int4q_bf16_to_float(p[1]);
        for (int q = 0; q < 16; q++) tables[ch][q] = int4q_float_to_bf16((float)(q - 8) * scale + zero);
    }
}

static void block_group_portable(const uint8_t *src, const uint16_t *sz, uint16_t *dst,
                                 int64_t n, int64_t k, int64_t group_size, int64_t b, int64_t g) {
    uint16_t tables[BLOCK][16];
    fill_tables(tables, sz, n, b, g);
    for (int64_t kk = 0; kk < group_size; kk++) {
        const uint8_t *run = src + kk * RUN;
        for (int d = 0; d < RUN; d++) {
            dst[d * k + kk] = tables[d][run[d] & 15];
            dst[(d + RUN) * k + kk] = tables[d + RUN][run[d] >> 4];
        }
    }
}

#if INT4Q_X86
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")))

/* The 16 outputs of each of a block's 64 channels in group g, one vector computation each:
 * fill_tables' arithmetic and rounding, 16 lanes at a time. */
AVX512 static void fill_tables_simd(__m256i tables[BLOCK], const uint16_t *sz, int64_t n, int64_t b, int64_t g) {
    const __m512 steps = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
    const uint16_t *p = sz + (g * n + b * BLOCK) * 2;
    for (int ch = 0; ch < BLOCK; ch++) {
        const __m512 v = _mm512_fmadd_ps(steps, _mm512_set1_ps(int4q_bf16_to_float(p[2 * ch])),
                                         _mm512_set1_ps(int4q_bf16_to_float(p[2 * ch + 1])));
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, half)), 16);
        rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
        tables[ch] = _mm512_cvtepi32_epi16(rounded);
    }
}

/* Whether block b's scales and zeros in group g hold an inf, a NaN, or a nonzero magnitude below
 * 2^-119. Without those, every table entry is a sum of two multiples of 2^-126: zero or normal,
 * where vcvtne2ps2bf16 rounds exactly like float_to_bf16 (it differs on NaN payloads and flushes
 * denormals). */
AVX512 static int needs_exact_tables(const uint16_t *sz, int64_t n, int64_t b, int64_t g) {
    const uint16_t *p = sz + (g * n + b * BLOCK) * 2;
    const __m512i exponent = _mm512_set1_epi16(0x7F80), magnitude = _mm512_set1_epi16(0x7FFF);
    const __m512i tiny = _mm512_set1_epi16(8 << 7);
    __mmask32 special = 0;
    for (int i = 0; i < 4; i++) {
        const __m512i w = _mm512_loadu_si512(p + 32 * i);
        const __m512i e = _mm512_and_si512(w, exponent);
        special |= _mm512_cmpeq_epi16_mask(e, exponent);
        special |= _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(w, magnitude), e, tiny);
    }
    return special != 0;
}

/* The pair tables of fill_pair_tables, rounded by vcvtne2ps2bf16 (see needs_exact_tables). */
AVX512_BF16 static void fill_pair_tables_bf16(__m512i tables[BLOCK / 2], const uint16_t *sz, int64_t n, int64_t b,
                                              int64_t g) {
    const __m512 steps = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    float params[BLOCK * 2]; /* (scale, zero) per channel, as fp32 */
    const uint16_t *p = sz + (g * n + b * BLOCK) * 2;
    for (int i = 0; i < BLOCK * 2 / 16; i++) {
        const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16 * i)));
        _mm512_storeu_si512(params + 16 * i, _mm512_slli_epi32(words, 16));
    }
    for (int j = 0; j < BLOCK / 2; j++) {
        const float *c = params + 4 * j;
        const __m512 first = _mm512_fmadd_ps(steps, _mm512_set1_ps(c[0]), _mm512_set1_ps(c[1]));
        const __m512 second = _mm512_fmadd_ps(steps, _mm512_set1_ps(c[2]), _mm512_set1_ps(c[3]));
        tables[j] = (__m512i)_mm512_cvtne2ps_pbh(second, first);
    }
}

/* tables[j]: the outputs of channel pair j of the block in group g, channel 2j in words 0-15 and
 * channel 2j + 1 in words 16-31 (one vpermw table). ``level`` as int4q_dequant_level. */
AVX512 static void fill_pair_tables(__m512i tables[BLOCK / 2], const uint16_t *sz, int64_t n, int64_t b, int64_t g,
                                    int level) {
    if (level >= INT4Q_AVX512_BF16 && !needs_exact_tables(sz, n, b, g)) {
        fill_pair_tables_bf16(tables, sz, n, b, g);
        return;
    }
    __m256i narrow[BLOCK];
    fill_tables_simd(narrow, sz, n, b, g);
    for (int j = 0; j < BLOCK / 2; j++)
        tables[j] = _mm512_inserti64x4(_mm512_castsi256_si512(narrow[2 * j]), narrow[2 * j + 1], 1);
}

/* Per 32 k-rows and 4 byte columns (channels d..d+3 and d+32..d+35): two gathers read the 4 bytes
 * of each row and two byte permutes regroup them into two column pairs. Byte p of a pair holds
 * column 2 * pair + (p % 16) / 8 of row 8 * (p / 16) + p % 8, so unpacklo_epi8 widens the first
 * column's 32 codes in row order and unpackhi_epi8 the second's; each then indexes its pair table
 * with one vpermw (the second column's codes offset by 16) and one 64-byte store. */
AVX512 static void block_group_simd(const uint8_t *src, const uint16_t *sz, uint16_t *dst, int64_t n, int64_t k,
                                    int64_t group_size, int64_t b, int64_t g, int level) {
    __m512i tables[BLOCK / 2];
    fill_pair_tables(tables, sz, n, b, g, level);
    uint8_t order[2][64], second_column[64];
    for (int p = 0; p < 64; p++) {
        const int row = 8 * (p / 16) + p % 8, column = (p % 16) / 8;
        for (int pair = 0; pair < 2; pair++)
            order[pair][p] = (uint8_t)((row < 16 ? 0 : 64) + 4 * (row % 16) + 2 * pair + column);
        second_column[p] = (uint8_t)(16 * column);
    }
    const __m512i first_pair = _mm512_loadu_si512(order[0]), second_pair = _mm512_loadu_si512(order[1]);
    const __m512i offset = _mm512_loadu_si512(second_column), zero = _mm512_setzero_si512();
    const __m512i row_offsets = _mm512_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352,
                                                  384, 416, 448, 480);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#define LOOKUP(codes, table, ch)                                                                       \
    do {                                                                                               \
        const __m512i index = _mm512_ternarylogic_epi32(codes, nibble, offset, 0xEA); /* c & 15 | o */ \
        _mm512_storeu_si512(dst + (ch) * k + kq,                                                       \
                            _mm512_permutexvar_epi16(_mm512_unpacklo_epi8(index, zero), table));       \
        _mm512_storeu_si512(dst + ((ch) + 1) * k + kq,                                                 \
                            _mm512_permutexvar_epi16(_mm512_unpackhi_epi8(index, zero), table));       \
    } while (0)
    for (int64_t kq = 0; kq < group_size; kq += 32) {
        for (int d = 0; d < RUN; d += 4) {
            const uint8_t *at = src + kq * RUN + d;
            const __m512i rows_low = _mm512_i32gather_epi32(row_offsets, (const void *)at, 1);
            const __m512i rows_high = _mm512_i32gather_epi32(row_offsets, (const void *)(at + 16 * RUN), 1);
            const __m512i pair0 = _mm512_permutex2var_epi8(rows_low, first_pair, rows_high);
            const __m512i pair1 = _mm512_permutex2var_epi8(rows_low, second_pair, rows_high);
            LOOKUP(pair0, tables[d / 2], d);
            LOOKUP(pair1, tables[d / 2 + 1], d + 2);
            LOOKUP(_mm512_srli_epi16(pair0, 4), tables[(d + RUN) / 2], d + RUN);
            LOOKUP(_mm512_srli_epi16(pair1, 4), tables[(d + RUN) / 2 + 1], d + RUN + 2);
        }
    }
#undef LOOKUP
}
#endif

/* The vector path this CPU runs, at most int4q_max_level(): INT4Q_PORTABLE, INT4Q_AVX512, or
 * INT4Q_AVX512_BF16 (bf16 conversions for the tables). The GEMV and W4A8 kernels check it too. */
int int4q_dequant_level(void) {
    int level = INT4Q_PORTABLE;
#if INT4Q_X86
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi"))
        level = __builtin_cpu_supports("avx512bf16") ? INT4Q_AVX512_BF16 : INT4Q_AVX512;
#endif
    return level < int4q_max_level() ? level : int4q_max_level();
}

/* pack, sz and out as above; n % 64 == 0, k % group_size == 0. Does tasks [first, last) of the
 * n / 64 * k / group_size (block, group) tasks, on the path ``level``. */
void int4q_dequant_int4pack(const uint8_t *pack, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k,
                            int64_t group_size, int64_t first, int64_t last, int level) {
    const int64_t groups = k / group_size;
    const int simd = level >= INT4Q_AVX512 && group_size % 32 == 0;
    for (int64_t task = first; task < last; task++) {
        const int64_t b = task / groups, g = task % groups;
        const uint8_t *src = pack + (b * k + g * group_size) * RUN;
        uint16_t *dst = out + b * BLOCK * k + g * group_size;
#if INT4Q_X86
        if (simd) {
            block_group_simd(src, sz, dst, n, k, group_size, b, g, level);
            continue;
        }
#endif
        (void)simd;
        block_group_portable(src, sz, dst, n, k, group_size, b, g);
    }
}
