// The grid searches' scoring of candidate grids as torch.ops.int4q_native.grid_scores (grid_scores.c), their
// candidate loops as shrink_search, stretch_search, signed_search and grid_errors (grid_search.c), the grid
// recovery's first fitting candidate as first_fit (grid_fits.c), and round-to-nearest on bf16-stored min/max
// grids as torch.ops.int4q_native.rtn_minmax (rtn_minmax.c).
// The library itself is defined in int4_ops.cpp.
#include <algorithm>
#include <initializer_list>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "int4q.h"

namespace {

// x fp32 [n, G, group] (group a multiple of 8), weights fp32 [G, group], scale and zero fp32 [n, G],
// out fp32 [n, G, 4] written; all contiguous. Groups are split between ATen's threads.
void grid_scores(const at::Tensor &x, const at::Tensor &weights, const at::Tensor &scale, const at::Tensor &zero,
                 int64_t qmax, const at::Tensor &out) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous() && x.size(2) % 8 == 0,
                "int4q_native::grid_scores: x must be contiguous fp32 [n, G, group], group a multiple of 8, got ",
                x.sizes());
    const int64_t n = x.size(0), groups = x.size(1), group = x.size(2);
    TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                    weights.size(0) == groups && weights.size(1) == group,
                "int4q_native::grid_scores: weights must be contiguous fp32 [", groups, ", ", group, "]");
    for (const at::Tensor *t : {&scale, &zero})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                        t->size(1) == groups,
                    "int4q_native::grid_scores: scale and zero must be contiguous fp32 [", n, ", ", groups, "]");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == n &&
                    out.size(1) == groups && out.size(2) == 4,
                "int4q_native::grid_scores: out must be contiguous fp32 [", n, ", ", groups, ", 4]");
    TORCH_CHECK(qmax > 0 && qmax < 256, "int4q_native::grid_scores: qmax in 1..255");
    const float *xp = x.data_ptr<float>(), *wp = weights.data_ptr<float>();
    const float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
    float *op = out.data_ptr<float>();
    at::parallel_for(0, n * groups, 2048, [&](int64_t first, int64_t last) {
        int4q_grid_scores(xp, wp, sp, zp, op, groups, group, first, last, qmax);
    });
}

// w bf16 [n, k] (k a multiple of group, itself of 8); codes uint8 [n, k], scale and zero bf16 [n, k / group],
// stats fp64 [n, 3] written; all contiguous. Rows are split between ATen's threads.
void rtn_minmax(const at::Tensor &w, int64_t group, bool symmetric, const at::Tensor &codes, const at::Tensor &scale,
                const at::Tensor &zero, const at::Tensor &stats) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && group > 0 &&
                    group % 8 == 0 && w.size(1) % group == 0,
                "int4q_native::rtn_minmax: w must be contiguous bf16 [n, k], k a multiple of group (a multiple of 8), "
                "got ", w.sizes(), " in groups of ", group);
    const int64_t n = w.size(0), k = w.size(1), groups = k / group;
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.sizes() == w.sizes(),
                "int4q_native::rtn_minmax: codes must be contiguous uint8 [", n, ", ", k, "]");
    for (const at::Tensor *t : {&scale, &zero})
        TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                        t->size(1) == groups,
                    "int4q_native::rtn_minmax: scale and zero must be contiguous bf16 [", n, ", ", groups, "]");
    TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.is_contiguous() && stats.dim() == 2 &&
                    stats.size(0) == n && stats.size(1) == 3,
                "int4q_native::rtn_minmax: stats must be contiguous fp64 [", n, ", 3]");
    const auto *wp = reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>());
    auto *sp = reinterpret_cast<uint16_t *>(scale.data_ptr<at::BFloat16>());
    auto *zp = reinterpret_cast<uint16_t *>(zero.data_ptr<at::BFloat16>());
    uint8_t *cp = codes.data_ptr<uint8_t>();
    double *stp = stats.data_ptr<double>();
    at::parallel_for(0, n, std::max<int64_t>(1, 65536 / std::max<int64_t>(k, 1)), [&](int64_t first, int64_t last) {
        int4q_rtn_minmax(wp, cp, sp, zp, stp, k, group, first, last, symmetric ? 1 : 0);
    });
}


void check_floats(const char *op, std::initializer_list<const at::Tensor *> tensors, at::IntArrayRef sizes) {
    for (const at::Tensor *t : tensors)
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == sizes, "int4q_native::", op,
                    ": every per-group tensor must be contiguous fp32 ", sizes);
}

