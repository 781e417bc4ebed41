/* Correlated rounding's coordinate descent (methods/rounding.py): per row and block of b input
 * columns, each code in turn moves one step up or down where that lowers the block's objective
 * e^T H e, for up to `sweeps` passes. The arithmetic is the torch loop's, element for element and
 * in the same order (the library is built with -ffp-contract=off), so the codes are bit-identical.
 *
 * codes int16 [n, G, b] (updated), step fp32 [n, G, b] (each code's group scale), pull fp32
 * [n, G, b] (H e, updated), blocks fp32 [G, b, b] (H's diagonal blocks, row-major), rise and
 * fall fp32 [qmax + 1]: the level change of a step up and down from each code (a linear grid:
 * 1 and -1), times the scale the value's change.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

static void descend(int16_t *c, const float *s, float *p, const float *h, const float *rise, const float *fall,
                    int64_t b, int64_t qmax, int64_t sweeps) {
    for (int64_t sweep = 0; sweep < sweeps; sweep++) {
        int moved = 0;
        for (int64_t j = 0; j < b; j++) {
            const float raise = rise[c[j]] * s[j], lower = fall[c[j]] * s[j], hjj = h[j * b + j];
            const float up = c[j] < qmax ? raise * raise * hjj - 2.0f * raise * p[j] : INFINITY;
            const float down = c[j] > 0 ? lower * lower * hjj - 2.0f * lower * p[j] : INFINITY;
            const int d = up < 0.0f && up <= down ? 1 : (down < 0.0f ? -1 : 0);
            if (!d) continue;
            moved = 1;
            c[j] = (int16_t)(c[j] + d);
            const float shift = d > 0 ? raise : lower;
            for (int64_t i = 0; i < b; i++) p[i] -= shift * h[i * b + j];
        }
        if (!moved) return;
    }
}

/* Rows [r0, r1) of n, every block of each. */
void int4q_refine_codes(int16_t *codes, const float *step, float *pull, const float *blocks, const float *rise,
                        const float *fall, int64_t groups, int64_t b, int64_t qmax, int64_t sweeps, int64_t r0,
                        int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (r * groups + g) * b;
            descend(codes + at, step + at, pull + at, blocks + g * b * b, rise, fall, b, qmax, sweeps);
        }
}
