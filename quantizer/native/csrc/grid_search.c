/* The grid searches' candidate loops, each group's values held in cache while all its candidates
 * are scored (methods/fused_search.py, candidates.grid_errors): every candidate grid is scored as
 * grid_scores.c scores it (the same codes, the same lane order of the sums), and the choice among
 * them takes the torch loops' operations in their order, so both write the same bits (the library
 * is built with -ffp-contract=off).
 *
 * shrink search (shrink_search.shrunk_grids on fp32-stored grids): the min/max grid, then for each
 * range factor the shrunk grid and its weighted least-squares refit; a later grid wins only where
 * its error is strictly lower.
 * stretch search (llama_searches.llama_group_grids, ggml's make_qkx2/3_quants): for each step count
 * the grid of that many steps from the group's lowest point across its span, refitted by least
 * squares on its codes (the minimum raised to 0 where it would be above it); kept where its error
 * is strictly lower.
 * errors (candidates.grid_errors): each of a few candidate grids' weighted squared error, the
 * first column of grid_scores.c's sums.
 * signed search (llama_searches.llama_signed_grids, ggml's make_qx_quants): for each step count
 * the symmetric grid that puts the group's value of largest magnitude at -count steps, refitted
 * by least squares on its codes; kept where its fit gains strictly more.
 */
#include <math.h>
#include <stdint.h>

#include "int4q.h"
#include "group_score.h"

#define LANES INT4Q_SCORE_LANES
#define TINY 1e-30f

/* An fp32-stored grid from a range [lo, hi]: asymmetric (hi - lo) / qmax with lo at code 0;
 * symmetric the signed step that puts the value of largest magnitude at code 0, zero 0. */
static inline __attribute__((always_inline)) void range_grid(float lo, float hi, int symmetric, float mid, float qmax,
                                                             float *s, float *z) {
    if (symmetric) {
        *s = hi > -lo ? -hi / mid : -lo / mid;
        *z = 0.0f;
    } else {
        *s = (hi - lo) / qmax;
        *z = lo + mid * *s;
    }
}

static inline __attribute__((always_inline)) void shrink_groups(const float *x, const float *w, const float *lo,
                                                                const float *hi, const float *sw, const float *swx,
                                                                const float *shrinks, int64_t count, int64_t groups,
                                                                int64_t size, int64_t first, int64_t last,
                                                                int64_t top, int symmetric, float *scale_out,
                                                                float *zero_out) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    for (int64_t i = first; i < last; i++) {
        const int64_t column = i % groups;
        const float *xi = x + i * size, *wi = w + column * size;
        const float l = lo[i], h = hi[i], weight_sum = sw[column], weighted_sum = swx[i];
        float s, z;
        range_grid(l, h, symmetric, mid, qmax, &s, &z);
        float best = int4q_group_score(xi, wi, size, s, z, mid, qmax).err;
        const float centre = symmetric ? 0.0f : (l + h) / 2.0f;
        for (int64_t c = 0; c < count; c++) {
            float cs, cz;
            range_grid(centre + (l - centre) * shrinks[c], centre + (h - centre) * shrinks[c], symmetric, mid, qmax,
                       &cs, &cz);
            const int4q_sums t = int4q_group_score(xi, wi, size, cs, cz, mid, qmax);
            float rs, rz;
            if (symmetric) {
                rs = t.wux / (t.wuu < TINY ? TINY : t.wuu);
                rz = 0.0f;
            } else {
                float det = t.wuu * weight_sum - t.wu * t.wu;
                det = det < TINY ? TINY : det;
                float fs = (t.wux * weight_sum - t.wu * weighted_sum) / det;
                const float fz = (t.wuu * weighted_sum - t.wu * t.wux) / det;
                fs = fs < 0.0f ? 0.0f : fs;
                range_grid(fz - mid * fs, fz + (qmax - mid) * fs, 0, mid, qmax, &rs, &rz);
            }
            if (t.err < best) best = t.err, s = cs, z = cz;
            const float refit = int4q_group_score(xi, wi, size, rs, rz, mid, qmax).err;
            if (refit < best) best = refit, s = rs, z = rz;
        }
        scale_out[i] = s;
        zero_out[i] = z;
    }
}

