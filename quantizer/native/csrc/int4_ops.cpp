// int4q's operators, torch.ops.int4q_native (the int8-activation ones are in w4a8_ops.cpp): the
// decode GEMV of int4_gemv.c (a compiled decode step calls it from C++ like any ATen kernel; a
// Python operator would cost more per call than the kernel saves), the prefill dequantization of
// int4_dequant.c, mean_square (below), and the vector path they run. Built when int4q is installed
// (setup.py), or on first use from a source checkout (quantizer/native/build.py); threads
// come from ATen's pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "int4q.h"
#include "shared_ops.h"


#ifndef INT4Q_SOURCE_DIGEST
#error "build with -DINT4Q_SOURCE_DIGEST=\"<sha256 of csrc/>\" (quantizer/native/build.py)"
#endif

namespace {
std::atomic<int> max_level{INT4Q_AVX512_BF16};
}  // namespace

extern "C" int int4q_max_level(void) { return max_level.load(); }

namespace {

constexpr int64_t kBlock = 64;  // output channels per block of the kernel layout

// x bf16 [M, K], int4pack uint8 [N, K/2] in the tinygemm layout, sz bf16 [K/group, N, 2] -> bf16 [M, N], each
// row as it would be alone.
at::Tensor gemv(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &sz, int64_t group_size) {
    TORCH_CHECK(int4q_gemv_available(), "int4q_native::gemv: this CPU lacks AVX-512 VBMI and BF16");
    const int64_t n = int4pack.size(0), k = int4pack.size(1) * 2;
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) > 0 && x.size(1) == k,
                "int4q_native::gemv: x must be bf16 [M, ", k, "], got ", x.sizes());
    TORCH_CHECK(int4pack.scalar_type() == at::kByte && n % 64 == 0 && group_size > 0 && group_size % 2 == 0 &&
                    k % group_size == 0,
                "int4q_native::gemv: weight must be uint8 [N, K/2] with N % 64 == 0 and an even group dividing K");
    TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == k / group_size &&
                    sz.size(1) == n && sz.size(2) == 2,
                "int4q_native::gemv: sz must be bf16 [K/group, N, 2], got ", sz.sizes());
    const at::Tensor xc = x.contiguous(), packc = int4pack.contiguous(), szc = sz.contiguous();
    const int64_t rows = x.size(0), groups = k / group_size;
    at::Tensor out = at::empty({rows, n}, x.options());
    const auto *xs = reinterpret_cast<const uint16_t *>(xc.data_ptr());
    std::vector<float> xsum(rows * groups);
    for (int64_t r = 0; r < rows; r++) int4q_group_sums(xs + r * k, k, group_size, xsum.data() + r * groups);
    const uint8_t *pack = packc.data_ptr<uint8_t>();
    const auto *params = reinterpret_cast<const uint16_t *>(szc.data_ptr());
    auto *dst = reinterpret_cast<uint16_t *>(out.data_ptr());
    at::parallel_for(0, n / kBlock, 1, [&](int64_t first, int64_t last) {
        int4q_gemv_blocks(xs, xsum.data(), pack, params, dst, rows, n, k, group_size, first, last);
    });
    return out;
}

// int4pack uint8 [N, K/2] (N % 64 == 0), sz bf16 [K/group, N, 2] -> out, contiguous bf16 [N, K].
void dequant_int4pack(const at::Tensor &int4pack, const at::Tensor &sz, int64_t group_size, const at::Tensor &out) {
    const int64_t n = int4pack.size(0), k = int4pack.size(1) * 2;
    TORCH_CHECK(int4pack.scalar_type() == at::kByte && int4pack.dim() == 2 && n % kBlock == 0 && n > 0 &&
                    group_size > 0 && k % group_size == 0,
                "int4q_native::dequant_int4pack: weight must be uint8 [N, K/2] with N % 64 == 0 and a group dividing K");
    TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == k / group_size &&
                    sz.size(1) == n && sz.size(2) == 2,
                "int4q_native::dequant_int4pack: sz must be bf16 [K/group, N, 2], got ", sz.sizes());
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                    out.size(1) == k,
                "int4q_native::dequant_int4pack: out must be contiguous bf16 [", n, ", ", k, "]");
    const at::Tensor packc = int4pack.contiguous(), szc = sz.contiguous();
    const uint8_t *pack = packc.data_ptr<uint8_t>();
    const auto *params = reinterpret_cast<const uint16_t *>(szc.data_ptr());
    auto *dst = reinterpret_cast<uint16_t *>(out.data_ptr());
    const int level = int4q_dequant_level();
    at::parallel_for(0, n / kBlock * (k / group_size), 1, [&](int64_t first, int64_t last) {
        int4q_dequant_int4pack(pack, params, dst, n, k, group_size, first, last, level);
    });
}

