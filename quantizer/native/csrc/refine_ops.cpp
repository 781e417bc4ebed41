// Correlated rounding's coordinate descent as torch.ops.int4q_native.refine_codes (refine_codes.c).
// The library itself is defined in int4_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "int4q.h"

namespace {

// codes int16 [n, G, b] and pull fp32 [n, G, b] updated in place; step fp32 [n, G, b]; blocks fp32
// [G, b, b]; rise and fall fp32 [qmax + 1]; all contiguous. Rows are split between ATen's threads.
void refine_codes(const at::Tensor &codes, const at::Tensor &step, const at::Tensor &pull, const at::Tensor &blocks,
                  const at::Tensor &rise, const at::Tensor &fall, int64_t sweeps) {
    TORCH_CHECK(codes.scalar_type() == at::kShort && codes.dim() == 3 && codes.is_contiguous(),
                "int4q_native::refine_codes: codes must be contiguous int16 [n, G, b], got ", codes.sizes());
    for (const at::Tensor *t : {&step, &pull})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == codes.sizes(),
                    "int4q_native::refine_codes: step and pull must be contiguous fp32 ", codes.sizes());
    const int64_t n = codes.size(0), groups = codes.size(1), b = codes.size(2);
    TORCH_CHECK(blocks.scalar_type() == at::kFloat && blocks.is_contiguous() && blocks.dim() == 3 &&
                    blocks.size(0) == groups && blocks.size(1) == b && blocks.size(2) == b,
                "int4q_native::refine_codes: blocks must be contiguous fp32 [", groups, ", ", b, ", ", b, "]");
    const int64_t qmax = rise.numel() - 1;
    for (const at::Tensor *t : {&rise, &fall})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1 && t->numel() == qmax + 1,
                    "int4q_native::refine_codes: rise and fall must be contiguous fp32 of one length");
    TORCH_CHECK(qmax > 0 && qmax < 256 && sweeps >= 0, "int4q_native::refine_codes: 2..256 levels, sweeps >= 0");
    TORCH_CHECK(codes.numel() == 0 || (codes.min().item<int16_t>() >= 0 && codes.max().item<int16_t>() <= qmax),
                "int4q_native::refine_codes: codes must lie in 0..", qmax);
    auto *c = codes.data_ptr<int16_t>();
    const float *s = step.data_ptr<float>(), *h = blocks.data_ptr<float>();
    const float *up = rise.data_ptr<float>(), *down = fall.data_ptr<float>();
    float *p = pull.data_ptr<float>();
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
        int4q_refine_codes(c, s, p, h, up, down, groups, b, qmax, sweeps, r0, r1);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("refine_codes(Tensor(a!) codes, Tensor step, Tensor(b!) pull, Tensor blocks, Tensor rise, Tensor fall, "
          "int sweeps) -> ()");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) { m.impl("refine_codes", refine_codes); }
