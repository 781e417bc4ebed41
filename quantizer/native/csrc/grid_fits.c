/* Which candidate grid first holds each group (methods/recovery.py): per group of x, the first of
 * `count` candidates (step, low) whose codes round((x - low) / step), in fp64, lie in range and give
 * back every value as GGUF's decoders compute it (fp32: code * step + low, or code * step when
 * symmetric) or, with a slack, within min(slack * the group's largest magnitude, |step| / 8) in
 * fp64. A candidate is left at its first value that fails, so a group on no grid costs a value or
 * two per candidate. The arithmetic is the torch form's, operation for operation (the library is
 * built with -ffp-contract=off).
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"

static int holds(const float *x, int64_t size, double s, double m, double bound, int exact, int symmetric,
                 double lowest, double highest) {
    const double safe = s == 0.0 ? 1.0 : s;
    for (int64_t j = 0; j < size; j++) {
        const double v = (double)x[j], q = nearbyint((v - m) / safe);
        if (!(q >= lowest && q <= highest)) return 0;
        if (!exact) {
            if (!(fabs(q * s + m - v) <= bound)) return 0;
        } else if (symmetric) {
            if ((float)(q * s) != x[j]) return 0;
        } else if ((float)q * (float)s + (float)m != x[j]) {
            return 0;
        }
    }
    return 1;
}

/* Groups [first, last) of x [M, size]; candidates steps and lows [count, M] (fp64); codes 0..top,
 * centred on (top + 1) / 2 when symmetric; slack 0 for an exact fit. Writes the first candidate's
 * index per group, or -1. */
void int4q_first_fit(const float *x, const double *steps, const double *lows, int64_t count, int64_t m_groups,
                     int64_t size, int64_t first, int64_t last, int64_t top, int symmetric, double slack,
                     int64_t *out) {
    const double mid = (double)((top + 1) / 2);
    const double lowest = symmetric ? -mid : 0.0, highest = symmetric ? (double)top - mid : (double)top;
    for (int64_t i = first; i < last; i++) {
        const float *xi = x + i * size;
        float largest = 0.0f;
        for (int64_t j = 0; j < size; j++) largest = fabsf(xi[j]) > largest ? fabsf(xi[j]) : largest;
        const double spread = slack * (double)largest;
        out[i] = -1;
        for (int64_t c = 0; c < count; c++) {
            const double s = steps[c * m_groups + i], eighth = fabs(s) / 8.0;
            const double bound = spread < eighth ? spread : eighth;
            if (holds(xi, size, s, lows[c * m_groups + i], bound, slack == 0.0, symmetric, lowest, highest)) {
                out[i] = c;
                break;
            }
        }
    }
}