// The dequantization's vector path on this CPU (see int4q.h).
int64_t dequant_level() { return int4q_dequant_level(); }

bool gemv_available() { return int4q_gemv_available() != 0; }

// How many of ATen's threads a parallel_for over `tasks` tasks ran on (1 in a build whose
// parallel_for is not OpenMP's, see build.py).
int64_t parallel_threads(int64_t tasks) {
    std::atomic<uint64_t> seen{0};
    at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
    return __builtin_popcountll(seen.load());
}

// sha256 of the sources this library was built from (see build.py).
std::string source_digest() { return INT4Q_SOURCE_DIGEST; }

// Lower (or restore) the highest vector path the kernels take; returns the previous limit.
int64_t limit_level(int64_t level) {
    return max_level.exchange(static_cast<int>(std::clamp<int64_t>(level, INT4Q_PORTABLE, INT4Q_AVX512_BF16)));
}

// Sums of squares in the order of ATen's CPU sum kernel (SumKernel.cpp) over a contiguous fp32 row:
// 8-lane vectors, 4 interleaved accumulators, cascaded levels, then the leftover vectors, the
// accumulators, the leftover elements and the lanes, in that order. Built with -ffp-contract=off,
// so each square is rounded before it is added, as pow(2) then sum rounds it.
constexpr int kLanes = 8, kIlp = 4, kLevels = 4;
using Lanes = std::array<float, kLanes>;
bool own_mean_square = true;  // switched off where the result is not eager's bit for bit (see gemv.py)

void add_squares(Lanes &acc, const float *x) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[l] * x[l];
}

void add_lanes(Lanes &acc, const Lanes &more) {
    for (int l = 0; l < kLanes; ++l) acc[l] += more[l];
}

int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// The mean of squares over the last dimension with keepdim: RMSNorm's variance, summed in eager's
// order so that a compiled step rounds it as eager does. Without ATen's per-call set-up (about
// 15 us for pow and mean at decode's sizes) where its order is reproduced, else by ATen itself.
at::Tensor mean_square(const at::Tensor &x) {
    // Rows shorter than one vector take another order in ATen (widths 5 to 7 differ): its own ops.
    if (!own_mean_square || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() == 0 || x.size(-1) < kLanes)
        return x.pow(2).mean(-1, true);
    auto sizes = x.sizes().vec();
    sizes.back() = 1;
    at::Tensor out = at::empty(sizes, x.options());
    const int64_t n = x.size(-1), rows = x.numel() / n;
    const float *in = x.data_ptr<float>();
    float *result = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) result[r] = int4q::sum_of_squares(in + r * n, n) / static_cast<float>(n);
    return out;
}

at::Tensor mean_square_meta(const at::Tensor &x) {
    auto sizes = x.sym_sizes().vec();
    sizes.back() = 1;
    return at::empty_symint(sizes, x.options());
}

// Whether mean_square uses its own summation (true) or ATen's operators; returns the previous choice.
bool use_own_mean_square(bool on) {
    const bool previous = own_mean_square;
    own_mean_square = on;
    return previous;
}

// The t-th of the panels [0, panels) in an order that alternates between their two ends: panel q
// holds the tiles of its 48 (q + 1) rows on and above the diagonal, so each contiguous share of
// this order holds about as many tiles as the others.
static int64_t balanced_panel(int64_t t, int64_t panels) { return t % 2 == 0 ? t / 2 : panels - 1 - t / 2; }