static inline __attribute__((always_inline)) void stretch_groups(const float *x, const float *w, const float *low,
                                                                 const float *span, const float *sum_w,
                                                                 const float *sum_x, const float *sum_x2,
                                                                 const float *steps, int64_t count, int64_t size,
                                                                 int64_t first, int64_t last, int64_t top,
                                                                 float *step_out, float *zero_out) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    for (int64_t i = first; i < last; i++) {
        const float *xi = x + i * size, *wi = w + i * size;
        const float lw = low[i], sp = span[i], n = sum_w[i], sx = sum_x[i], sxx = sum_x2[i];
        float best_step = sp / qmax, best_zero = lw;
        float step = sp / steps[0];
        float best = int4q_group_score(xi, wi, size, step, lw + mid * step, mid, qmax).err;
        for (int64_t c = 1; c < count; c++) {
            step = sp / steps[c];
            const int4q_sums t = int4q_group_score(xi, wi, size, step, lw + mid * step, mid, qmax);
            const float sl = t.wu + mid * n, sll = (t.wuu + 2.0f * mid * t.wu) + mid * mid * n;
            const float sxl = t.wux + mid * sx;
            const float det = n * sll - sl * sl, safe = det > 0.0f ? det : 1.0f;
            float fs = (n * sxl - sx * sl) / safe, fz = (sll * sx - sl * sxl) / safe;
            if (fz > 0.0f) {
                fs = sxl / (sll < TINY ? TINY : sll);
                fz = 0.0f;
            }
            const float err = ((((sxx + fs * fs * sll) + fz * fz * n) + 2.0f * fs * fz * sl) - 2.0f * fs * sxl) -
                              2.0f * fz * sx;
            if (det > 0.0f && err < best) best = err, best_step = fs, best_zero = fz;
        }
        step_out[i] = best_step;
        zero_out[i] = best_zero;
    }
}

static inline __attribute__((always_inline)) void signed_groups(const float *x, const float *w, const float *top,
                                                                const float *steps, int64_t count, int64_t size,
                                                                int64_t first, int64_t last, int64_t qtop,
                                                                float *scale_out) {
    const float qmax = (float)qtop, mid = (float)((qtop + 1) / 2);
    for (int64_t i = first; i < last; i++) {
        const float *xi = x + i * size, *wi = w + i * size;
        const float t = top[i];
        int4q_sums f = int4q_group_score(xi, wi, size, -t / steps[0], 0.0f, mid, qmax);
        float scale = f.wuu > 0.0f ? f.wux / f.wuu : 0.0f, best = scale * f.wux;
        for (int64_t c = 1; c < count; c++) {
            f = int4q_group_score(xi, wi, size, -t / steps[c], 0.0f, mid, qmax);
            const float trial = f.wux / (f.wuu > 0.0f ? f.wuu : 1.0f);
            if (f.wuu > 0.0f && f.wux * f.wux > best * f.wuu) scale = trial, best = trial * f.wux;
        }
        scale_out[i] = scale;
    }
}

static inline __attribute__((always_inline)) void errors_groups(const float *x, const float *w, const float *scales,
                                                                const float *zeros, int64_t count, int64_t m,
                                                                int64_t groups, int64_t size, int64_t first,
                                                                int64_t last, int64_t top, float *out) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    for (int64_t i = first; i < last; i++)
        for (int64_t c = 0; c < count; c++)
            out[c * m + i] = int4q_group_score(x + i * size, w + (i % groups) * size, size, scales[c * m + i],
                                               zeros[c * m + i], mid, qmax)
                                 .err;
}

#if INT4Q_X86
__attribute__((target("avx2"))) static void shrink_avx2(const float *x, const float *w, const float *lo,
                                                        const float *hi, const float *sw, const float *swx,
                                                        const float *shrinks, int64_t count, int64_t groups,
                                                        int64_t size, int64_t first, int64_t last, int64_t top,
                                                        int symmetric, float *scale_out, float *zero_out) {
    shrink_groups(x, w, lo, hi, sw, swx, shrinks, count, groups, size, first, last, top, symmetric, scale_out,
                  zero_out);
}

