/* How well each group's grid fits it (methods/candidates.py): per group of x, group_score.h's four
 * sums (the squared error of its nearest codes on the grid, and what the least-squares refit of
 * the grid needs), summed in the order the torch reference repeats, so they are bit-identical.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"
#include "group_score.h"

static inline __attribute__((always_inline)) void scores(const float *x, const float *w, const float *scale,
                                                         const float *zero, float *out, int64_t groups,
                                                         int64_t group, int64_t first, int64_t last, int64_t top) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    int64_t column = first % groups;
    for (int64_t i = first; i < last; i++, column = column + 1 == groups ? 0 : column + 1) {
        const int4q_sums t = int4q_group_score(x + i * group, w + column * group, group, scale[i], zero[i], mid, qmax);
        out[4 * i] = t.err;
        out[4 * i + 1] = t.wu;
        out[4 * i + 2] = t.wuu;
        out[4 * i + 3] = t.wux;
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
