// The int8-activation operators of torch.ops.int4q_native: w4a8_mm (int4_w4a8.c, the kernel layout),
// w4a8_rows (int4_w4a8_rows.c, the row-major layout), and the activation rounding alone for tests. The library itself is defined in int4_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "int4q.h"
#include "shared_ops.h"

namespace {

constexpr int64_t kBlock = 64;     // output channels per block of the kernel layout
constexpr int64_t kRowChunk = 64;  // rows per task of w4a8_mm
constexpr int64_t kRowsPass = 4;     // output channels per pass of w4a8_rows
constexpr int64_t kChannelGrain = 64;  // output channels per task of w4a8_rows, at least

// Each row of x bf16 [M, K] rounded to int8 per group (int4_w4a8.c): xq [M, K], and per (row, group) the
// scale, the sum of xq and the fp32 sum of x, each [M, K / group_size].
void quantize_rows(const uint16_t *xs, int64_t m, int64_t k, int64_t group_size, int8_t *xq, float *xscale,
                   int32_t *xqsum, float *xsum) {
    const int64_t groups = k / group_size;
    at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; r++)
            int4q_quantize_row(xs + r * k, k, group_size, xq + r * k, xscale + r * groups, xqsum + r * groups,
                               xsum + r * groups);
    });
}

const uint16_t *bf16_data(const at::Tensor &x) { return reinterpret_cast<const uint16_t *>(x.data_ptr()); }

// Rows of x rounded as quantize_rows rounds them, in the calling thread's buffers (kept between
// calls: a decode step makes a hundred); the workers see them through these pointers (a
// thread_local named in a lambda would be the worker's own). With `split`, the codes of each row
// also as its even and odd elements, [M, K/2] each (int4_w4a8_rows.c's order).
struct RoundedRows {
    int8_t *xq, *even, *odd;
    float *xscale, *xsum;
    int32_t *xqsum;
};

RoundedRows round_rows(const uint16_t *xs, int64_t m, int64_t k, int64_t group_size, bool split) {
    const int64_t groups = k / group_size;
    thread_local std::vector<int8_t> xq_buffer, split_buffer;
    thread_local std::vector<float> xscale_buffer, xsum_buffer;
    thread_local std::vector<int32_t> xqsum_buffer;
    xq_buffer.resize(m * k), xscale_buffer.resize(m * groups), xsum_buffer.resize(m * groups);
    xqsum_buffer.resize(m * groups), split_buffer.resize(split ? m * k : 0);
    RoundedRows a{xq_buffer.data(), split_buffer.data(), split_buffer.data() + m * k / 2, xscale_buffer.data(),
                  xsum_buffer.data(), xqsum_buffer.data()};
    if (!split) {
        quantize_rows(xs, m, k, group_size, a.xq, a.xscale, a.xqsum, a.xsum);
        return a;
    }
    for (int64_t r = 0; r < m; r++)
        int4q_quantize_row_split(xs + r * k, k, group_size, a.xq + r * k, a.even + r * k / 2, a.odd + r * k / 2,
                                 a.xscale + r * groups, a.xqsum + r * groups, a.xsum + r * groups);
    return a;
}

// The activation rounding alone, for the tests: x bf16 [M, K] -> (int8 [M, K], fp32 scale [M, K/group]), as
// w4a8_mm rounds (split false) or as w4a8_rows does (split true, group_size % 32 == 0; codes in natural order).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor &x, int64_t group_size, bool split) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && group_size > 0 && x.size(1) % group_size == 0 &&
                    (!split || group_size % 32 == 0),
                "int4q_native::quantize_activations: x must be bf16 [M, K] with the group dividing K (and a multiple "
                "of 32 to split)");
    const int64_t m = x.size(0), k = x.size(1), groups = k / group_size;
    const at::Tensor xc = x.contiguous();
    at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
    at::Tensor xscale = at::empty({m, groups}, x.options().dtype(at::kFloat));
    if (!split) {
        std::vector<int32_t> xqsum(m * groups);
        std::vector<float> xsum(m * groups);
        quantize_rows(bf16_data(xc), m, k, group_size, xq.data_ptr<int8_t>(), xscale.data_ptr<float>(), xqsum.data(),
                      xsum.data());
        return {xq, xscale};
    }
    const RoundedRows a = round_rows(bf16_data(xc), m, k, group_size, true);
    int8_t *codes = xq.data_ptr<int8_t>();
    for (int64_t i = 0; i < m * k / 2; i++) codes[2 * i] = a.even[i], codes[2 * i + 1] = a.odd[i];
    std::copy(a.xscale, a.xscale + m * groups, xscale.data_ptr<float>());
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
    const int64_t m = x.size(0);
    at::Tensor out = at::empty({m, n}, x.options());
    if (m == 0) return out;
    const at::Tensor xc = x.contiguous(), packc = int4pack.contiguous(), szc = sz.contiguous();
    int4q::w4a8_matmul(bf16_data(xc), m, k, packc.data_ptr<uint8_t>(), bf16_data(szc), n, group_size,
                       reinterpret_cast<uint16_t *>(out.data_ptr()));
    return out;
}

