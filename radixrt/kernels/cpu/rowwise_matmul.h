/*
 * What the versions of the batch-invariant dense matmul (rowwise_matmul.c) share: the call's
 * description, the store of one output, and each version's block of weight rows.
 */
#ifndef RADIXRT_CPU_ROWWISE_MATMUL_H
#define RADIXRT_CPU_ROWWISE_MATMUL_H

#include <stdint.h>

#include "scalar.h"

typedef struct {
    const void *x;
    int64_t x_stride, m, k;
    const void *w;
    int64_t n;
    const void *bias; /* [N] in w's dtype, or NULL */
    void *out;        /* [M, N], contiguous */
    int out_f32;      /* 1: float32 out; 0: w's dtype */
} Matmul;

/* Output (row, col) = value + its bias, in the output's dtype. */
static inline void store(const Matmul *a, int bf16, int64_t row, int64_t col, float value) {
    if (a->bias) value += bf16 ? bf16_to_float(((const uint16_t *)a->bias)[col]) : ((const float *)a->bias)[col];
    if (a->out_f32) ((float *)a->out)[row * a->n + col] = value;
    else if (bf16) ((uint16_t *)a->out)[row * a->n + col] = float_to_bf16(value);
    else ((float *)a->out)[row * a->n + col] = value;
}

/* Every row of x times weight rows [n0, n1): all their outputs, bf16 (1) or float32 (0) data. The
 * portable one is in every build, a SIMD one in builds of its level only (isa.h). */
typedef void RowwiseBlock(const Matmul *a, int bf16, int64_t n0, int64_t n1);
RowwiseBlock radixrt_rowwise_block_portable;
RowwiseBlock radixrt_rowwise_block_avx2;
RowwiseBlock radixrt_rowwise_block_avx512;

#endif
