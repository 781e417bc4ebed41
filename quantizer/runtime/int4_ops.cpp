// The decode step's operators: the GEMV of int4_gemv.c as torch.ops.int4q_native.gemv, so that a
// compiled decode step calls it from C++ like any ATen kernel (a Python operator would cost more
// per call than the kernel saves), and mean_square (below). Built on first use by
// quantizer/runtime/gemv.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
void int4q_gemv_int4pack(const uint16_t *x, const uint8_t *pack, const uint16_t *sz, uint16_t *out, int64_t n,
                         int64_t k, int64_t group_size, int threads);
int int4q_gemv_available(void);
}

namespace {

// x bf16 [1, K], int4pack uint8 [N, K/2] in the tinygemm layout, sz bf16 [K/group, N, 2] -> bf16 [1, N].
at::Tensor gemv(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &sz, int64_t group_size) {
    TORCH_CHECK(int4q_gemv_available(), "int4q_native::gemv: built without the AVX-512 VBMI + BF16 kernel");
    const int64_t n = int4pack.size(0), k = int4pack.size(1) * 2;
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1 && x.size(1) == k,
                "int4q_native::gemv: x must be bf16 [1, ", k, "], got ", x.sizes());
    TORCH_CHECK(int4pack.scalar_type() == at::kByte && n % 64 == 0 && group_size > 0 && group_size % 2 == 0 &&
                    k % group_size == 0,
                "int4q_native::gemv: weight must be uint8 [N, K/2] with N % 64 == 0 and an even group dividing K");
    TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == k / group_size &&
                    sz.size(1) == n && sz.size(2) == 2,
                "int4q_native::gemv: sz must be bf16 [K/group, N, 2], got ", sz.sizes());
    const at::Tensor xc = x.contiguous(), packc = int4pack.contiguous(), szc = sz.contiguous();
    at::Tensor out = at::empty({1, n}, x.options());
    int4q_gemv_int4pack(reinterpret_cast<const uint16_t *>(xc.data_ptr()), packc.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t *>(szc.data_ptr()), reinterpret_cast<uint16_t *>(out.data_ptr()),
                        n, k, group_size, at::get_num_threads());
    return out;
}

// The mean of squares over the last dimension with keepdim: RMSNorm's variance, computed by the
// same ATen kernels eager uses, so a compiled step sums in eager's order.
at::Tensor mean_square(const at::Tensor &x) { return x.pow(2).mean(-1, true); }

at::Tensor mean_square_meta(const at::Tensor &x) {
    auto sizes = x.sym_sizes().vec();
    sizes.back() = 1;
    return at::empty_symint(sizes, x.options());
}

at::Tensor gemv_meta(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &, int64_t) {
    return at::empty_symint({x.sym_size(0), int4pack.sym_size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY(int4q_native, m) {
    m.def("gemv(Tensor x, Tensor int4pack, Tensor sz, int group_size) -> Tensor");
    m.def("mean_square(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("gemv", gemv);
    m.impl("mean_square", mean_square);
}
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) {
    m.impl("gemv", gemv_meta);
    m.impl("mean_square", mean_square_meta);
}
