// The grid searches' scoring of candidate grids as torch.ops.int4q_native.grid_scores (grid_scores.c), and
// round-to-nearest on bf16-stored min/max grids as torch.ops.int4q_native.rtn_minmax (rtn_minmax.c).
// The library itself is defined in int4_ops.cpp.
#include <algorithm>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("grid_scores(Tensor x, Tensor weights, Tensor scale, Tensor zero, int qmax, Tensor(a!) out) -> ()");
    m.def("rtn_minmax(Tensor w, int group, bool symmetric, Tensor(a!) codes, Tensor(b!) scale, Tensor(c!) zero, "
          "Tensor(d!) stats) -> ()");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("grid_scores", grid_scores);
    m.impl("rtn_minmax", rtn_minmax);
}
