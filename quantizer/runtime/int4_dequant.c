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
 * the codes index it. Built by quantizer/runtime/native.py with the machine's C compiler.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 64  /* output channels per block of the layout */
#define RUN 32    /* bytes per (block, k) run */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void fill_tables(uint16_t tables[BLOCK][16], const uint16_t *sz, int64_t n, int64_t b, int64_t g) {
    for (int ch = 0; ch < BLOCK; ch++) {
        const uint16_t *p = sz + (g * n + b * BLOCK + ch) * 2;
        float scale = bf16_to_float(p[0]), zero = bf16_to_float(p[1]);
        for (int q = 0; q < 16; q++) tables[ch][q] = float_to_bf16((float)(q - 8) * scale + zero);
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) \
    && !defined(INT4Q_PORTABLE)
#include <immintrin.h>
#define INT4Q_SIMD 1

/* Per 32 k-rows and 4 channels d: two gathers read the 4 bytes of each row, two byte permutes
 * make them channel-major (32 rows of 2 channels each), and each channel's 32 codes index its
 * table with one vpermw and one 64-byte store. */
#define EMIT(channels, c, first)                                                                  \
    do {                                                                                          \
        const int ch = d4 * 4 + (first) + (c);                                                    \
        const __m512i low = _mm512_and_si512(channels, nibble);                                   \
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(channels, 4), nibble);            \
        _mm512_storeu_si512(dst + ch * k + kq, _mm512_permutexvar_epi16(                          \
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(low, c)), tables[ch]));                \
        _mm512_storeu_si512(dst + (ch + RUN) * k + kq, _mm512_permutexvar_epi16(                  \
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(high, c)), tables[ch + RUN]));         \
    } while (0)

/* The 16 outputs of each of a block's 64 channels in group g, one vector computation each:
 * fill_tables' arithmetic and rounding, 16 lanes at a time. */
static void fill_tables_simd(__m256i tables[BLOCK], const uint16_t *sz, int64_t n, int64_t b, int64_t g) {
    const __m512 steps = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
    const uint16_t *p = sz + (g * n + b * BLOCK) * 2;
    for (int ch = 0; ch < BLOCK; ch++) {
        const __m512 v = _mm512_fmadd_ps(steps, _mm512_set1_ps(bf16_to_float(p[2 * ch])),
                                         _mm512_set1_ps(bf16_to_float(p[2 * ch + 1])));
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, half)), 16);
        rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
        tables[ch] = _mm512_cvtepi32_epi16(rounded);
    }
}

static void block_group_simd(const uint8_t *src, const uint16_t *sz, uint16_t *dst,
                             int64_t n, int64_t k, int64_t group_size, int64_t b, int64_t g) {
    __m256i narrow[BLOCK];
    __m512i tables[BLOCK]; /* vpermw reads 32 lanes; codes only ever index the first 16 */
    fill_tables_simd(narrow, sz, n, b, g);
    for (int ch = 0; ch < BLOCK; ch++) tables[ch] = _mm512_castsi256_si512(narrow[ch]);
    /* Byte 4j + e of a gather is (row j, channel e); gathers a and b hold rows 0-15 and 16-31.
     * Channel pair p of a permute: byte 32c + r = channel 2p + c of row r. */
    uint8_t order[2][64];
    for (int pair = 0; pair < 2; pair++)
        for (int c = 0; c < 2; c++)
            for (int r = 0; r < 32; r++)
                order[pair][32 * c + r] = (uint8_t)((r < 16 ? 0 : 64) + 4 * (r % 16) + 2 * pair + c);
    const __m512i first_pair = _mm512_loadu_si512(order[0]), second_pair = _mm512_loadu_si512(order[1]);
    const __m512i row_offsets = _mm512_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352,
                                                  384, 416, 448, 480);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t kq = 0; kq < group_size; kq += 32) {
        for (int d4 = 0; d4 < RUN / 4; d4++) {
            const uint8_t *at = src + kq * RUN + d4 * 4;
            const __m512i a = _mm512_i32gather_epi32(row_offsets, (const void *)at, 1);
            const __m512i b16 = _mm512_i32gather_epi32(row_offsets, (const void *)(at + 16 * RUN), 1);
            const __m512i pair0 = _mm512_permutex2var_epi8(a, first_pair, b16);
            const __m512i pair1 = _mm512_permutex2var_epi8(a, second_pair, b16);
            EMIT(pair0, 0, 0);
            EMIT(pair0, 1, 0);
            EMIT(pair1, 0, 2);
            EMIT(pair1, 1, 2);
        }
    }
}
#else
#define INT4Q_SIMD 0
#endif

/* 1 when this build uses the AVX-512 path, 0 for the portable one. */
int int4q_dequant_simd(void) { return INT4Q_SIMD; }

/* pack, sz and out as above; n % 64 == 0, k % group_size == 0. threads: OpenMP threads to use. */
void int4q_dequant_int4pack(const uint8_t *pack, const uint16_t *sz, uint16_t *out,
                            int64_t n, int64_t k, int64_t group_size, int threads) {
    const int64_t blocks = n / BLOCK, groups = k / group_size;
    const int simd = INT4Q_SIMD && group_size % 32 == 0;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < blocks * groups; task++) {
        const int64_t b = task / groups, g = task % groups;
        const uint8_t *src = pack + (b * k + g * group_size) * RUN;
        uint16_t *dst = out + b * BLOCK * k + g * group_size;
#if INT4Q_SIMD
        if (simd) {
            block_group_simd(src, sz, dst, n, k, group_size, b, g);
            continue;
        }
#endif
        (void)simd;
        block_group_portable(src, sz, dst, n, k, group_size, b, g);
    }
}