__attribute__((target("avx2"))) static void stretch_avx2(const float *x, const float *w, const float *low,
                                                         const float *span, const float *sum_w, const float *sum_x,
                                                         const float *sum_x2, const float *steps, int64_t count,
                                                         int64_t size, int64_t first, int64_t last, int64_t top,
                                                         float *step_out, float *zero_out) {
    stretch_groups(x, w, low, span, sum_w, sum_x, sum_x2, steps, count, size, first, last, top, step_out, zero_out);
}

__attribute__((target("avx2"))) static void signed_avx2(const float *x, const float *w, const float *top,
                                                        const float *steps, int64_t count, int64_t size, int64_t first,
                                                        int64_t last, int64_t qtop, float *scale_out) {
    signed_groups(x, w, top, steps, count, size, first, last, qtop, scale_out);
}

__attribute__((target("avx2"))) static void errors_avx2(const float *x, const float *w, const float *scales,
                                                        const float *zeros, int64_t count, int64_t m, int64_t groups,
                                                        int64_t size, int64_t first, int64_t last, int64_t top,
                                                        float *out) {
    errors_groups(x, w, scales, zeros, count, m, groups, size, first, last, top, out);
}
#endif

static void errors_portable(const float *x, const float *w, const float *scales, const float *zeros, int64_t count,
                            int64_t m, int64_t groups, int64_t size, int64_t first, int64_t last, int64_t top,
                            float *out) {
    errors_groups(x, w, scales, zeros, count, m, groups, size, first, last, top, out);
}

static void signed_portable(const float *x, const float *w, const float *top, const float *steps, int64_t count,
                            int64_t size, int64_t first, int64_t last, int64_t qtop, float *scale_out) {
    signed_groups(x, w, top, steps, count, size, first, last, qtop, scale_out);
}

static void shrink_portable(const float *x, const float *w, const float *lo, const float *hi, const float *sw,
                            const float *swx, const float *shrinks, int64_t count, int64_t groups, int64_t size,
                            int64_t first, int64_t last, int64_t top, int symmetric, float *scale_out,
                            float *zero_out) {
    shrink_groups(x, w, lo, hi, sw, swx, shrinks, count, groups, size, first, last, top, symmetric, scale_out,
                  zero_out);
}

static void stretch_portable(const float *x, const float *w, const float *low, const float *span, const float *sum_w,
                             const float *sum_x, const float *sum_x2, const float *steps, int64_t count, int64_t size,
                             int64_t first, int64_t last, int64_t top, float *step_out, float *zero_out) {
    stretch_groups(x, w, low, span, sum_w, sum_x, sum_x2, steps, count, size, first, last, top, step_out, zero_out);
}

#if INT4Q_X86
/* The AVX-512 path: sixteen groups side by side, one in each vector lane, so the choices among
 * candidates are vector operations too. Each lane takes the scalar path's operations in its
 * order (element j into sum lane j % 8, then the lanes pairwise); every select is the scalar
 * path's comparison, so signed zeros come out as they do there. */
#define WIDE 16
#define WIDE_SIZE 256 /* the largest group the path takes (its transposed copies live on the stack) */

typedef struct {
    __m512 err, wu, wuu, wux;
} wide_sums;

#define V(x) _mm512_set1_ps(x)
#define LESS(a, b) _mm512_cmp_ps_mask((a), (b), _CMP_LT_OQ)
#define MORE(a, b) _mm512_cmp_ps_mask((a), (b), _CMP_GT_OQ)
#define PICK(mask, yes, no) _mm512_mask_blend_ps((mask), (no), (yes))
#define NEG(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)))

__attribute__((target("avx512f"))) static inline __m512 wide_total(const __m512 *v) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3])),
                         _mm512_add_ps(_mm512_add_ps(v[4], v[5]), _mm512_add_ps(v[6], v[7])));
}

/* int4q_group_score() for sixteen groups: xt and wt [size][16], element j of lane g the group's
 * j-th. */
