/* How well each group's grid fits it (methods/candidates.py): per group of x, its nearest codes q
 * on the grid (scale, zero), u = q - mid, and four sums over the group's elements, each weighted by
 * the column's weight w: the squared error of the codes' values, w u, w u u and w u x (what the
 * least-squares refit of the grid needs).
 *
 * Element j of a group adds to lane j % 8; each lane sums in element order, then the lanes sum as
 * ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). The torch reference sums the same way, element for
 * element, and the library is built with -ffp-contract=off, so the sums are bit-identical.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

#define LANES 8

static inline __attribute__((always_inline)) float lanes_total(const float *v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

static inline __attribute__((always_inline)) void scores(const float *x, const float *w, const float *scale,
                                                         const float *zero, float *out, int64_t groups,
                                                         int64_t group, int64_t first, int64_t last, int64_t top) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    int64_t column = first % groups;
    for (int64_t i = first; i < last; i++, column = column + 1 == groups ? 0 : column + 1) {
        const float *xi = x + i * group, *wi = w + column * group;
        const float s = scale[i], z = zero[i], safe = s == 0.0f ? 1.0f : s;
        float err[LANES] = {0}, wu[LANES] = {0}, wuu[LANES] = {0}, wux[LANES] = {0};
        for (int64_t j0 = 0; j0 < group; j0 += LANES)
            for (int l = 0; l < LANES; l++) {
                const float v = xi[j0 + l], wl = wi[j0 + l];
                float q = rintf((v - z) / safe + mid);
                q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
                q = s == 0.0f ? mid : q;
                const float u = q - mid, d = u * s + z - v, a = wl * u;
                err[l] += d * d * wl;
                wu[l] += a;
                wuu[l] += a * u;
                wux[l] += a * v;
            }
        out[4 * i] = lanes_total(err);
        out[4 * i + 1] = lanes_total(wu);
        out[4 * i + 2] = lanes_total(wuu);
        out[4 * i + 3] = lanes_total(wux);
    }
}

#if INT4Q_X86
__attribute__((target("avx2"))) static void scores_avx2(const float *x, const float *w, const float *scale,
                                                        const float *zero, float *out, int64_t groups, int64_t group,
                                                        int64_t first, int64_t last, int64_t top) {
    scores(x, w, scale, zero, out, groups, group, first, last, top);
}
#endif

static void scores_portable(const float *x, const float *w, const float *scale, const float *zero, float *out,
                            int64_t groups, int64_t group, int64_t first, int64_t last, int64_t top) {
    scores(x, w, scale, zero, out, groups, group, first, last, top);
}

/* Groups [first, last) of x [rows * groups, group] (group a multiple of 8), weights w [groups,
 * group] (group i takes row i % groups), scale and zero [rows * groups]; out [rows * groups, 4].
 * Codes are 0..top around (top + 1) / 2; a group with scale 0 takes the middle code. */
void int4q_grid_scores(const float *x, const float *w, const float *scale, const float *zero, float *out,
                       int64_t groups, int64_t group, int64_t first, int64_t last, int64_t top) {
#if INT4Q_X86
    if (int4q_max_level() > INT4Q_PORTABLE && __builtin_cpu_supports("avx2")) {
        scores_avx2(x, w, scale, zero, out, groups, group, first, last, top);
        return;
    }
#endif
    scores_portable(x, w, scale, zero, out, groups, group, first, last, top);
}