// x bf16 [m, k] as gram_bf16.c's row pairs: panel q's words for pair p at
// pairs[q * panel_words + p * 48 + column - 48 q], zeros where a column or a row is beyond x.
static void pack_pairs(const uint16_t *xs, int64_t m, int64_t k, int64_t panel_words, uint32_t *pairs) {
    at::parallel_for(0, (m + 1) / 2, 16, [&](int64_t first, int64_t last) {
        for (int64_t p = first; p < last; p++) {
            const uint16_t *low = xs + 2 * p * k, *high = 2 * p + 1 < m ? low + k : nullptr;
            for (int64_t j0 = 0; j0 < k; j0 += INT4Q_GRAM_PANEL) {
                uint32_t *out = pairs + j0 / INT4Q_GRAM_PANEL * panel_words + p * INT4Q_GRAM_PANEL;
                const int64_t n = std::min<int64_t>(INT4Q_GRAM_PANEL, k - j0);
                if (high != nullptr)
                    for (int64_t j = 0; j < n; j++) out[j] = low[j0 + j] | uint32_t(high[j0 + j]) << 16;
                else
                    for (int64_t j = 0; j < n; j++) out[j] = low[j0 + j];
                for (int64_t j = n; j < INT4Q_GRAM_PANEL; j++) out[j] = 0;
            }
        }
    });
}

// c fp32 [K, K] contiguous, x bf16 [M, K]: c = beta * c + alpha * x^T x on and above the diagonal
// (gram_bf16.c); entries below it are left stale, for the caller to mirror from above.
void gram_bf16(const at::Tensor &c, const at::Tensor &x, double alpha, double beta) {
    TORCH_CHECK(int4q_gram_available(), "int4q_native::gram_bf16: this CPU lacks AVX-512 BF16");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) > 0,
                "int4q_native::gram_bf16: x must be bf16 [M, K] with M > 0, got ", x.sizes());
    const int64_t m = x.size(0), k = x.size(1);
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.dim() == 2 && c.size(0) == k &&
                    c.size(1) == k,
                "int4q_native::gram_bf16: c must be contiguous fp32 [", k, ", ", k, "]");
    const at::Tensor xc = x.contiguous();
    const int64_t npairs = (m + 1) / 2, panels = (k + INT4Q_GRAM_PANEL - 1) / INT4Q_GRAM_PANEL;
    const int64_t panel_words = npairs * INT4Q_GRAM_PANEL;
    // ATen's allocation is 64-byte aligned, so each pair's 48 words of a panel are three whole cache lines
    const at::Tensor pair_words = at::empty({panels * panel_words}, at::kInt);
    auto *pairs = reinterpret_cast<uint32_t *>(pair_words.data_ptr<int32_t>());
    pack_pairs(reinterpret_cast<const uint16_t *>(xc.data_ptr()), m, k, panel_words, pairs);
    float *dst = c.data_ptr<float>();
    // each thread owns its share of the panels (columns of c), so no thread waits on another
    at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
        for (int64_t p0 = 0; p0 < npairs; p0 += INT4Q_GRAM_PAIRS) {
            const int64_t p1 = std::min(p0 + INT4Q_GRAM_PAIRS, npairs);
            const float scale_old = p0 == 0 ? (float)beta : 1.0f;
            for (int64_t i0 = 0; i0 < k; i0 += INT4Q_GRAM_ROWS)
                for (int64_t t = first; t < last; t++)
                    int4q_gram_block(pairs, p0, p1, panel_words, dst, k, (float)alpha, scale_old, i0,
                                     i0 + INT4Q_GRAM_ROWS, balanced_panel(t, panels));
        }
    });
}

bool gram_available() { return int4q_gram_available() != 0; }