__attribute__((target("avx512f"))) static inline wide_sums wide_score(const float *xt, const float *wt, int64_t size,
                                                                       __m512 s, __m512 z, float midf, float qmaxf) {
    const __m512 mid = V(midf), qmax = V(qmaxf), zero = _mm512_setzero_ps();
    const __mmask16 flat = _mm512_cmp_ps_mask(s, zero, _CMP_EQ_OQ);
    const __m512 safe = PICK(flat, V(1.0f), s);
    __m512 err[LANES], wu[LANES], wuu[LANES], wux[LANES];
    for (int l = 0; l < LANES; l++) {
        __m512 e = zero, a1 = zero, a2 = zero, a3 = zero;
        for (int64_t j = l; j < size; j += LANES) {
            const __m512 v = _mm512_loadu_ps(xt + j * WIDE), wl = _mm512_loadu_ps(wt + j * WIDE);
            __m512 q = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(_mm512_sub_ps(v, z), safe), mid),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = PICK(LESS(q, zero), zero, PICK(MORE(q, qmax), qmax, q));
            q = PICK(flat, mid, q);
            const __m512 u = _mm512_sub_ps(q, mid);
            const __m512 d = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(u, s), z), v), a = _mm512_mul_ps(wl, u);
            e = _mm512_add_ps(e, _mm512_mul_ps(_mm512_mul_ps(d, d), wl));
            a1 = _mm512_add_ps(a1, a);
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(a, u));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(a, v));
        }
        err[l] = e, wu[l] = a1, wuu[l] = a2, wux[l] = a3;
    }
    return (wide_sums){wide_total(err), wide_total(wu), wide_total(wuu), wide_total(wux)};
}

/* Sixteen groups from row `first` of src [*, size] into dst [size][16]. */
static inline void transpose(const float *src, int64_t size, float *dst) {
    for (int g = 0; g < WIDE; g++)
        for (int64_t j = 0; j < size; j++) dst[j * WIDE + g] = src[g * size + j];
}

__attribute__((target("avx512f"))) static inline void wide_range_grid(__m512 lo, __m512 hi, int symmetric, float mid,
                                                                       float qmax, __m512 *s, __m512 *z) {
    if (symmetric) {
        const __m512 neg_lo = NEG(lo), neg_hi = NEG(hi);
        *s = PICK(MORE(hi, neg_lo), _mm512_div_ps(neg_hi, V(mid)), _mm512_div_ps(neg_lo, V(mid)));
        *z = _mm512_setzero_ps();
    } else {
        *s = _mm512_div_ps(_mm512_sub_ps(hi, lo), V(qmax));
        *z = _mm512_add_ps(lo, _mm512_mul_ps(V(mid), *s));
    }
}

__attribute__((target("avx512f"))) static void shrink_avx512(const float *x, const float *w, const float *lo,
                                                             const float *hi, const float *sw, const float *swx,
                                                             const float *shrinks, int64_t count, int64_t groups,
                                                             int64_t size, int64_t first, int64_t last, int64_t top,
                                                             int symmetric, float *scale_out, float *zero_out) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    float xt[WIDE_SIZE * WIDE], wt[WIDE_SIZE * WIDE], sums_of_w[WIDE];
    for (int64_t i = first; i < last; i += WIDE) {
        transpose(x + i * size, size, xt);
        for (int g = 0; g < WIDE; g++) {
            const int64_t column = (i + g) % groups;
            sums_of_w[g] = sw[column];
            for (int64_t j = 0; j < size; j++) wt[j * WIDE + g] = w[column * size + j];
        }
        const __m512 l = _mm512_loadu_ps(lo + i), h = _mm512_loadu_ps(hi + i), n = _mm512_loadu_ps(sums_of_w);
        const __m512 nx = _mm512_loadu_ps(swx + i), zero = _mm512_setzero_ps();
        __m512 s, z, cs, cz, rs, rz;
        wide_range_grid(l, h, symmetric, mid, qmax, &s, &z);
        __m512 best = wide_score(xt, wt, size, s, z, mid, qmax).err;
        const __m512 centre = symmetric ? zero : _mm512_div_ps(_mm512_add_ps(l, h), V(2.0f));
        for (int64_t c = 0; c < count; c++) {
            const __m512 f = V(shrinks[c]);
            wide_range_grid(_mm512_add_ps(centre, _mm512_mul_ps(_mm512_sub_ps(l, centre), f)),
                            _mm512_add_ps(centre, _mm512_mul_ps(_mm512_sub_ps(h, centre), f)), symmetric, mid, qmax,
                            &cs, &cz);
            const wide_sums t = wide_score(xt, wt, size, cs, cz, mid, qmax);
            if (symmetric) {
                rs = _mm512_div_ps(t.wux, PICK(LESS(t.wuu, V(TINY)), V(TINY), t.wuu));
                rz = zero;
            } else {
                __m512 det = _mm512_sub_ps(_mm512_mul_ps(t.wuu, n), _mm512_mul_ps(t.wu, t.wu));
                det = PICK(LESS(det, V(TINY)), V(TINY), det);
                __m512 fs = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(t.wux, n), _mm512_mul_ps(t.wu, nx)), det);
                const __m512 fz = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(t.wuu, nx), _mm512_mul_ps(t.wu, t.wux)),
                                                det);
                fs = PICK(LESS(fs, zero), zero, fs);
                wide_range_grid(_mm512_sub_ps(fz, _mm512_mul_ps(V(mid), fs)),
                                _mm512_add_ps(fz, _mm512_mul_ps(V(qmax - mid), fs)), 0, mid, qmax, &rs, &rz);
            }
            __mmask16 better = LESS(t.err, best);
            best = PICK(better, t.err, best), s = PICK(better, cs, s), z = PICK(better, cz, z);
            const __m512 refit = wide_score(xt, wt, size, rs, rz, mid, qmax).err;
            better = LESS(refit, best);
            best = PICK(better, refit, best), s = PICK(better, rs, s), z = PICK(better, rz, z);
        }
        _mm512_storeu_ps(scale_out + i, s);
        _mm512_storeu_ps(zero_out + i, z);
    }
}

