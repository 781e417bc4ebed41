// torch.classes.int4q_native.DecodePlan: the steps of a Llama-shaped decoder stack with int8 activations
// in one call each, for one token or a few (decode/native_step.py builds it from the model). Per layer: RMSNorm,
// the fused q/k/v linear (+ bias), the optional q/k RMSNorms per head, the rotary embedding, the KV
// cache write, attend_one, the output linear and residual, RMSNorm, the fused gate/up linear, SiLU(gate)
// times up, the down linear and residual; then the final RMSNorm. The KV cache is bf16, or int8
// (kv_int8_ops.cpp's, attended by attend_one_int8). Each bf16 intermediate is rounded
// where the eager step (decode/decoder.py with int8 decode) rounds it; the linears are w4a8_mm (the kernel
// layout) or w4a8_rows (row-major) and the attention attend_one themselves. T tokens in one call give the
// last one's output of T calls of one token, bit for bit: each row's arithmetic is the same (the int8
// kernels' rows are independent), and the query of token t attends over the cache up to t. The caches hold
// several sequences ([sequences, kv_heads, positions, head_dim]); `rows` takes each row's sequence and
// position, so one call can also advance many sequences a token each (batched decode), each row's output
// that of its sequence decoded alone. A plan serves one thread at a time (its buffers are its own).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "decode_parts.h"
#include "int4q.h"
#include "shared_ops.h"

