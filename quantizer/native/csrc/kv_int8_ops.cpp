// The int8 KV cache's operators of torch.ops.int4q_native (decode_attention_int8.c's layouts): store_kv_int8,
// the cache write, and attend_one_int8, one query's attention over the cache. A layer's cache is four
// tensors: keys uint8 and values int8 [1, kv_heads, positions, dim] (positions a multiple of 16, dim of 32;
// the bytes in the kernel's layouts, not in that order), key scales fp32 [1, kv_heads, positions, dim / 32]
// and value scales fp32 [1, kv_heads, positions]. The library itself is defined in int4_ops.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "int4q.h"
#include "shared_ops.h"

namespace {

constexpr int64_t kBlock = 16;  // positions of a key block

void check_cache(const at::Tensor &keys, const at::Tensor &key_scales, const at::Tensor &values,
                 const at::Tensor &value_scales, const char *op) {
    TORCH_CHECK(keys.scalar_type() == at::kByte && values.scalar_type() == at::kChar &&
                    key_scales.scalar_type() == at::kFloat && value_scales.scalar_type() == at::kFloat &&
                    keys.dim() == 4 && keys.size(0) == 1 && values.sizes() == keys.sizes() &&
                    keys.size(2) % kBlock == 0 && keys.size(3) % INT4Q_KV_KEY_DIMS == 0 && keys.size(3) > 0 &&
                    keys.is_contiguous() && values.is_contiguous() && key_scales.is_contiguous() &&
                    value_scales.is_contiguous() &&
                    key_scales.sizes() ==
                        at::IntArrayRef({1, keys.size(1), keys.size(2), keys.size(3) / INT4Q_KV_KEY_DIMS}) &&
                    value_scales.sizes() == keys.sizes().slice(0, 3),
                "int4q_native::", op, ": the cache must be contiguous keys uint8 and values int8 [1, kv_heads, "
                "positions % 16 == 0, dim % 32 == 0] with key scales fp32 [1, kv_heads, positions, dim / 32] and "
                "value scales fp32 [1, kv_heads, positions]; got ", keys.sizes(), ", ", values.sizes(), ", ",
                key_scales.sizes(), ", ", value_scales.sizes());
}

int4q::Int8Cache cache_of(const at::Tensor &keys, const at::Tensor &key_scales, const at::Tensor &values,
                          const at::Tensor &value_scales) {
    return {keys.data_ptr<uint8_t>(), key_scales.data_ptr<float>(), values.data_ptr<int8_t>(),
            value_scales.data_ptr<float>(), keys.stride(1), key_scales.stride(1), value_scales.stride(1)};
}

// k and v bf16 [1, kv_heads, T, dim] (any strides) into the cache at positions start..start + T - 1.
void store_kv_int8(const at::Tensor &k, const at::Tensor &v, const at::Tensor &keys, const at::Tensor &key_scales,
                   const at::Tensor &values, const at::Tensor &value_scales, int64_t start) {
    check_cache(keys, key_scales, values, value_scales, "store_kv_int8");
    const int64_t kv_heads = keys.size(1), dim = keys.size(3);
    TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.dim() == 4 &&
                    k.sizes() == v.sizes() && k.size(0) == 1 && k.size(1) == kv_heads && k.size(3) == dim &&
                    start >= 0 && start + k.size(2) <= keys.size(2),
                "int4q_native::store_kv_int8: k and v bf16 [1, ", kv_heads, ", T, ", dim, "] at positions ", start,
                ".. within the cache's ", keys.size(2), "; got ", k.sizes(), ", ", v.sizes());
    // [T, kv_heads, dim]: each position's rows together
    const at::Tensor kc = k[0].transpose(0, 1).contiguous(), vc = v[0].transpose(0, 1).contiguous();
    const auto *kp = reinterpret_cast<const uint16_t *>(kc.data_ptr());
    const auto *vp = reinterpret_cast<const uint16_t *>(vc.data_ptr());
    const int4q::Int8Cache cache = cache_of(keys, key_scales, values, value_scales);
    for (int64_t t = 0; t < k.size(2); t++)
        int4q::store_kv_int8(kp + t * kv_heads * dim, vp + t * kv_heads * dim, cache, kv_heads, dim, start + t);
}

// q bf16 [1, H, 1, dim] over positions [0, length) of the cache, H % kv_heads == 0 -> bf16 [1, 1, H * dim].
at::Tensor attend_one_int8(const at::Tensor &q, const at::Tensor &keys, const at::Tensor &key_scales,
                           const at::Tensor &values, const at::Tensor &value_scales, int64_t length, double scale) {
    check_cache(keys, key_scales, values, value_scales, "attend_one_int8");
    const int64_t kv_heads = keys.size(1), dim = keys.size(3);
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 &&
                    q.size(3) == dim && q.size(1) % kv_heads == 0 && 0 < length && length <= keys.size(2),
                "int4q_native::attend_one_int8: q bf16 [1, H, 1, ", dim, "] with H a multiple of ", kv_heads,
                " over 1..", keys.size(2), " positions; got ", q.sizes(), " over ", length);
    const at::Tensor qc = q.contiguous();
    at::Tensor out = at::empty({1, 1, q.size(1) * dim}, q.options());
    int4q::attend_one_int8(reinterpret_cast<const uint16_t *>(qc.data_ptr()),
                           cache_of(keys, key_scales, values, value_scales), q.size(1), kv_heads, length, dim,
                           static_cast<float>(scale), reinterpret_cast<uint16_t *>(out.data_ptr()));
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("store_kv_int8(Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) key_scales, Tensor(c!) values, "
          "Tensor(d!) value_scales, int start) -> ()");
    m.def("attend_one_int8(Tensor q, Tensor keys, Tensor key_scales, Tensor values, Tensor value_scales, int length, "
          "float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("store_kv_int8", store_kv_int8);
    m.impl("attend_one_int8", attend_one_int8);
}