void check_groups(const char *op, const at::Tensor &x, const at::Tensor &factors, int64_t qmax) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous() && x.size(2) % 8 == 0,
                "int4q_native::", op, ": x must be contiguous fp32 [n, G, group], group a multiple of 8, got ",
                x.sizes());
    TORCH_CHECK(factors.scalar_type() == at::kFloat && factors.is_contiguous() && factors.dim() == 1 &&
                    factors.numel() > 0,
                "int4q_native::", op, ": the factors must be a non-empty contiguous fp32 vector");
    TORCH_CHECK(qmax > 0 && qmax < 256, "int4q_native::", op, ": qmax in 1..255");
}

// x fp32 [n, G, group]; weights fp32 [G, group]; lo, hi, swx and scale, zero (written) fp32 [n, G]; sw fp32 [G];
// shrinks fp32 [S]. Groups are split between ATen's threads.
void shrink_search(const at::Tensor &x, const at::Tensor &weights, const at::Tensor &lo, const at::Tensor &hi,
                   const at::Tensor &sw, const at::Tensor &swx, const at::Tensor &shrinks, int64_t qmax,
                   bool symmetric, const at::Tensor &scale, const at::Tensor &zero) {
    check_groups("shrink_search", x, shrinks, qmax);
    const int64_t n = x.size(0), groups = x.size(1), group = x.size(2);
    check_floats("shrink_search", {&weights}, {groups, group});
    check_floats("shrink_search", {&sw}, {groups});
    check_floats("shrink_search", {&lo, &hi, &swx, &scale, &zero}, {n, groups});
    const float *xp = x.data_ptr<float>(), *wp = weights.data_ptr<float>(), *lp = lo.data_ptr<float>();
    const float *hp = hi.data_ptr<float>(), *swp = sw.data_ptr<float>(), *swxp = swx.data_ptr<float>();
    const float *fp = shrinks.data_ptr<float>();
    float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
    const int64_t count = shrinks.numel();
    at::parallel_for(0, n * groups, 256, [&](int64_t first, int64_t last) {
        int4q_shrink_search(xp, wp, lp, hp, swp, swxp, fp, count, groups, group, first, last, qmax, symmetric ? 1 : 0,
                            sp, zp);
    });
}

// x and weights fp32 [1, M, group]; low, span, sum_w, sum_x, sum_x2 and step, zero (written) fp32 [M]; steps fp32
// [S]. Groups are split between ATen's threads.
void stretch_search(const at::Tensor &x, const at::Tensor &weights, const at::Tensor &low, const at::Tensor &span,
                    const at::Tensor &sum_w, const at::Tensor &sum_x, const at::Tensor &sum_x2, const at::Tensor &steps,
                    int64_t qmax, const at::Tensor &step, const at::Tensor &zero) {
    check_groups("stretch_search", x, steps, qmax);
    const int64_t m = x.size(0) * x.size(1), group = x.size(2);
    check_floats("stretch_search", {&weights}, x.sizes());
    check_floats("stretch_search", {&low, &span, &sum_w, &sum_x, &sum_x2, &step, &zero}, {m});
    const float *xp = x.data_ptr<float>(), *wp = weights.data_ptr<float>(), *lp = low.data_ptr<float>();
    const float *spp = span.data_ptr<float>(), *np = sum_w.data_ptr<float>(), *sxp = sum_x.data_ptr<float>();
    const float *sxxp = sum_x2.data_ptr<float>(), *fp = steps.data_ptr<float>();
    float *stp = step.data_ptr<float>(), *zp = zero.data_ptr<float>();
    const int64_t count = steps.numel();
    at::parallel_for(0, m, 256, [&](int64_t first, int64_t last) {
        int4q_stretch_search(xp, wp, lp, spp, np, sxp, sxxp, fp, count, group, first, last, qmax, stp, zp);
    });
}

// x and weights fp32 [1, M, group]; top and scale (written) fp32 [M]; steps fp32 [S]. Groups are split between
// ATen's threads.
void signed_search(const at::Tensor &x, const at::Tensor &weights, const at::Tensor &top, const at::Tensor &steps,
                   int64_t qmax, const at::Tensor &scale) {
    check_groups("signed_search", x, steps, qmax);
    const int64_t m = x.size(0) * x.size(1), group = x.size(2);
    check_floats("signed_search", {&weights}, x.sizes());
    check_floats("signed_search", {&top, &scale}, {m});
    const float *xp = x.data_ptr<float>(), *wp = weights.data_ptr<float>(), *tp = top.data_ptr<float>();
    const float *fp = steps.data_ptr<float>();
    float *sp = scale.data_ptr<float>();
    const int64_t count = steps.numel();
    at::parallel_for(0, m, 256, [&](int64_t first, int64_t last) {
        int4q_signed_search(xp, wp, tp, fp, count, group, first, last, qmax, sp);
    });
}

