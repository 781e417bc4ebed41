// The attention operators of torch.ops.int4q_native: attend_one (decode_attention.c), the int8 decode
// step's one query over a bf16 KV cache in fp32, and causal_attention (causal_attention.c), a whole
// sequence's causal attention from position 0. The library itself is defined in int4_ops.cpp.
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

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// q bf16 [B, H, T, D], k and v bf16 [B, Hkv, T, D] (any strides, D contiguous), H % Hkv == 0, D even ->
// bf16 [B, T, H, D]: each query attends to the positions up to its own (causal_attention.c).
at::Tensor causal_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, double scale) {
    TORCH_CHECK(int4q_causal_available(), "int4q_native::causal_attention: this CPU lacks AVX-512 BF16");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                    v.scalar_type() == at::kBFloat16 && q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                "int4q_native::causal_attention: q, k and v must be bf16 [batch, heads, positions, dim]");
    const int64_t batch = q.size(0), heads = q.size(1), length = q.size(2), dim = q.size(3), kv_heads = k.size(1);
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(2) == length && k.size(3) == dim &&
                    kv_heads > 0 && heads % kv_heads == 0 && length > 0 && dim > 0 && dim % 2 == 0 && scale > 0,
                "int4q_native::causal_attention: q [B, H, T, D] against k and v [B, Hkv, T, D] with H % Hkv == 0, "
                "T > 0, D even and a positive scale; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
    const bool word_aligned = q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0 && q.stride(2) % 2 == 0 &&
                              q.storage_offset() % 2 == 0;  // the kernel reads each query as words of two values
    const at::Tensor qc = q.stride(3) == 1 && word_aligned ? q : q.contiguous();
    const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous(), vc = v.stride(3) == 1 ? v : v.contiguous();
    const int64_t key_stride = round_up(length, INT4Q_CAUSAL_KEYS), value_stride = round_up(dim, INT4Q_CAUSAL_DIMS);
    const int64_t key_words = dim / 2 * key_stride, value_words = (length + 1) / 2 * value_stride;
    std::vector<uint32_t> keys(batch * kv_heads * key_words), values(batch * kv_heads * value_words);
    const auto *kp = reinterpret_cast<const uint16_t *>(kc.data_ptr());
    const auto *vp = reinterpret_cast<const uint16_t *>(vc.data_ptr());
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t first, int64_t last) {
        for (int64_t bh = first; bh < last; bh++) {
            const int64_t b = bh / kv_heads, h = bh % kv_heads;
            int4q_causal_pack_keys(kp + b * kc.stride(0) + h * kc.stride(1), kc.stride(2), length, dim, key_stride,
                                   keys.data() + bh * key_words);
            int4q_causal_pack_values(vp + b * vc.stride(0) + h * vc.stride(1), vc.stride(2), length, dim,
                                     value_stride, values.data() + bh * value_words);
        }
    });
    at::Tensor out = at::empty({batch, length, heads, dim}, q.options());
    const auto *qp = reinterpret_cast<const uint16_t *>(qc.data_ptr());
    auto *op = reinterpret_cast<uint16_t *>(out.data_ptr());
    // A task is a block near the start and its mirror near the end, so that every task has about the
    // same number of keys to visit whichever thread takes it.
    const int64_t blocks = (length + INT4Q_CAUSAL_ROWS - 1) / INT4Q_CAUSAL_ROWS, pairs = (blocks + 1) / 2;
    const int64_t group = heads / kv_heads;
    at::parallel_for(0, batch * heads * pairs, 1, [&](int64_t first, int64_t last) {
        std::vector<float> scores(INT4Q_CAUSAL_ROWS * key_stride), totals(INT4Q_CAUSAL_ROWS);
        std::vector<uint16_t> weights(2 * INT4Q_CAUSAL_ROWS * key_stride);
        for (int64_t task = first; task < last; task++) {
            const int64_t pair = task % pairs, bh = task / pairs, b = bh / heads, h = bh % heads;
            const int64_t kv = b * kv_heads + h / group;
            const int64_t mirror = blocks - 1 - pair;
            for (int64_t block = pair; block <= mirror; block += std::max<int64_t>(1, mirror - pair)) {
                const int64_t start = block * INT4Q_CAUSAL_ROWS;
                const int64_t rows = std::min<int64_t>(INT4Q_CAUSAL_ROWS, length - start);
                int4q_causal_block(qp + b * qc.stride(0) + h * qc.stride(1), qc.stride(2), start, rows, dim,
                                   keys.data() + kv * key_words, key_stride, values.data() + kv * value_words,
                                   value_stride, static_cast<float>(scale), scores.data(), weights.data(),
                                   totals.data(), op + b * length * heads * dim + h * dim, heads * dim);
            }
        }
    });
    return out;
}

at::Tensor causal_attention_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &, double) {
    return at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1), q.sym_size(3)}, q.options());
}

bool causal_attention_available() { return int4q_causal_available() != 0; }

}  // namespace

