// The int8 decode step's attention of torch.ops.int4q_native (decode_attention.c): attend_one, one
// query over a bf16 KV cache in fp32. The library itself is defined in int4_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "int4q.h"
#include "shared_ops.h"

namespace {

constexpr int64_t kTaskProducts = 1 << 16;  // multiply-adds of a task, at least: shorter caches stay on one thread

// q bf16 [1, H, 1, D], k and v bf16 [1, Hkv, L, D] (any strides, D contiguous), H % Hkv == 0 -> bf16 [1, 1, H * D]:
// softmax(scale * q k^T) v per head in fp32, rounded once.
at::Tensor attend_one(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, double scale) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                    v.scalar_type() == at::kBFloat16 && q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                "int4q_native::attend_one: q, k and v must be bf16 [1, heads, positions, dim]");
    const int64_t heads = q.size(1), kv_heads = k.size(1), length = k.size(2), dim = q.size(3);
    TORCH_CHECK(q.size(0) == 1 && q.size(2) == 1 && k.size(0) == 1 && v.size(0) == 1 && v.size(1) == kv_heads &&
                    v.size(2) == length && k.size(3) == dim && v.size(3) == dim && kv_heads > 0 &&
                    heads % kv_heads == 0 && length > 0 && k.stride(3) == 1 && v.stride(3) == 1,
                "int4q_native::attend_one: q [1, H, 1, D] against k and v [1, Hkv, L > 0, D] with H % Hkv == 0 "
                "and D contiguous; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
    const at::Tensor qc = q.contiguous();
    at::Tensor out = at::empty({1, 1, heads * dim}, q.options());
    int4q::attend_one(reinterpret_cast<const uint16_t *>(qc.data_ptr()), reinterpret_cast<const uint16_t *>(k.data_ptr()),
                      reinterpret_cast<const uint16_t *>(v.data_ptr()), heads, kv_heads, length, dim, k.stride(1),
                      k.stride(2), v.stride(1), v.stride(2), static_cast<float>(scale),
                      reinterpret_cast<uint16_t *>(out.data_ptr()));
    return out;
}

at::Tensor attend_one_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &, double) {
    return at::empty_symint({1, 1, q.sym_size(1) * q.sym_size(3)}, q.options());
}

}  // namespace

void int4q::attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t heads, int64_t kv_heads,
                       int64_t length, int64_t dim, int64_t k_head_step, int64_t k_step, int64_t v_head_step,
                       int64_t v_step, float scale, uint16_t *out) {
    const int64_t grain = std::max<int64_t>(1, kTaskProducts / (2 * length * dim));
    at::parallel_for(0, heads, grain, [&](int64_t first, int64_t last) {
        std::vector<float> scratch(length + 2 * dim);
        int4q_attend_one(q, k, v, heads, kv_heads, length, dim, k_head_step, k_step, v_head_step, v_step, scale,
                         scratch.data(), out, first, last);
    });
}

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("attend_one(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) { m.impl("attend_one", attend_one); }
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) { m.impl("attend_one", attend_one_meta); }
