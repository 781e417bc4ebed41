// The parts of a decoder layer that the decode plan (decode_plan.cpp) runs between its int8 linears, on
// raw bf16 rows: Llama's RMSNorm, a 4-bit linear's call, the rotary embedding, a layer's tensors, and
// where a row's token goes. Each rounds to bf16 where the eager step (decode/decoder.py) rounds.
#ifndef INT4Q_DECODE_PARTS_H
#define INT4Q_DECODE_PARTS_H

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "int4q.h"
#include "shared_ops.h"

namespace int4q_plan {

using Bf16 = uint16_t;

inline float widen(Bf16 h) { return int4q_bf16_to_float(h); }
inline Bf16 narrow(float f) { return int4q_float_to_bf16(f); }
inline const Bf16 *bf16_of(const at::Tensor &t) { return reinterpret_cast<const Bf16 *>(t.data_ptr()); }
inline bool given(const at::Tensor &t) { return t.defined() && t.numel() > 0; }

inline void check_bf16(const at::Tensor &t, std::vector<int64_t> sizes, const char *what) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.sizes() == at::IntArrayRef(sizes),
                "DecodePlan: ", what, " must be contiguous bf16 ", at::IntArrayRef(sizes), ", got ", t.sizes());
}

constexpr int64_t kRowsWorkPerTask = 16384;  // elements: below this a parallel region costs more than it saves
constexpr int64_t kSpanGrain = 2048;  // elements with an exponential each: about kRowsWorkPerTask of plain work

// f(r) for r in [0, rows), each row touching about `width` elements, rows split between ATen's threads where
// there is enough work for more than one.
template <class F>
void each_row(int64_t rows, int64_t width, const F &f) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kRowsWorkPerTask / std::max<int64_t>(1, width)),
                     [&](int64_t first, int64_t last) {
                         for (int64_t r = first; r < last; r++) f(r);
                     });
}

// Llama's RMSNorm: weight * bf16(x * rsqrt(mean(x^2) + eps)), x widened to fp32.
struct Norm {
    at::Tensor weight;
    float eps = 0;

    void apply(const Bf16 *x, int64_t n, Bf16 *out) const {
        thread_local std::vector<float> scratch;
        scratch.resize(n);
        for (int64_t i = 0; i < n; i++) scratch[i] = widen(x[i]);
        const float variance = int4q::sum_of_squares(scratch.data(), n) / static_cast<float>(n);
        const float inverse = 1.0f / std::sqrt(variance + eps);
        const Bf16 *w = bf16_of(weight);
        for (int64_t i = 0; i < n; i++) out[i] = narrow(widen(w[i]) * widen(narrow(scratch[i] * inverse)));
    }
};

// A 4-bit linear: out = x W^T (+ bias, a separate bf16 add), by w4a8_mm from the kernel layout (pack
// [n, k/2], sz [k/group, n, 2]) or, where `zero` is given, by w4a8_rows from the row-major tensors (pack
// [n, k/2], sz the scale [n, k/group], zero [n, k/group]).
struct Linear {
    at::Tensor pack, sz, zero, bias;
    int64_t n = 0, k = 0, group = 0;

    bool row_major() const { return given(zero); }

    void check(int64_t rows, int64_t cols, const char *what) const {
        TORCH_CHECK(pack.scalar_type() == at::kByte && pack.is_contiguous() && pack.dim() == 2 && pack.size(0) == rows &&
                        pack.size(1) * 2 == cols && group > 0 && cols % group == 0,
                    "DecodePlan: the ", what, " weight must be uint8 [", rows, ", ", cols / 2,
                    "] with a group dividing ", cols, ", got ", pack.sizes(), " and group ", group);
        if (row_major()) {
            TORCH_CHECK(int4q_w4a8_rows_available() && (group % 64 == 0 || (group == 32 && cols % 64 == 0)),
                        "DecodePlan: a row-major weight needs AVX2 and a group of 32 or a multiple of 64, got ", group);
            check_bf16(sz, {rows, cols / group}, "a row-major weight's scale");
            check_bf16(zero, {rows, cols / group}, "a row-major weight's zero");
        } else {
            TORCH_CHECK(int4q_w4a8_available() && rows % 64 == 0 && group % 4 == 0,
                        "DecodePlan: a kernel-layout weight needs AVX-512 VBMI and VNNI, whole 64-channel blocks and "
                        "a group of a multiple of 4, got ", pack.sizes(), " and group ", group);
            check_bf16(sz, {cols / group, rows, 2}, "a weight's sz");
        }
        if (given(bias)) check_bf16(bias, {rows}, "a bias");
    }

    // x [rows, k] -> out [rows, n]
    void apply(const Bf16 *x, int64_t rows, Bf16 *out) const {
        if (row_major())
            int4q::w4a8_rows_matmul(x, rows, k, pack.data_ptr<uint8_t>(), bf16_of(sz), bf16_of(zero), n, group, out);
        else
            int4q::w4a8_matmul(x, rows, k, pack.data_ptr<uint8_t>(), bf16_of(sz), n, group, out);
        if (!given(bias)) return;
        const Bf16 *b = bf16_of(bias);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) out[r * n + i] = narrow(widen(out[r * n + i]) + widen(b[i]));
    }
};

struct Layer {
    Norm input, q_norm, k_norm, post;
    Linear qkv, o, gate_up, down;
    // bf16 [sequences, kv_heads, positions, head_dim], head_dim contiguous; or an int8 cache (kv_int8_ops.cpp):
    // keys uint8 and values int8 [sequences, kv_heads, positions, head_dim], key scales fp32 [sequences,
    // kv_heads, positions, head_dim / 32] and value scales fp32 [sequences, kv_heads, positions], all contiguous
    at::Tensor keys, values, key_scales, value_scales;

    bool int8_cache() const { return given(key_scales); }

    int4q::Int8Cache int8_cache_of(int64_t sequence) const {
        return {keys.data_ptr<uint8_t>() + sequence * keys.stride(0),
                key_scales.data_ptr<float>() + sequence * key_scales.stride(0),
                values.data_ptr<int8_t>() + sequence * values.stride(0),
                value_scales.data_ptr<float>() + sequence * value_scales.stride(0), keys.stride(1),
                key_scales.stride(1), value_scales.stride(1)};
    }
};

// Where a row's token goes: its sequence's cache at its position.
struct Slot {
    int64_t sequence, position;
    bool operator<(const Slot &o) const { return std::pair{sequence, position} < std::pair{o.sequence, o.position}; }
    bool operator==(const Slot &o) const { return sequence == o.sequence && position == o.position; }
};

// x[i] = x[i] * cos[i] + rotate_half(x)[i] * sin[i] for i < rotary (each product and the sum rounded to bf16).
inline void rotate(Bf16 *x, const Bf16 *cos, const Bf16 *sin, int64_t rotary) {
    const int64_t half = rotary / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = widen(x[i]), b = widen(x[i + half]);
        const float lo = widen(narrow(a * widen(cos[i]))) + widen(narrow(-b * widen(sin[i])));
        const float hi = widen(narrow(b * widen(cos[i + half]))) + widen(narrow(a * widen(sin[i + half])));
        x[i] = narrow(lo), x[i + half] = narrow(hi);
    }
}

}  // namespace int4q_plan

#endif
