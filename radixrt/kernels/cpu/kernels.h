/*
 * What the kernel sources share with each other (they are compiled into one
 * library): pieces that run inside a caller's OpenMP parallel region, so that
 * a whole decode step (decode_stack.c) forks its threads once instead of
 * once per op.
 */
#ifndef RADIXRT_CPU_KERNELS_H
#define RADIXRT_CPU_KERNELS_H

#include <stdint.h>

/* The entry points other kernels call, as the Python side does. */
int radixrt_quantized_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits,
                                  int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, int num_threads);
void radixrt_rms_norm_bf16(uint16_t *hidden, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                           int64_t rows, int64_t dim, float eps, int num_threads);

/* rms_norm.c: one row, y = rms_norm(x (+= residual first, in place, when residual is not NULL)) */
void radixrt_rms_norm_row(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *y, int64_t dim,
                          float eps);

/* int4_layer.c: out = silu(gate) * up; RoPE on `heads` heads of one row (bf16 roundings of the torch layer) */
void radixrt_silu_times(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n);
void radixrt_rope_row(uint16_t *heads_row, int64_t heads, int64_t head_dim, const uint16_t *cos,
                      const uint16_t *signed_sin);

/*
 * quantized_matmul.c, called by every thread of a parallel region: this thread's equal share of
 * the weight's tiles, out[r] = x[r] @ w.T for r < m (bf16 when out_bf16 is not NULL, else fp32).
 * x_sums: m * (num_cols / 32) floats of scratch, the thread's own. No barrier at the end.
 */
void radixrt_quantized_matmul_share(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits,
                                    int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16,
                                    float *x_sums);

/*
 * decode_attention.c: attention of query rows over runs of pool slots ("segments"), merged per
 * row by log-sum-exp. Segment s is the slots kv_indices[starts[s] ..][:lens[s]] and the query
 * rows rows[row_ptr[s] .. row_ptr[s + 1]); every key of a segment is visible to each of its
 * rows. A row listed in several segments attends their union: a shared prefix once for many
 * sequences, a sequence's own keys, a new token's keys among the step's new tokens.
 * Shapes: at most MAX_GROUP query heads per KV head, head_dim at most MAX_HEAD_DIM (the
 * `supports` check in Python).
 */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

typedef struct {
    int num_segments;
    const int64_t *starts, *lens, *row_ptr, *rows;
    int num_q_heads, num_kv_heads, head_dim;
} Segments;

typedef struct AttentionWork AttentionWork;  /* the split into work items and the partial results */

AttentionWork *radixrt_attention_work_new(const Segments *segments);  /* NULL without memory */
void radixrt_attention_work_free(AttentionWork *work);

/*
 * Called by every thread of a parallel region (ends with a barrier): out[row] ([*, Hq, D] bf16)
 * and, if lse is not NULL, lse[row] ([*, Hq] float32, natural log) for each listed row.
 * q rows [*, Hq, D], head stride D; pools [slots, Hkv, D].
 */
void radixrt_attention_run(AttentionWork *work, const uint16_t *q, int64_t q_row_stride, const uint16_t *k_pool,
                           const uint16_t *v_pool, const int64_t *kv_indices, float scale, uint16_t *out, float *lse);

#endif
