// The row-major decode operator of torch.ops.int4q_native (int4_gemv_rows.c): gemv_rows, for CPUs
// whose tinygemm layout int4q does not decode. The library itself is defined in int4_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "int4q.h"

namespace {

constexpr int64_t kChannelChunk = 64;  // output channels per task

// x bf16 [1, K], packed uint8 [N, K/2] (row-major nibbles, low first), scale and zero bf16 [N, K/group]
// -> bf16 [1, N].
at::Tensor gemv_rows(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scale, const at::Tensor &zero,
                     int64_t group_size) {
    const int64_t n = packed.size(0), k = packed.size(1) * 2;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && group_size > 0 && group_size % 16 == 0 &&
                    k % group_size == 0,
                "int4q_native::gemv_rows: packed must be uint8 [N, K/2] with a group dividing K, a multiple of 16");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1 && x.size(1) == k,
                "int4q_native::gemv_rows: x must be bf16 [1, ", k, "], got ", x.sizes());
    for (const at::Tensor *t : {&scale, &zero})
        TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == n &&
                        t->size(1) == k / group_size,
                    "int4q_native::gemv_rows: scale and zero must be bf16 [", n, ", ", k / group_size, "], got ",
                    t->sizes());
    const at::Tensor xc = x.contiguous(), pc = packed.contiguous(), sc = scale.contiguous(), zc = zero.contiguous();
    std::vector<float> xe(k / 2), xo(k / 2), xsum(k / group_size);
    int4q_split_row(reinterpret_cast<const uint16_t *>(xc.data_ptr()), k, group_size, xe.data(), xo.data(),
                    xsum.data());
    at::Tensor out = at::empty({1, n}, x.options());
    const uint8_t *weights = pc.data_ptr<uint8_t>();
    const auto *s = reinterpret_cast<const uint16_t *>(sc.data_ptr());
    const auto *z = reinterpret_cast<const uint16_t *>(zc.data_ptr());
    auto *dst = reinterpret_cast<uint16_t *>(out.data_ptr());
    at::parallel_for(0, (n + kChannelChunk - 1) / kChannelChunk, 1, [&](int64_t first, int64_t last) {
        int4q_gemv_rows(xe.data(), xo.data(), xsum.data(), weights, s, z, dst, k, group_size, first * kChannelChunk,
                        std::min(last * kChannelChunk, n));
    });
    return out;
}

at::Tensor gemv_rows_meta(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &, const at::Tensor &,
                          int64_t) {
    return at::empty_symint({x.sym_size(0), packed.sym_size(0)}, x.options());
}

// The path gemv_rows takes here: 1 AVX2 and FMA, 0 plain C (see int4q.h's limit on the level).
int64_t gemv_rows_level() { return int4q_gemv_rows_level(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("gemv_rows(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group_size) -> Tensor");
    m.def("gemv_rows_level() -> int", &gemv_rows_level);
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) { m.impl("gemv_rows", gemv_rows); }
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) { m.impl("gemv_rows", gemv_rows_meta); }
