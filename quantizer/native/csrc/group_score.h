/* One group's fit to a grid, as grid_scores.c and grid_search.c score it: the nearest codes q on
 * the grid (scale s, zero z; a group of scale 0 takes the middle code), u = q - mid, and four sums
 * over the group's elements, each weighted by its column's weight w: the squared error of the
 * codes' values, w u, w u u and w u x. Element j adds to lane j % 8; each lane sums in element
 * order, then the lanes as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), the order the torch form
 * (methods/candidates.py) repeats. Include after int4q.h; the library is built with
 * -ffp-contract=off. */
#ifndef INT4Q_GROUP_SCORE_H
#define INT4Q_GROUP_SCORE_H

#include <math.h>
#include <stdint.h>

#define INT4Q_SCORE_LANES 8

typedef struct {
    float err, wu, wuu, wux;
} int4q_sums;

static inline __attribute__((always_inline)) float int4q_lanes_total(const float *v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* The sums for `size` values x (a multiple of 8) and their weights w. */
static inline __attribute__((always_inline)) int4q_sums int4q_group_score(const float *x, const float *w,
                                                                          int64_t size, float s, float z, float mid,
                                                                          float qmax) {
    const float safe = s == 0.0f ? 1.0f : s;
    float err[INT4Q_SCORE_LANES] = {0}, wu[INT4Q_SCORE_LANES] = {0}, wuu[INT4Q_SCORE_LANES] = {0},
          wux[INT4Q_SCORE_LANES] = {0};
    for (int64_t j0 = 0; j0 < size; j0 += INT4Q_SCORE_LANES)
        for (int l = 0; l < INT4Q_SCORE_LANES; l++) {
            const float v = x[j0 + l], wl = w[j0 + l];
            float q = rintf((v - z) / safe + mid);
            q = q < 0.0f ? 0.0f : (q > qmax ? qmax : q);
            q = s == 0.0f ? mid : q;
            const float u = q - mid, d = u * s + z - v, a = wl * u;
            err[l] += d * d * wl;
            wu[l] += a;
            wuu[l] += a * u;
            wux[l] += a * v;
        }
    return (int4q_sums){int4q_lanes_total(err), int4q_lanes_total(wu), int4q_lanes_total(wuu),
                        int4q_lanes_total(wux)};
}

#endif