// x bf16 [M, K] with int8 activations per group, packed uint8 [N, K/2] (row-major nibbles, low
// first), scale and zero bf16 [N, K/group] -> bf16 [M, N] (int4_w4a8_rows.c, AVX2).
at::Tensor w4a8_rows(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scale, const at::Tensor &zero,
                     int64_t group_size) {
    TORCH_CHECK(int4q_w4a8_rows_available(), "int4q_native::w4a8_rows: this CPU lacks AVX2 and FMA");
    const int64_t n = packed.size(0), k = packed.size(1) * 2;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && group_size > 0 && k % group_size == 0 &&
                    (group_size % 64 == 0 || (group_size == 32 && k % 64 == 0)),
                "int4q_native::w4a8_rows: packed must be uint8 [N, K/2] with a group of 32 (K % 64 == 0) or of a "
                "multiple of 64 dividing K");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == k,
                "int4q_native::w4a8_rows: x must be bf16 [M, ", k, "], got ", x.sizes());
    for (const at::Tensor *t : {&scale, &zero})
        TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == n &&
                        t->size(1) == k / group_size,
                    "int4q_native::w4a8_rows: scale and zero must be bf16 [", n, ", ", k / group_size, "], got ",
                    t->sizes());
    const int64_t m = x.size(0);
    at::Tensor out = at::empty({m, n}, x.options());
    if (m == 0) return out;
    const at::Tensor pc = packed.contiguous(), sc = scale.contiguous(), zc = zero.contiguous();
    const at::Tensor xc = x.contiguous();
    int4q::w4a8_rows_matmul(bf16_data(xc), m, k, pc.data_ptr<uint8_t>(), bf16_data(sc), bf16_data(zc), n, group_size,
                            reinterpret_cast<uint16_t *>(out.data_ptr()));
    return out;
}

bool w4a8_available() { return int4q_w4a8_available() != 0; }

at::Tensor w4a8_mm_meta(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &, int64_t) {
    return at::empty_symint({x.sym_size(0), int4pack.sym_size(0)}, x.options());
}

at::Tensor w4a8_rows_meta(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &, const at::Tensor &,
                          int64_t) {
    return at::empty_symint({x.sym_size(0), packed.sym_size(0)}, x.options());
}

bool w4a8_rows_available() { return int4q_w4a8_rows_available() != 0; }

}  // namespace

void int4q::w4a8_matmul(const uint16_t *x, int64_t m, int64_t k, const uint8_t *pack, const uint16_t *sz, int64_t n,
                        int64_t group_size, uint16_t *out) {
    const int64_t groups = k / group_size;
    const RoundedRows a = round_rows(x, m, k, group_size, false);
    // tasks: (block, chunk of rows), a block's chunks consecutive so that its weights stay cached
    const int64_t blocks = n / kBlock, chunks = (m + kRowChunk - 1) / kRowChunk;
    at::parallel_for(0, blocks * chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t t = first; t < last; t++) {
            const int64_t b = t / chunks, r0 = t % chunks * kRowChunk, rows = std::min(kRowChunk, m - r0);
            int4q_w4a8_blocks(a.xq + r0 * k, a.xscale + r0 * groups, a.xqsum + r0 * groups, a.xsum + r0 * groups, rows,
                              pack, sz, out + r0 * n, n, k, group_size, b, b + 1);
        }
    });
}

void int4q::w4a8_rows_matmul(const uint16_t *x, int64_t m, int64_t k, const uint8_t *packed, const uint16_t *scale,
                             const uint16_t *zero, int64_t n, int64_t group_size, uint16_t *out) {
    const RoundedRows a = round_rows(x, m, k, group_size, true);
    // units of kRowsPass channels, split evenly between the threads (64-channel pieces at least)
    const int64_t units = (n + kRowsPass - 1) / kRowsPass;
    at::parallel_for(0, units, kChannelGrain / kRowsPass, [&](int64_t first, int64_t last) {
        int4q_w4a8_rows(a.even, a.odd, a.xscale, a.xqsum, a.xsum, m, packed, scale, zero, out, n, k, group_size,
                        first * kRowsPass, std::min(last * kRowsPass, n));
    });
}

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("w4a8_mm(Tensor x, Tensor int4pack, Tensor sz, int group_size) -> Tensor");
    m.def("w4a8_available() -> bool", &w4a8_available);
    m.def("w4a8_rows(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group_size) -> Tensor");
    m.def("w4a8_rows_available() -> bool", &w4a8_rows_available);
    m.def("quantize_activations(Tensor x, int group_size, bool split=False) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("w4a8_mm", w4a8_mm);
    m.impl("w4a8_rows", w4a8_rows);
    m.impl("quantize_activations", quantize_activations);
}
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) {
    m.impl("w4a8_mm", w4a8_mm_meta);
    m.impl("w4a8_rows", w4a8_rows_meta);
}