__attribute__((target("avx512f"))) static void stretch_avx512(const float *x, const float *w, const float *low,
                                                              const float *span, const float *sum_w,
                                                              const float *sum_x, const float *sum_x2,
                                                              const float *steps, int64_t count, int64_t size,
                                                              int64_t first, int64_t last, int64_t top,
                                                              float *step_out, float *zero_out) {
    const float qmax = (float)top, midf = (float)((top + 1) / 2);
    const __m512 mid = V(midf), zero = _mm512_setzero_ps();
    float xt[WIDE_SIZE * WIDE], wt[WIDE_SIZE * WIDE];
    for (int64_t i = first; i < last; i += WIDE) {
        transpose(x + i * size, size, xt);
        transpose(w + i * size, size, wt);
        const __m512 lw = _mm512_loadu_ps(low + i), sp = _mm512_loadu_ps(span + i), n = _mm512_loadu_ps(sum_w + i);
        const __m512 sx = _mm512_loadu_ps(sum_x + i), sxx = _mm512_loadu_ps(sum_x2 + i);
        __m512 best_step = _mm512_div_ps(sp, V(qmax)), best_zero = lw;
        __m512 step = _mm512_div_ps(sp, V(steps[0]));
        __m512 best = wide_score(xt, wt, size, step, _mm512_add_ps(lw, _mm512_mul_ps(mid, step)), midf, qmax).err;
        for (int64_t c = 1; c < count; c++) {
            step = _mm512_div_ps(sp, V(steps[c]));
            const wide_sums t = wide_score(xt, wt, size, step, _mm512_add_ps(lw, _mm512_mul_ps(mid, step)), midf, qmax);
            const __m512 sl = _mm512_add_ps(t.wu, _mm512_mul_ps(mid, n));
            const __m512 sll = _mm512_add_ps(_mm512_add_ps(t.wuu, _mm512_mul_ps(V(2.0f * midf), t.wu)),
                                             _mm512_mul_ps(V(midf * midf), n));
            const __m512 sxl = _mm512_add_ps(t.wux, _mm512_mul_ps(mid, sx));
            const __m512 det = _mm512_sub_ps(_mm512_mul_ps(n, sll), _mm512_mul_ps(sl, sl));
            const __mmask16 solvable = MORE(det, zero);
            const __m512 safe = PICK(solvable, det, V(1.0f));
            __m512 fs = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(n, sxl), _mm512_mul_ps(sx, sl)), safe);
            __m512 fz = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(sll, sx), _mm512_mul_ps(sl, sxl)), safe);
            const __mmask16 positive = MORE(fz, zero);
            fs = PICK(positive, _mm512_div_ps(sxl, PICK(LESS(sll, V(TINY)), V(TINY), sll)), fs);
            fz = PICK(positive, zero, fz);
            const __m512 two_fs = _mm512_mul_ps(V(2.0f), fs);
            __m512 err = _mm512_add_ps(sxx, _mm512_mul_ps(_mm512_mul_ps(fs, fs), sll));
            err = _mm512_add_ps(err, _mm512_mul_ps(_mm512_mul_ps(fz, fz), n));
            err = _mm512_add_ps(err, _mm512_mul_ps(_mm512_mul_ps(two_fs, fz), sl));
            err = _mm512_sub_ps(err, _mm512_mul_ps(two_fs, sxl));
            err = _mm512_sub_ps(err, _mm512_mul_ps(_mm512_mul_ps(V(2.0f), fz), sx));
            const __mmask16 take = solvable & LESS(err, best);
            best = PICK(take, err, best), best_step = PICK(take, fs, best_step), best_zero = PICK(take, fz, best_zero);
        }
        _mm512_storeu_ps(step_out + i, best_step);
        _mm512_storeu_ps(zero_out + i, best_zero);
    }
}

