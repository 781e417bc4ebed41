// The int8-activation operators of torch.ops.int4q_native (int4_w4a8.c): w4a8_mm, and the activation
// rounding alone for its tests. The library itself is defined in int4_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "int4q.h"

namespace {

constexpr int64_t kBlock = 64;     // output channels per block of the kernel layout
constexpr int64_t kRowChunk = 64;  // rows per task of w4a8_mm

// Each row of x bf16 [M, K] rounded to int8 per group (int4_w4a8.c): xq [M, K], and per (row, group) the
// scale, the sum of xq and the fp32 sum of x, each [M, K / group_size].
void quantize_rows(const at::Tensor &x, int64_t group_size, int8_t *xq, float *xscale, int32_t *xqsum, float *xsum) {
    const at::Tensor xc = x.contiguous();
    const int64_t m = x.size(0), k = x.size(1), groups = k / group_size;
    const auto *xs = reinterpret_cast<const uint16_t *>(xc.data_ptr());
    at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; r++)
            int4q_quantize_row(xs + r * k, k, group_size, xq + r * k, xscale + r * groups, xqsum + r * groups,
                               xsum + r * groups);
    });
}

// The activation rounding of w4a8_mm alone, for its tests: x bf16 [M, K] -> (int8 [M, K], fp32 scale [M, K/group]).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor &x, int64_t group_size) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && group_size > 0 && x.size(1) % group_size == 0,
                "int4q_native::quantize_activations: x must be bf16 [M, K] with the group dividing K");
    const int64_t m = x.size(0), groups = x.size(1) / group_size;
    at::Tensor xq = at::empty({m, x.size(1)}, x.options().dtype(at::kChar));
    at::Tensor xscale = at::empty({m, groups}, x.options().dtype(at::kFloat));
    std::vector<int32_t> xqsum(m * groups);
    std::vector<float> xsum(m * groups);
    quantize_rows(x, group_size, xq.data_ptr<int8_t>(), xscale.data_ptr<float>(), xqsum.data(), xsum.data());
    return {xq, xscale};
}

// x bf16 [M, K] with int8 activations per group (int4_w4a8.c), int4pack and sz as gemv's -> bf16 [M, N].
at::Tensor w4a8_mm(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &sz, int64_t group_size) {
    TORCH_CHECK(int4q_w4a8_available(), "int4q_native::w4a8_mm: this CPU lacks AVX-512 VBMI and VNNI");
    const int64_t n = int4pack.size(0), k = int4pack.size(1) * 2;
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == k,
                "int4q_native::w4a8_mm: x must be bf16 [M, ", k, "], got ", x.sizes());
    TORCH_CHECK(int4pack.scalar_type() == at::kByte && n % kBlock == 0 && group_size > 0 && group_size % 4 == 0 &&
                    k % group_size == 0,
                "int4q_native::w4a8_mm: weight must be uint8 [N, K/2] with N % 64 == 0 and a group of 4s dividing K");
    TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == k / group_size &&
                    sz.size(1) == n && sz.size(2) == 2,
                "int4q_native::w4a8_mm: sz must be bf16 [K/group, N, 2], got ", sz.sizes());
    const int64_t m = x.size(0), groups = k / group_size;
    at::Tensor out = at::empty({m, n}, x.options());
    if (m == 0) return out;
    const at::Tensor packc = int4pack.contiguous(), szc = sz.contiguous();
    // the calling thread's buffers, kept between calls (a decode step makes a hundred); the workers
    // see them through these pointers (a thread_local named in the lambda would be the worker's own)
    thread_local std::vector<int8_t> xq_buffer;
    thread_local std::vector<float> xscale_buffer, xsum_buffer;
    thread_local std::vector<int32_t> xqsum_buffer;
    xq_buffer.resize(m * k), xscale_buffer.resize(m * groups), xsum_buffer.resize(m * groups);
    xqsum_buffer.resize(m * groups);
    int8_t *xq = xq_buffer.data();
    float *xscale = xscale_buffer.data(), *xsum = xsum_buffer.data();
    int32_t *xqsum = xqsum_buffer.data();
    quantize_rows(x, group_size, xq, xscale, xqsum, xsum);
    const uint8_t *pack = packc.data_ptr<uint8_t>();
    const auto *params = reinterpret_cast<const uint16_t *>(szc.data_ptr());
    auto *dst = reinterpret_cast<uint16_t *>(out.data_ptr());
    // tasks: (block, chunk of rows), a block's chunks consecutive so that its weights stay cached
    const int64_t blocks = n / kBlock, chunks = (m + kRowChunk - 1) / kRowChunk;
    at::parallel_for(0, blocks * chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t t = first; t < last; t++) {
            const int64_t b = t / chunks, r0 = t % chunks * kRowChunk, rows = std::min(kRowChunk, m - r0);
            int4q_w4a8_blocks(xq + r0 * k, xscale + r0 * groups, xqsum + r0 * groups, xsum + r0 * groups, rows, pack,
                              params, dst + r0 * n, n, k, group_size, b, b + 1);
        }
    });
    return out;
}

bool w4a8_available() { return int4q_w4a8_available() != 0; }

at::Tensor w4a8_mm_meta(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &, int64_t) {
    return at::empty_symint({x.sym_size(0), int4pack.sym_size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("w4a8_mm(Tensor x, Tensor int4pack, Tensor sz, int group_size) -> Tensor");
    m.def("w4a8_available() -> bool", &w4a8_available);
    m.def("quantize_activations(Tensor x, int group_size) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("w4a8_mm", w4a8_mm);
    m.impl("quantize_activations", quantize_activations);
}
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) { m.impl("w4a8_mm", w4a8_mm_meta); }
