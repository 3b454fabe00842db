/*
 * RMSNorm of bf16 rows, optionally after adding a residual, in one pass.
 *
 * torch's CPU rms_norm for bf16 is a composite of about eight ops (cast,
 * square, mean, add, rsqrt, multiply, cast, multiply): at decode sizes
 * each costs more in dispatch than in arithmetic, and a model calls it
 * twice per layer. This is the same arithmetic as transformers'
 * LlamaRMSNorm: the row in float32, its mean square, x * rsqrt(mean + eps)
 * rounded to bf16, times the weight, rounded again (only the sum of squares
 * runs in another order, which moves a rare element by one bf16 step). Each
 * row is reduced on its own, in a fixed order, so a row's result does not
 * depend on the other rows of the batch.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "scalar.h"

void radixrt_rms_norm_row(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *y, int64_t dim,
                          float eps) {
    if (residual) {
        #pragma omp simd
        for (int64_t i = 0; i < dim; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(residual[i]));
    }
    float squares = 0.0f;
    #pragma omp simd reduction(+:squares)
    for (int64_t i = 0; i < dim; i++) squares += bf16_to_float(x[i]) * bf16_to_float(x[i]);
    float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
    #pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        float normed = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * inv_rms));
        y[i] = float_to_bf16(normed * bf16_to_float(weight[i]));
    }
}

/* out[r] = rms_norm(hidden[r] (+= residual[r] first, in place, when residual is not NULL)) */
void radixrt_rms_norm_bf16(
    uint16_t *hidden, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
    int64_t rows, int64_t dim, float eps, int num_threads
) {
    #pragma omp parallel for num_threads(num_threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++)
        radixrt_rms_norm_row(hidden + r * dim, residual ? residual + r * dim : NULL, weight, out + r * dim, dim, eps);
}