// GPTQ's column loop over columns [first, last) of one block (gptq_columns.c): w, scale, zero, safe,
// codes, err fp32 [b, N] and flat bool [b, N], contiguous; u fp32 [b, b] contiguous; codes 0..qmax
// (2^bits - 1). w, codes and err are written in place; the rows are split between ATen's threads.
void gptq_columns(const at::Tensor &w, const at::Tensor &u, const at::Tensor &scale, const at::Tensor &zero,
                  const at::Tensor &safe, const at::Tensor &flat, const at::Tensor &codes, const at::Tensor &err,
                  int64_t first, int64_t last, int64_t qmax) {
    TORCH_CHECK(w.dim() == 2, "int4q_native::gptq_columns: w must be fp32 [b, N], got ", w.sizes());
    const int64_t b = w.size(0), n = w.size(1);
    for (const at::Tensor *t : {&w, &scale, &zero, &safe, &codes, &err})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == w.sizes(),
                    "int4q_native::gptq_columns: w, scale, zero, safe, codes and err must be contiguous fp32 [",
                    b, ", ", n, "]");
    TORCH_CHECK(flat.scalar_type() == at::kBool && flat.is_contiguous() && flat.sizes() == w.sizes(),
                "int4q_native::gptq_columns: flat must be contiguous bool [", b, ", ", n, "]");
    TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.dim() == 2 && u.size(0) == b &&
                    u.size(1) == b,
                "int4q_native::gptq_columns: u must be contiguous fp32 [", b, ", ", b, "]");
    TORCH_CHECK(0 <= first && first <= last && last <= b, "int4q_native::gptq_columns: columns [", first, ", ",
                last, ") outside the block of ", b);
    TORCH_CHECK(qmax == 15 || qmax == 31 || qmax == 63, "int4q_native::gptq_columns: qmax must be 15, 31 or 63, got ",
                qmax);
    float *pw = w.data_ptr<float>(), *pc = codes.data_ptr<float>(), *pe = err.data_ptr<float>();
    const float *pu = u.data_ptr<float>(), *ps = scale.data_ptr<float>(), *pz = zero.data_ptr<float>(),
                *pf = safe.data_ptr<float>();
    const auto *pflat = reinterpret_cast<const uint8_t *>(flat.data_ptr<bool>());
    at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
        int4q_gptq_columns(pw, pu, b, ps, pz, pf, pflat, pc, pe, n, first, last, r0, r1, qmax);
    });
}

at::Tensor gemv_meta(const at::Tensor &x, const at::Tensor &int4pack, const at::Tensor &, int64_t) {
    return at::empty_symint({x.sym_size(0), int4pack.sym_size(0)}, x.options());
}

}  // namespace

float int4q::sum_of_squares(const float *x, int64_t n) {
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

TORCH_LIBRARY(int4q_native, m) {
    m.def("gemv(Tensor x, Tensor int4pack, Tensor sz, int group_size) -> Tensor");
    m.def("mean_square(Tensor x) -> Tensor");
    m.def("dequant_int4pack(Tensor int4pack, Tensor sz, int group_size, Tensor(a!) out) -> ()");
    m.def("gram_bf16(Tensor(a!) c, Tensor x, float alpha, float beta) -> ()");
    m.def("gram_available() -> bool", &gram_available);
    m.def("gptq_columns(Tensor(a!) w, Tensor u, Tensor scale, Tensor zero, Tensor safe, Tensor flat, Tensor(b!) codes, "
          "Tensor(c!) err, int first, int last, int qmax) -> ()");
    m.def("dequant_level() -> int", &dequant_level);
    m.def("gemv_available() -> bool", &gemv_available);
    m.def("parallel_threads(int tasks) -> int", &parallel_threads);
    m.def("limit_level(int level) -> int", &limit_level);
    m.def("use_own_mean_square(bool on) -> bool", &use_own_mean_square);
    m.def("source_digest() -> str", &source_digest);
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("gemv", gemv);
    m.impl("mean_square", mean_square);
    m.impl("dequant_int4pack", dequant_int4pack);
    m.impl("gram_bf16", gram_bf16);
    m.impl("gptq_columns", gptq_columns);
}
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) {
    m.impl("gemv", gemv_meta);
    m.impl("mean_square", mean_square_meta);
}