__attribute__((target("avx512f"))) static void signed_avx512(const float *x, const float *w, const float *top,
                                                             const float *steps, int64_t count, int64_t size,
                                                             int64_t first, int64_t last, int64_t qtop,
                                                             float *scale_out) {
    const float qmax = (float)qtop, mid = (float)((qtop + 1) / 2);
    const __m512 zero = _mm512_setzero_ps();
    float xt[WIDE_SIZE * WIDE], wt[WIDE_SIZE * WIDE];
    for (int64_t i = first; i < last; i += WIDE) {
        transpose(x + i * size, size, xt);
        transpose(w + i * size, size, wt);
        const __m512 minus_top = NEG(_mm512_loadu_ps(top + i));
        wide_sums f = wide_score(xt, wt, size, _mm512_div_ps(minus_top, V(steps[0])), zero, mid, qmax);
        __mmask16 fits = MORE(f.wuu, zero);
        __m512 scale = PICK(fits, _mm512_div_ps(f.wux, PICK(fits, f.wuu, V(1.0f))), zero);
        __m512 best = _mm512_mul_ps(scale, f.wux);
        for (int64_t c = 1; c < count; c++) {
            f = wide_score(xt, wt, size, _mm512_div_ps(minus_top, V(steps[c])), zero, mid, qmax);
            fits = MORE(f.wuu, zero);
            const __m512 trial = _mm512_div_ps(f.wux, PICK(fits, f.wuu, V(1.0f)));
            const __mmask16 better = fits & MORE(_mm512_mul_ps(f.wux, f.wux), _mm512_mul_ps(best, f.wuu));
            scale = PICK(better, trial, scale), best = PICK(better, _mm512_mul_ps(trial, f.wux), best);
        }
        _mm512_storeu_ps(scale_out + i, scale);
    }
}

__attribute__((target("avx512f"))) static void errors_avx512(const float *x, const float *w, const float *scales,
                                                             const float *zeros, int64_t count, int64_t m,
                                                             int64_t groups, int64_t size, int64_t first,
                                                             int64_t last, int64_t top, float *out) {
    const float qmax = (float)top, mid = (float)((top + 1) / 2);
    float xt[WIDE_SIZE * WIDE], wt[WIDE_SIZE * WIDE];
    for (int64_t i = first; i < last; i += WIDE) {
        transpose(x + i * size, size, xt);
        for (int g = 0; g < WIDE; g++) {
            const float *wg = w + ((i + g) % groups) * size;
            for (int64_t j = 0; j < size; j++) wt[j * WIDE + g] = wg[j];
        }
        for (int64_t c = 0; c < count; c++) {
            const __m512 s = _mm512_loadu_ps(scales + c * m + i), z = _mm512_loadu_ps(zeros + c * m + i);
            _mm512_storeu_ps(out + c * m + i, wide_score(xt, wt, size, s, z, mid, qmax).err);
        }
    }
}

static int use_avx512(int64_t size) {
    return size <= WIDE_SIZE && int4q_max_level() >= INT4Q_AVX512 && __builtin_cpu_supports("avx512f");
}
#endif