namespace {

// out bf16 [heads, dim]: the attention of every query head over `length` positions, one task a part (a
// cached head's group of query heads over one chunk of positions, `part(head, begin, end, scratch, out)`
// with scratch fp32 [scratch_floats]), the parts merged per query head.
template <class Part>
void attend_in_parts(int64_t heads, int64_t kv_heads, int64_t length, int64_t dim, int64_t scratch_floats,
                     const Part &part, uint16_t *out) {
    const int64_t group = heads / kv_heads, chunks = (length + INT4Q_ATTEND_CHUNK - 1) / INT4Q_ATTEND_CHUNK;
    const int64_t part_step = dim + INT4Q_PART_ACC, task_step = group * part_step;
    thread_local std::vector<float> reused;  // the caller's: a worker thread's own would be another vector
    reused.resize(kv_heads * chunks * task_step);
    float *parts = reused.data();
    const int64_t part_products = 2 * std::min<int64_t>(length, INT4Q_ATTEND_CHUNK) * dim * group;
    const int64_t grain = std::max<int64_t>(1, kTaskProducts / part_products);
    at::parallel_for(0, kv_heads * chunks, grain, [&](int64_t first, int64_t last) {
        std::vector<float> scratch(scratch_floats);
        for (int64_t task = first; task < last; task++) {
            const int64_t head = task / chunks, begin = task % chunks * INT4Q_ATTEND_CHUNK;
            part(head, begin, std::min(length, begin + INT4Q_ATTEND_CHUNK), scratch.data(), parts + task * task_step);
        }
    });
    std::vector<float> acc(dim);
    for (int64_t h = 0; h < heads; h++)
        int4q_attend_merge(parts + h / group * chunks * task_step + h % group * part_step, chunks, task_step,
                           dim, acc.data(), out + h * dim);
}

}  // namespace

void int4q::attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t heads, int64_t kv_heads,
                       int64_t length, int64_t dim, int64_t k_head_step, int64_t k_step, int64_t v_head_step,
                       int64_t v_step, float scale, uint16_t *out) {
    const int64_t group = heads / kv_heads;
    attend_in_parts(heads, kv_heads, length, dim, group * (dim + INT4Q_ATTEND_CHUNK) + dim,
                    [&](int64_t head, int64_t begin, int64_t end, float *scratch, float *part) {
                        int4q_attend_part(q + head * group * dim, group, k + head * k_head_step, v + head * v_head_step,
                                          begin, end, dim, k_step, v_step, scale, scratch, part);
                    },
                    out);
}

void int4q::attend_one_int8(const uint16_t *q, const Int8Cache &cache, int64_t heads, int64_t kv_heads,
                            int64_t length, int64_t dim, float scale, uint16_t *out) {
    const int64_t group = heads / kv_heads;
    thread_local std::vector<int8_t> codes;
    thread_local std::vector<float> scales;
    thread_local std::vector<int32_t> sums;
    const int64_t key_blocks = dim / INT4Q_KV_KEY_DIMS;
    codes.resize(heads * dim), scales.resize(heads), sums.resize(heads * key_blocks);
    const int8_t *q8 = codes.data();  // the caller's vectors: a worker thread would name its own
    const float *q_scales = scales.data();
    const int32_t *q_sums = sums.data();
    int4q_attend_quantize_query(q, heads, dim, codes.data(), scales.data(), sums.data());
    attend_in_parts(heads, kv_heads, length, dim, 2 * group * INT4Q_ATTEND_CHUNK,
                    [&](int64_t head, int64_t begin, int64_t end, float *scratch, float *part) {
                        int4q_attend_part_int8(q8 + head * group * dim, q_scales + head * group,
                                               q_sums + head * group * key_blocks, group,
                                               cache.keys + head * cache.head_step,
                                               cache.key_scales + head * cache.key_scale_head_step,
                                               cache.values + head * cache.head_step,
                                               cache.value_scales + head * cache.value_scale_head_step, begin, end,
                                               dim, scale, scratch, part);
                    },
                    out);
}

void int4q::store_kv_int8(const uint16_t *k, const uint16_t *v, const Int8Cache &cache, int64_t kv_heads,
                          int64_t dim, int64_t position) {
    for (int64_t head = 0; head < kv_heads; head++)
        int4q_kv_int8_store(k + head * dim, v + head * dim, dim, position, cache.keys + head * cache.head_step,
                            cache.key_scales + head * cache.key_scale_head_step, cache.values + head * cache.head_step,
                            cache.value_scales + head * cache.value_scale_head_step);
}

TORCH_LIBRARY_FRAGMENT(int4q_native, m) {
    m.def("attend_one(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
    m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
    m.def("causal_attention_available() -> bool", &causal_attention_available);
}
TORCH_LIBRARY_IMPL(int4q_native, CPU, m) {
    m.impl("attend_one", attend_one);
    m.impl("causal_attention", causal_attention);
}
TORCH_LIBRARY_IMPL(int4q_native, Meta, m) {
    m.impl("attend_one", attend_one_meta);
    m.impl("causal_attention", causal_attention_meta);
}