namespace {

using namespace int4q_plan;

class DecodePlan : public torch::CustomClassHolder {
  public:
    // heads, kv_heads, head_dim and hidden size; attention scale; cos and sin bf16 [1, positions, rotary]; the
    // final norm's weight bf16 [hidden] and epsilon.
    DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, double scale, at::Tensor cos,
               at::Tensor sin, at::Tensor norm_weight, double norm_eps)
        : heads_(heads), kv_heads_(kv_heads), dim_(head_dim), hidden_(hidden), scale_(static_cast<float>(scale)),
          cos_(std::move(cos)), sin_(std::move(sin)), final_{std::move(norm_weight), static_cast<float>(norm_eps)} {
        TORCH_CHECK(int4q_w4a8_available() || int4q_w4a8_rows_available(),
                    "DecodePlan: this CPU has neither int8 kernel (AVX-512 VBMI and VNNI, or AVX2)");
        TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && hidden > 0,
                    "DecodePlan: heads must be a positive multiple of kv_heads");
        TORCH_CHECK(cos_.dim() == 3 && cos_.size(2) % 2 == 0 && cos_.size(2) <= head_dim,
                    "DecodePlan: cos must be [1, positions, rotary] with an even rotary <= head_dim");
        positions_ = cos_.size(1), rotary_ = cos_.size(2);
        check_bf16(cos_, {1, positions_, rotary_}, "cos");
        check_bf16(sin_, {1, positions_, rotary_}, "sin");
        check_bf16(final_.weight, {hidden}, "the final norm's weight");
    }

    // tensors: input norm, q norm, k norm, post-attention norm weights; (pack, sz, zero, bias) of qkv, o,
    // gate_up and down (see Linear); keys, values, or for an int8 cache keys, key scales, values, value scales
    // (see Layer). An absent norm, zero or bias is an empty tensor. eps: the four norms'; groups: the four
    // linears' group sizes.
    void add_layer(std::vector<at::Tensor> tensors, std::vector<double> eps, std::vector<int64_t> groups) {
        TORCH_CHECK((tensors.size() == 22 || tensors.size() == 24) && eps.size() == 4 && groups.size() == 4,
                    "DecodePlan.add_layer: 22 tensors (24 with an int8 cache), 4 epsilons and 4 group sizes");
        Layer l;
        l.input = {tensors[0], static_cast<float>(eps[0])}, l.q_norm = {tensors[1], static_cast<float>(eps[1])};
        l.k_norm = {tensors[2], static_cast<float>(eps[2])}, l.post = {tensors[3], static_cast<float>(eps[3])};
        Linear *linears[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
        for (int i = 0; i < 4; i++)
            *linears[i] = {tensors[4 + 4 * i], tensors[5 + 4 * i], tensors[6 + 4 * i], tensors[7 + 4 * i], 0, 0,
                           groups[i]};
        if (tensors.size() == 24)
            l.keys = tensors[20], l.key_scales = tensors[21], l.values = tensors[22], l.value_scales = tensors[23];
        else
            l.keys = tensors[20], l.values = tensors[21];
        TORCH_CHECK(layers_.empty() || l.int8_cache() == layers_[0].int8_cache(),
                    "DecodePlan.add_layer: every layer's cache is bf16, or every layer's int8");
        check(l);
        layers_.push_back(std::move(l));
    }

    // h bf16 [T, hidden]: T embedded tokens of sequence 0 at positions `position`.. -> bf16 [1, 1, hidden], the
    // last one's output of the final norm.
    at::Tensor step(const at::Tensor &h, int64_t position) {
        check_rows(h, "step");
        const int64_t rows = h.size(0);
        TORCH_CHECK(0 <= position && position + rows <= positions_, "DecodePlan.step: positions ", position, "..",
                    position + rows - 1, " outside the cache of ", positions_);
        std::vector<Slot> slots(rows);
        for (int64_t r = 0; r < rows; r++) slots[r] = {0, position + r};
        run(h, slots);
        at::Tensor out = at::empty({1, 1, hidden_}, h.options());
        final_.apply(hidden_state_.data() + (rows - 1) * hidden_, hidden_, reinterpret_cast<Bf16 *>(out.data_ptr()));
        return out;
    }

    // h bf16 [T, hidden]: row r the embedded token of sequence sequences[r] at position positions[r] (int64 [T],
    // no slot twice) -> bf16 [T, hidden], each row's output of the final norm. Row r attends over its
    // sequence's positions 0..positions[r]: those before it must hold that sequence's earlier tokens.
    at::Tensor rows(const at::Tensor &h, const at::Tensor &sequences, const at::Tensor &positions) {
        check_rows(h, "rows");
        const int64_t rows = h.size(0);
        for (const at::Tensor *t : {&sequences, &positions})
            TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == rows,
                        "DecodePlan.rows: sequences and positions must be int64 [", rows, "], got ", t->sizes());
        const at::Tensor s = sequences.contiguous(), p = positions.contiguous();
        std::vector<Slot> slots(rows);
        for (int64_t r = 0; r < rows; r++) {
            slots[r] = {s.data_ptr<int64_t>()[r], p.data_ptr<int64_t>()[r]};
            TORCH_CHECK(0 <= slots[r].sequence && slots[r].sequence < sequences_ && 0 <= slots[r].position &&
                            slots[r].position < positions_,
                        "DecodePlan.rows: row ", r, " at sequence ", slots[r].sequence, ", position ",
                        slots[r].position, " is outside the caches of ", sequences_, " x ", positions_);
        }
        std::vector<Slot> sorted = slots;
        std::sort(sorted.begin(), sorted.end());
        TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                    "DecodePlan.rows: two rows write the same sequence and position");
        run(h, slots);
        at::Tensor out = at::empty({rows, hidden_}, h.options());
        each_row(rows, hidden_, [&](int64_t r) {
            final_.apply(hidden_state_.data() + r * hidden_, hidden_, reinterpret_cast<Bf16 *>(out.data_ptr()) + r * hidden_);
        });
        return out;
    }

    int64_t sequences() const { return sequences_; }

    int64_t layer_count() const { return static_cast<int64_t>(layers_.size()); }

  private:
    void check_rows(const at::Tensor &h, const char *what) const {
        TORCH_CHECK(!layers_.empty(), "DecodePlan.", what, ": the plan has no layers");
        TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.size(0) > 0 && h.size(1) == hidden_,
                    "DecodePlan.", what, ": h must be bf16 [T, ", hidden_, "], got ", h.sizes());
    }

    // The rows of h through every layer, leaving the last layer's residual stream in hidden_state_.
    void run(const at::Tensor &h, const std::vector<Slot> &slots) {
        const int64_t rows = h.size(0);
        const at::Tensor hc = h.contiguous();
        hidden_state_.assign(bf16_of(hc), bf16_of(hc) + rows * hidden_);
        for (auto [buffer, width] : {std::pair{&qkv_, qkv_width_}, {&attended_, heads_ * dim_}, {&normed_, hidden_},
                                     {&out_, hidden_}, {&gate_up_, 2 * intermediate_}, {&product_, intermediate_}})
            buffer->resize(std::max<size_t>(buffer->size(), rows * width));
        for (const Layer &l : layers_) run_layer(l, slots);
    }

    void check(Layer &l) {
        const int64_t q = heads_ * dim_, kv = kv_heads_ * dim_;
        check_bf16(l.input.weight, {hidden_}, "an input norm's weight");
        check_bf16(l.post.weight, {hidden_}, "a post-attention norm's weight");
        TORCH_CHECK(given(l.q_norm.weight) == given(l.k_norm.weight), "DecodePlan: q and k norms come together");
        if (given(l.q_norm.weight)) {
            check_bf16(l.q_norm.weight, {dim_}, "a q norm's weight");
            check_bf16(l.k_norm.weight, {dim_}, "a k norm's weight");
        }
        const int64_t intermediate = l.gate_up.pack.dim() == 2 ? l.gate_up.pack.size(0) / 2 : 0;
        const int64_t shapes[4][2] = {{q + 2 * kv, hidden_}, {hidden_, q}, {2 * intermediate, hidden_},
                                      {hidden_, intermediate}};
        const char *names[] = {"qkv", "o", "gate_up", "down"};
        Linear *linears[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
        for (int i = 0; i < 4; i++) {
            linears[i]->check(shapes[i][0], shapes[i][1], names[i]);
            linears[i]->n = shapes[i][0], linears[i]->k = shapes[i][1];
        }
        if (layers_.empty() && l.keys.dim() == 4) sequences_ = l.keys.size(0);
        if (l.int8_cache()) check_int8_cache(l);
        else
            for (const at::Tensor *t : {&l.keys, &l.values})
                TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4 && t->size(0) == sequences_ &&
                                sequences_ > 0 && t->size(1) == kv_heads_ && t->size(2) == positions_ &&
                                t->size(3) == dim_ && t->stride(3) == 1,
                            "DecodePlan: keys and values must be bf16 [", sequences_, ", ", kv_heads_, ", ",
                            positions_, ", ", dim_,
                            "] (as many sequences in every layer) with the last dimension contiguous, got ",
                            t->sizes());
        qkv_width_ = q + 2 * kv, intermediate_ = std::max(intermediate_, intermediate);
    }

    void check_int8_cache(const Layer &l) const {
        const at::Tensor &k = l.keys, &v = l.values, &ks = l.key_scales, &vs = l.value_scales;
        TORCH_CHECK(k.scalar_type() == at::kByte && v.scalar_type() == at::kChar && ks.scalar_type() == at::kFloat &&
                        vs.scalar_type() == at::kFloat && k.dim() == 4 && v.sizes() == k.sizes() &&
                        k.size(0) == sequences_ && k.size(1) == kv_heads_ && k.size(2) >= positions_ &&
                        k.size(2) % 16 == 0 && k.size(3) == dim_ && dim_ % INT4Q_KV_KEY_DIMS == 0 &&
                        ks.sizes() == at::IntArrayRef({sequences_, kv_heads_, k.size(2), dim_ / INT4Q_KV_KEY_DIMS}) &&
                        vs.sizes() == k.sizes().slice(0, 3) && k.is_contiguous() && v.is_contiguous() &&
                        ks.is_contiguous() && vs.is_contiguous(),
                    "DecodePlan: an int8 cache must be contiguous keys uint8 and values int8 [", sequences_, ", ",
                    kv_heads_, ", positions >= ", positions_, " (a multiple of 16), ", dim_,
                    " (a multiple of 32)] with key scales fp32 [", sequences_, ", ", kv_heads_, ", positions, ",
                    dim_ / INT4Q_KV_KEY_DIMS, "] and value scales fp32 [", sequences_, ", ", kv_heads_,
                    ", positions]; got ", k.sizes(), ", ", v.sizes(), ", ", ks.sizes(), ", ", vs.sizes());
    }

    // The residual stream's rows, row r at slots[r], through layer l.
    void run_layer(const Layer &l, const std::vector<Slot> &slots) {
        const int64_t rows = static_cast<int64_t>(slots.size());
        norm_rows(l.input, rows);
        l.qkv.apply(normed_.data(), rows, qkv_.data());
        each_row(rows, qkv_width_, [&](int64_t r) { write_token(l, r, slots[r]); });
        attend_rows(l, slots);
        l.o.apply(attended_.data(), rows, out_.data());
        add_residual(rows);
        norm_rows(l.post, rows);
        l.gate_up.apply(normed_.data(), rows, gate_up_.data());
        gated_products(l.gate_up.n / 2, rows);
        l.down.apply(product_.data(), rows, out_.data());
        add_residual(rows);
    }

    // product_ = bf16(SiLU(gate)) * up for each row of gate_up_ ([gate | up], `intermediate` each), split
    // between the threads by spans of columns, so that one row's exponentials are shared out too.
    void gated_products(int64_t intermediate, int64_t rows) {
        at::parallel_for(0, rows * intermediate, kSpanGrain, [&](int64_t first, int64_t last) {
            for (int64_t at = first; at < last;) {
                const int64_t r = at / intermediate, begin = at % intermediate;
                const int64_t end = std::min(intermediate, begin + (last - at));
                const Bf16 *gate = gate_up_.data() + r * 2 * intermediate, *up = gate + intermediate;
                Bf16 *product = product_.data() + r * intermediate;
                for (int64_t i = begin; i < end; i++) {
                    const float g = widen(gate[i]);
                    product[i] = narrow(widen(narrow(g / (1.0f + std::exp(-g)))) * widen(up[i]));
                }
                at += end - begin;
            }
        });
    }

    void norm_rows(const Norm &norm, int64_t rows) {
        each_row(rows, hidden_, [&](int64_t r) {
            norm.apply(hidden_state_.data() + r * hidden_, hidden_, normed_.data() + r * hidden_);
        });
    }

    // Row r of qkv_: q and k normed and rotated for its position, k and v written to the caches at its slot.
    void write_token(const Layer &l, int64_t r, Slot slot) {
        const int64_t position = slot.position;
        Bf16 *q = qkv_.data() + r * qkv_width_, *k = q + heads_ * dim_, *v = k + kv_heads_ * dim_;
        const Bf16 *cos = bf16_of(cos_) + position * rotary_, *sin = bf16_of(sin_) + position * rotary_;
        for (int64_t head = 0; head < heads_ + kv_heads_; head++) {
            Bf16 *x = q + head * dim_;  // the k heads follow the q heads
            const Norm &norm = head < heads_ ? l.q_norm : l.k_norm;
            if (given(norm.weight)) norm.apply(x, dim_, x);
            rotate(x, cos, sin, rotary_);
        }
        if (l.int8_cache()) {
            int4q::store_kv_int8(k, v, l.int8_cache_of(slot.sequence), kv_heads_, dim_, position);
            return;
        }
        Bf16 *keys = reinterpret_cast<Bf16 *>(l.keys.data_ptr()) + slot.sequence * l.keys.stride(0);
        Bf16 *values = reinterpret_cast<Bf16 *>(l.values.data_ptr()) + slot.sequence * l.values.stride(0);
        for (int64_t head = 0; head < kv_heads_; head++) {
            std::memcpy(keys + head * l.keys.stride(1) + position * l.keys.stride(2), k + head * dim_, dim_ * sizeof(Bf16));
            std::memcpy(values + head * l.values.stride(1) + position * l.values.stride(2), v + head * dim_,
                        dim_ * sizeof(Bf16));
        }
    }

    // Row r of attended_: the attention of row r's q over its sequence's positions 0..its position.
    void attend(const Layer &l, int64_t r, Slot slot) {
        if (l.int8_cache()) {
            int4q::attend_one_int8(qkv_.data() + r * qkv_width_, l.int8_cache_of(slot.sequence), heads_, kv_heads_,
                                   slot.position + 1, dim_, scale_, attended_.data() + r * heads_ * dim_);
            return;
        }
        const Bf16 *keys = bf16_of(l.keys) + slot.sequence * l.keys.stride(0);
        const Bf16 *values = bf16_of(l.values) + slot.sequence * l.values.stride(0);
        int4q::attend_one(qkv_.data() + r * qkv_width_, keys, values, heads_, kv_heads_, slot.position + 1, dim_,
                          l.keys.stride(1), l.keys.stride(2), l.values.stride(1), l.values.stride(2), scale_,
                          attended_.data() + r * heads_ * dim_);
    }

    // Every row's attention. With at least two rows a thread, the threads take rows in turn (each attend_one
    // then runs on one thread: nested parallel loops run inline); fewer rows split each attention instead.
    // attend_one's result does not depend on how it is split.
    void attend_rows(const Layer &l, const std::vector<Slot> &slots) {
        const int64_t rows = static_cast<int64_t>(slots.size()), threads = at::get_num_threads();
        if (threads < 2 || rows < 2 * threads) {
            for (int64_t r = 0; r < rows; r++) attend(l, r, slots[r]);
            return;
        }
        at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
            for (int64_t t = first; t < last; t++)
                for (int64_t r = t; r < rows; r += threads) attend(l, r, slots[r]);
        });
    }

    void add_residual(int64_t rows) {
        each_row(rows, hidden_, [&](int64_t r) {
            for (int64_t i = r * hidden_; i < (r + 1) * hidden_; i++)
                hidden_state_[i] = narrow(widen(hidden_state_[i]) + widen(out_[i]));
        });
    }

    int64_t heads_, kv_heads_, dim_, hidden_, sequences_ = 1, positions_ = 0, rotary_ = 0, qkv_width_ = 0, intermediate_ = 0;
    float scale_;
    at::Tensor cos_, sin_;
    Norm final_;
    std::vector<Layer> layers_;
    std::vector<Bf16> hidden_state_, normed_, qkv_, attended_, out_, gate_up_, product_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.class_<DecodePlan>("DecodePlan")
        .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor, double>())
        .def("add_layer", &DecodePlan::add_layer)
        .def("step", &DecodePlan::step)
        .def("rows", &DecodePlan::rows)
        .def("sequences", &DecodePlan::sequences)
        .def("layer_count", &DecodePlan::layer_count);
}