static int use_avx2(void) {
#if INT4Q_X86
    return int4q_max_level() > INT4Q_PORTABLE && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* Groups [first, last) of x [rows * groups, size] (size a multiple of 8), weights w [groups, size]
 * (group i takes row i % groups), their ranges lo and hi, sw [groups] the weights' sums and swx
 * [rows * groups] the weighted values' sums; `count` range factors; codes 0..top around
 * (top + 1) / 2. Writes each group's chosen fp32 scale and zero. */
void int4q_shrink_search(const float *x, const float *w, const float *lo, const float *hi, const float *sw,
                         const float *swx, const float *shrinks, int64_t count, int64_t groups, int64_t size,
                         int64_t first, int64_t last, int64_t top, int symmetric, float *scale_out, float *zero_out) {
#if INT4Q_X86
    if (use_avx512(size)) {
        const int64_t wide_last = first + (last - first) / WIDE * WIDE;
        shrink_avx512(x, w, lo, hi, sw, swx, shrinks, count, groups, size, first, wide_last, top, symmetric,
                      scale_out, zero_out);
        first = wide_last;
    }
    if (use_avx2()) {
        shrink_avx2(x, w, lo, hi, sw, swx, shrinks, count, groups, size, first, last, top, symmetric, scale_out,
                    zero_out);
        return;
    }
#endif
    shrink_portable(x, w, lo, hi, sw, swx, shrinks, count, groups, size, first, last, top, symmetric, scale_out,
                    zero_out);
}

/* Groups [first, last) of x [M, size] (size a multiple of 8) with their own weights w [M, size],
 * lowest points `low`, spans (nonzero), sums of weights, weighted values and weighted squares;
 * `count` step counts, the first the min/max grid's. Writes each group's chosen step and zero. */
void int4q_stretch_search(const float *x, const float *w, const float *low, const float *span, const float *sum_w,
                          const float *sum_x, const float *sum_x2, const float *steps, int64_t count, int64_t size,
                          int64_t first, int64_t last, int64_t top, float *step_out, float *zero_out) {
#if INT4Q_X86
    if (use_avx512(size)) {
        const int64_t wide_last = first + (last - first) / WIDE * WIDE;
        stretch_avx512(x, w, low, span, sum_w, sum_x, sum_x2, steps, count, size, first, wide_last, top, step_out,
                       zero_out);
        first = wide_last;
    }
    if (use_avx2()) {
        stretch_avx2(x, w, low, span, sum_w, sum_x, sum_x2, steps, count, size, first, last, top, step_out,
                     zero_out);
        return;
    }
#endif
    stretch_portable(x, w, low, span, sum_w, sum_x, sum_x2, steps, count, size, first, last, top, step_out,
                     zero_out);
}

/* Groups [first, last) of x [M, size] (size a multiple of 8) with their own weights w [M, size]
 * and values of largest magnitude `top` (nonzero); `count` step counts, the first the plain
 * one. Writes each group's chosen signed step. */
void int4q_signed_search(const float *x, const float *w, const float *top, const float *steps, int64_t count,
                         int64_t size, int64_t first, int64_t last, int64_t qtop, float *scale_out) {
#if INT4Q_X86
    if (use_avx512(size)) {
        const int64_t wide_last = first + (last - first) / WIDE * WIDE;
        signed_avx512(x, w, top, steps, count, size, first, wide_last, qtop, scale_out);
        first = wide_last;
    }
    if (use_avx2()) {
        signed_avx2(x, w, top, steps, count, size, first, last, qtop, scale_out);
        return;
    }
#endif
    signed_portable(x, w, top, steps, count, size, first, last, qtop, scale_out);
}

/* Groups [first, last) of x [m, size] (size a multiple of 8), weights w [groups, size] (group i
 * takes row i % groups); `count` candidate grids scales and zeros [count, m]. Writes out [count, m]:
 * each candidate's weighted squared error per group. */
void int4q_grid_errors(const float *x, const float *w, const float *scales, const float *zeros, int64_t count,
                       int64_t m, int64_t groups, int64_t size, int64_t first, int64_t last, int64_t top, float *out) {
#if INT4Q_X86
    if (use_avx512(size)) {
        const int64_t wide_last = first + (last - first) / WIDE * WIDE;
        errors_avx512(x, w, scales, zeros, count, m, groups, size, first, wide_last, top, out);
        first = wide_last;
    }
    if (use_avx2()) {
        errors_avx2(x, w, scales, zeros, count, m, groups, size, first, last, top, out);
        return;
    }
#endif
    errors_portable(x, w, scales, zeros, count, m, groups, size, first, last, top, out);
}
