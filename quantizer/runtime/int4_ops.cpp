// The decode step's operators: the GEMV of int4_gemv.c as torch.ops.int4q_native.gemv, so that a
// compiled decode step calls it from C++ like any ATen kernel (a Python operator would cost more
// per call than the kernel saves), and mean_square (below). Built on first use by
// quantizer/runtime/gemv.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>

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

// Sums of squares in the order of ATen's CPU sum kernel (SumKernel.cpp) over a contiguous fp32 row:
// 8-lane vectors, 4 interleaved accumulators, cascaded levels, then the leftover vectors, the
// accumulators, the leftover elements and the lanes, in that order. Built with -ffp-contract=off,
// so each square is rounded before it is added, as pow(2) then sum rounds it.
constexpr int kLanes = 8, kIlp = 4, kLevels = 4;
using Lanes = std::array<float, kLanes>;
bool own_mean_square = true;  // switched off by gemv.py where the result is not eager's bit for bit

void add_squares(Lanes &acc, const float *x) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[l] * x[l];
}

void add_lanes(Lanes &acc, const Lanes &more) {
    for (int l = 0; l < kLanes; ++l) acc[l] += more[l];
}

int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

float sum_of_squares(const float *x, int64_t n) {
    const int64_t vectors = n / kLanes, size = vectors / kIlp;
    const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels), step = int64_t(1) << power;
    Lanes acc[kLevels][kIlp] = {};
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < kIlp; ++k) add_squares(acc[0][k], x + (i * kIlp + k) * kLanes);
        for (int level = 1; level < kLevels; ++level) {
            for (int k = 0; k < kIlp; ++k) {
                add_lanes(acc[level][k], acc[level - 1][k]);
                acc[level - 1][k] = Lanes{};
            }
            if ((i & ((step - 1) << (level * power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < kIlp; ++k) add_squares(acc[0][k], x + (i * kIlp + k) * kLanes);
    for (int level = 1; level < kLevels; ++level)
        for (int k = 0; k < kIlp; ++k) add_lanes(acc[0][k], acc[level][k]);
    for (int64_t v = size * kIlp; v < vectors; ++v) add_squares(acc[0][0], x + v * kLanes);
    for (int k = 1; k < kIlp; ++k) add_lanes(acc[0][0], acc[0][k]);
    float sum = 0;
    for (int64_t e = vectors * kLanes; e < n; ++e) sum += x[e] * x[e];
    for (int l = 0; l < kLanes; ++l) sum += acc[0][0][l];
    return sum;
}

// The mean of squares over the last dimension with keepdim: RMSNorm's variance, summed in eager's
// order so that a compiled step rounds it as eager does. Without ATen's per-call set-up (about
// 15 us for pow and mean at decode's sizes) where its order is reproduced, else by ATen itself.
at::Tensor mean_square(const at::Tensor &x) {
    if (!own_mean_square || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() == 0 || x.size(-1) == 0)
        return x.pow(2).mean(-1, true);
    auto sizes = x.sizes().vec();
    sizes.back() = 1;
    at::Tensor out = at::empty(sizes, x.options());
    const int64_t n = x.size(-1), rows = x.numel() / n;
    const float *in = x.data_ptr<float>();
    float *result = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) result[r] = sum_of_squares(in + r * n, n) / static_cast<float>(n);
    return out;
}

at::Tensor mean_square_meta(const at::Tensor &x) {
    auto sizes = x.sym_sizes().vec();
    sizes.back() = 1;
    return at::empty_symint(sizes, x.options());
}

at::Tensor gemv_meta(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &, int64_t) {
    return at::empty_symint({x.sym_size(0), int4pack.sym_size(0)}, x.options());
}

}  // namespace

// Whether mean_square uses its own summation (1) or ATen's operators (0); returns the previous choice.
extern "C" int int4q_own_mean_square(int on) {
    const bool previous = own_mean_square;
    own_mean_square = on != 0;
    return previous;
}

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