// x fp32 [n, G, group]; weights fp32 [G, group]; scales, zeros and out (written) fp32 [C, n, G]. Groups are split
// between ATen's threads.
void grid_errors(const at::Tensor &x, const at::Tensor &weights, const at::Tensor &scales, const at::Tensor &zeros,
                 int64_t qmax, const at::Tensor &out) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous() && x.size(2) % 8 == 0,
                "int4q_native::grid_errors: x must be contiguous fp32 [n, G, group], group a multiple of 8, got ",
                x.sizes());
    TORCH_CHECK(qmax > 0 && qmax < 256, "int4q_native::grid_errors: qmax in 1..255");
    const int64_t n = x.size(0), groups = x.size(1), group = x.size(2), count = scales.size(0);
    check_floats("grid_errors", {&weights}, {groups, group});
    check_floats("grid_errors", {&scales, &zeros, &out}, {count, n, groups});
    const float *xp = x.data_ptr<float>(), *wp = weights.data_ptr<float>();
    const float *sp = scales.data_ptr<float>(), *zp = zeros.data_ptr<float>();
    float *op = out.data_ptr<float>();
    at::parallel_for(0, n * groups, 256, [&](int64_t first, int64_t last) {
        int4q_grid_errors(xp, wp, sp, zp, count, n * groups, groups, group, first, last, qmax, op);
    });
}

// x fp32 [M, group]; steps and lows fp64 [C, M]; out int64 [M] written. Groups are split between ATen's threads.
void first_fit(const at::Tensor &x, const at::Tensor &steps, const at::Tensor &lows, int64_t qmax, bool symmetric,
               double slack, const at::Tensor &out) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                "int4q_native::first_fit: x must be contiguous fp32 [M, group], got ", x.sizes());
    const int64_t m = x.size(0), group = x.size(1);
    for (const at::Tensor *t : {&steps, &lows})
        TORCH_CHECK(t->scalar_type() == at::kDouble && t->is_contiguous() && t->dim() == 2 && t->size(1) == m &&
                        t->sizes() == steps.sizes(),
                    "int4q_native::first_fit: steps and lows must be contiguous fp64 [C, ", m, "] of one shape");
    TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 1 && out.size(0) == m,
                "int4q_native::first_fit: out must be contiguous int64 [", m, "]");
    TORCH_CHECK(qmax > 0 && qmax < 256 && slack >= 0.0, "int4q_native::first_fit: qmax in 1..255, slack >= 0");
    const float *xp = x.data_ptr<float>();
    const double *sp = steps.data_ptr<double>(), *lp = lows.data_ptr<double>();
    int64_t *op = out.data_ptr<int64_t>();
    const int64_t count = steps.size(0);
    at::parallel_for(0, m, 256, [&](int64_t first, int64_t last) {
        int4q_first_fit(xp, sp, lp, count, m, group, first, last, qmax, symmetric ? 1 : 0, slack, op);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("grid_scores(Tensor x, Tensor weights, Tensor scale, Tensor zero, int qmax, Tensor(a!) out) -> ()");
    m.def("rtn_minmax(Tensor w, int group, bool symmetric, Tensor(a!) codes, Tensor(b!) scale, Tensor(c!) zero, "
          "Tensor(d!) stats) -> ()");
    m.def("shrink_search(Tensor x, Tensor weights, Tensor lo, Tensor hi, Tensor sw, Tensor swx, Tensor shrinks, "
          "int qmax, bool symmetric, Tensor(a!) scale, Tensor(b!) zero) -> ()");
    m.def("stretch_search(Tensor x, Tensor weights, Tensor low, Tensor span, Tensor sum_w, Tensor sum_x, "
          "Tensor sum_x2, Tensor steps, int qmax, Tensor(a!) step, Tensor(b!) zero) -> ()");
    m.def("signed_search(Tensor x, Tensor weights, Tensor top, Tensor steps, int qmax, Tensor(a!) scale) -> ()");
    m.def("grid_errors(Tensor x, Tensor weights, Tensor scales, Tensor zeros, int qmax, Tensor(a!) out) -> ()");
    m.def("first_fit(Tensor x, Tensor steps, Tensor lows, int qmax, bool symmetric, float slack, "
          "Tensor(a!) out) -> ()");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("grid_scores", grid_scores);
    m.impl("rtn_minmax", rtn_minmax);
    m.impl("shrink_search", shrink_search);
    m.impl("stretch_search", stretch_search);
    m.impl("signed_search", signed_search);
    m.impl("grid_errors", grid_errors);
    m.impl("first_fit", first_fit);
}
