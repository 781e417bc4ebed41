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

}  // namespace int4q

#endif
