/* GPTQ's column loop inside one lazy block: each column rounded to its grid, its error divided by
 * the factor's diagonal, and the error spread over the block's later columns. The arithmetic is
 * the torch loop's (methods/gptq_columns.py), element for element and in the same order, and the
 * library is built with -ffp-contract=off, so the codes and the updated weights are bit-identical.
 *
 * The block is held transposed: w [b, n] has one row per column of the block over the weight's n
 * rows, so every step works on contiguous rows. Rows are independent, so the caller splits them
 * between threads and each call walks its rows in chunks that stay in L1 through the block.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

#define ROW_CHUNK 64

static inline __attribute__((always_inline)) void columns(float *w, const float *u, int64_t b, const float *scale,
                                                          const float *zero, const float *safe, const uint8_t *flat,
                                                          float *codes, float *err, int64_t n, int64_t first,
                                                          int64_t last, int64_t r0, int64_t r1, int64_t top) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    for (int64_t c0 = r0; c0 < r1; c0 += ROW_CHUNK) {
        const int64_t c1 = c0 + ROW_CHUNK < r1 ? c0 + ROW_CHUNK : r1;
        for (int64_t i = first; i < last; i++) {
            const float d = u[i * b + i];
            float *wi = w + i * n, *ei = err + i * n, *qi = codes + i * n;
            const float *si = scale + i * n, *zi = zero + i * n, *sf = safe + i * n;
            const uint8_t *fi = flat + i * n;
            for (int64_t r = c0; r < c1; r++) {
                float q = rintf((wi[r] - zi[r]) / sf[r] + mid);
                q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
                q = fi[r] ? mid : q;
                qi[r] = q;
                const float deq = (q - mid) * si[r] + zi[r];
                ei[r] = (wi[r] - deq) / d;
            }
            for (int64_t j = i + 1; j < b; j++) {
                const float uij = u[i * b + j];
                float *wj = w + j * n;
                for (int64_t r = c0; r < c1; r++) wj[r] -= uij * ei[r];
            }
        }
    }
}

#if INT4Q_X86
__attribute__((target("avx512f"))) static void columns_avx512(float *w, const float *u, int64_t b,
                                                              const float *scale, const float *zero,
                                                              const float *safe, const uint8_t *flat, float *codes,
                                                              float *err, int64_t n, int64_t first, int64_t last,
                                                              int64_t r0, int64_t r1, int64_t qmax) {
    columns(w, u, b, scale, zero, safe, flat, codes, err, n, first, last, r0, r1, qmax);
}
#endif

static void columns_portable(float *w, const float *u, int64_t b, const float *scale, const float *zero,
                             const float *safe, const uint8_t *flat, float *codes, float *err, int64_t n,
                             int64_t first, int64_t last, int64_t r0, int64_t r1, int64_t qmax) {
    columns(w, u, b, scale, zero, safe, flat, codes, err, n, first, last, r0, r1, qmax);
}

/* Columns [first, last) of a block of b columns, rows [r0, r1) of n: w [b, n] (updated in place),
 * u [b, b] the block's part of the factor, scale/zero/safe [b, n] and flat [b, n] (1: scale 0) the
 * columns' grids, codes 0..qmax (qmax = 2^bits - 1, around (qmax + 1) / 2) and err [b, n] written
 * for the columns done. */
void int4q_gptq_columns(float *w, const float *u, int64_t b, const float *scale, const float *zero, const float *safe,
                        const uint8_t *flat, float *codes, float *err, int64_t n, int64_t first, int64_t last,
                        int64_t r0, int64_t r1, int64_t qmax) {
#if INT4Q_X86
    if (int4q_max_level() >= INT4Q_AVX512 && __builtin_cpu_supports("avx512f")) {
        columns_avx512(w, u, b, scale, zero, safe, flat, codes, err, n, first, last, r0, r1, qmax);
        return;
    }
#endif
    columns_portable(w, u, b, scale, zero, safe, flat, codes, err, n, first, last, r0, r1, qmax);
}
