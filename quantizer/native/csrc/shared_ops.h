// The raw-pointer forms of int4q's operators that the decode plan (decode_plan.cpp) calls between
// them without making tensors: each is the arithmetic of the operator named, on ATen's threads.
#ifndef INT4Q_SHARED_OPS_H
#define INT4Q_SHARED_OPS_H

#include <cstdint>

namespace int4q {

// w4a8_mm (w4a8_ops.cpp) of x bf16 [m, k] and the kernel-layout weight (pack [n, k/2], sz [k/group, n, 2])
// into out bf16 [m, n].
void w4a8_matmul(const uint16_t *x, int64_t m, int64_t k, const uint8_t *pack, const uint16_t *sz, int64_t n,
                 int64_t group_size, uint16_t *out);

// w4a8_rows (w4a8_ops.cpp) of x bf16 [m, k] and the row-major weight (packed [n, k/2], scale and zero
// [n, k/group]) into out bf16 [m, n].
void w4a8_rows_matmul(const uint16_t *x, int64_t m, int64_t k, const uint8_t *packed, const uint16_t *scale,
                      const uint16_t *zero, int64_t n, int64_t group_size, uint16_t *out);

// The sum of x[0..n) squared in the order of ATen's sum (int4_ops.cpp's mean_square).
float sum_of_squares(const float *x, int64_t n);

// attend_one (attention_ops.cpp): q bf16 [heads, dim] over k and v bf16 with (head, position) strides
// k_head_step/k_step and v_head_step/v_step, `length` positions -> out bf16 [heads, dim].
void attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t heads, int64_t kv_heads,
                int64_t length, int64_t dim, int64_t k_head_step, int64_t k_step, int64_t v_head_step, int64_t v_step,
                float scale, uint16_t *out);

// One layer's int8 KV cache for one sequence (decode_attention_int8.c's layouts): each cached head's keys and
// values `head_step` bytes apart, their scales `key_scale_head_step` and `value_scale_head_step` floats apart.
struct Int8Cache {
    uint8_t *keys;
    float *key_scales;
    int8_t *values;
    float *value_scales;
    int64_t head_step, key_scale_head_step, value_scale_head_step;
};

// attend_one_int8 (attention_ops.cpp): q bf16 [heads, dim] over positions [0, length) of an int8 cache
// -> out bf16 [heads, dim].
void attend_one_int8(const uint16_t *q, const Int8Cache &cache, int64_t heads, int64_t kv_heads, int64_t length,
                     int64_t dim, float scale, uint16_t *out);

// k and v bf16 [kv_heads, dim] into an int8 cache at `position`.
void store_kv_int8(const uint16_t *k, const uint16_t *v, const Int8Cache &cache, int64_t kv_heads, int64_t dim,
                   int64_t position);

}  // namespace int4q

#endif
