/*
 * A Llama decoder layer's work around attention, for a few bf16 rows and
 * packed quantized weights (packed_matrix.c), in two calls instead of about thirty ops.
 *
 * At decode sizes each torch op costs a few microseconds of dispatch and
 * allocation whatever its arithmetic; a batch-1 step of the bundled model
 * spent more time there than in its matmuls. These functions do the same
 * arithmetic with the same bf16 roundings as the torch layer
 * (radixrt/model/llama.py), in one pass each:
 *
 *   attention inputs:  qkv = w_qkv(rms_norm(hidden)); q, k heads rotated (RoPE)
 *   finish:            hidden += w_o(attn); x = rms_norm(hidden);
 *                      hidden += w_down(silu(gate(x)) * up(x))
 *
 * Only the exponential in SiLU is ours (the polynomial below, ~2e-7
 * relative error before the bf16 rounding), so an element can differ from
 * torch's by one bf16 step at a rounding boundary.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "scalar.h"

int radixrt_matrix_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const PackedMatrix *w, float *out,
                               uint16_t *out_bf16, int num_threads);

/* out = silu(gate) * up, each rounded to bf16 as torch's ops do. */
void radixrt_silu_times(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float g = bf16_to_float(gate[i]);
        float silu = round_bf16(g / (1.0f + exp_approx(-g)));
        out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
    }
}

/* out = gelu_tanh(gate) * up (GeGLU, "gelu_pytorch_tanh"): the activation in float32 rounded to
 * bf16, then the product rounded, as torch's ops do; tanhf is libm's, so an element can differ
 * from torch's vectorized tanh by one bf16 step at a rounding boundary. */
void radixrt_gelu_tanh_times(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;  /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        float g = bf16_to_float(gate[i]);
        float gelu = round_bf16(0.5f * g * (1.0f + tanhf(beta * (g + kappa * g * g * g))));
        out[i] = float_to_bf16(gelu * bf16_to_float(up[i]));
    }
}

/* Gemma's RMSNorm (radixrt/model/gemma.py): the row in float32 times rsqrt(mean square + eps) and
 * (1 + weight), rounded once to bf16; y may be x (the row is read whole before it is written). */
void radixrt_gemma_norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t dim, float eps) {
    float squares = 0.0f;
    #pragma omp simd reduction(+:squares)
    for (int64_t i = 0; i < dim; i++) squares += bf16_to_float(x[i]) * bf16_to_float(x[i]);
    const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
    #pragma omp simd
    for (int64_t i = 0; i < dim; i++)
        y[i] = float_to_bf16(bf16_to_float(x[i]) * inv_rms * (1.0f + bf16_to_float(weight[i])));
}

/* RoPE on a row's first `heads` heads: torch's `x * cos + flip_halves(x) * signed_sin`, each
 * product and the sum rounded to bf16. cos, signed_sin: the row's [head_dim] tables. */
void radixrt_rope_row(uint16_t *heads_row, int64_t heads, int64_t head_dim, const uint16_t *cos,
                      const uint16_t *signed_sin) {
    radixrt_rope_row_partial(heads_row, heads, head_dim, head_dim, cos, signed_sin);
}

/* RoPE on the first rotary_dim dims of each head (cos, signed_sin: [rotary_dim]); the rest of the
 * head passes through, as `RotaryEmbedding.apply` does with a partial rotary factor. */
void radixrt_rope_row_partial(uint16_t *heads_row, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                              const uint16_t *cos, const uint16_t *signed_sin) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *x = heads_row + h * head_dim;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float a = bf16_to_float(x[i]), b = bf16_to_float(x[i + half]);
            float first = round_bf16(a * bf16_to_float(cos[i])) + round_bf16(b * bf16_to_float(signed_sin[i]));
            float second = round_bf16(b * bf16_to_float(cos[i + half])) + round_bf16(a * bf16_to_float(signed_sin[i + half]));
            x[i] = float_to_bf16(first);
            x[i + half] = float_to_bf16(second);
        }
    }
}

/*
 * qkv [rows, qkv_rows] = rms_norm(hidden) @ w_qkv.T, then RoPE on each row's
 * first rope_heads heads (q and k) as torch's `x * cos + flip_halves(x) * signed_sin`,
 * each product and the sum rounded to bf16. cos, signed_sin: [rows, head_dim].
 */
int radixrt_layer_attention_inputs_bf16(
    const uint16_t *hidden, int64_t rows, int64_t dim, const uint16_t *norm_weight, float eps,
    const PackedMatrix *w_qkv, const uint16_t *cos, const uint16_t *signed_sin,
    int64_t rope_heads, int64_t head_dim, uint16_t *qkv, int num_threads
) {
    const int64_t qkv_rows = radixrt_matrix_rows(w_qkv);
    if (radixrt_matrix_check(w_qkv, qkv_rows, dim, 0)) return -2;
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)(rows * dim));
    if (normed == NULL) return -1;
    radixrt_rms_norm_bf16((uint16_t *)hidden, NULL, norm_weight, normed, rows, dim, eps, num_threads);
    int status = radixrt_matrix_matmul_bf16(normed, dim, rows, w_qkv, NULL, qkv, num_threads);
    free(normed);
    if (status) return status;
    for (int64_t r = 0; r < rows; r++)
        radixrt_rope_row(qkv + r * qkv_rows, rope_heads, head_dim, cos + r * head_dim, signed_sin + r * head_dim);
    return 0;
}

/*
 * The rest of the layer, in place on hidden [rows, dim]:
 *   hidden += attn @ w_o.T;  x = rms_norm(hidden);  [gate | up] = x @ w_gate_up.T;
 *   hidden += (silu(gate) * up) @ w_down.T
 * each step rounded to bf16 as the torch layer does.
 */
int radixrt_layer_finish_bf16(
    uint16_t *hidden, const uint16_t *attn, int64_t attn_stride, int64_t rows, int64_t dim, int64_t attn_dim,
    const PackedMatrix *w_o, const uint16_t *norm_weight, float eps, const PackedMatrix *w_gate_up,
    const PackedMatrix *w_down, int num_threads
) {
    const int64_t intermediate = radixrt_matrix_rows(w_gate_up) / 2;
    if (radixrt_matrix_check(w_o, dim, attn_dim, 0) || radixrt_matrix_check(w_gate_up, 2 * intermediate, dim, 0) ||
        radixrt_matrix_check(w_down, dim, intermediate, 0))
        return -2;
    uint16_t *projected = malloc(sizeof(uint16_t) * (size_t)(rows * dim));
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)(rows * dim));
    uint16_t *gate_up = malloc(sizeof(uint16_t) * (size_t)(rows * 2 * intermediate));
    uint16_t *activated = malloc(sizeof(uint16_t) * (size_t)(rows * intermediate));
    int status = -1;
    if (projected == NULL || normed == NULL || gate_up == NULL || activated == NULL) goto done;
    status = radixrt_matrix_matmul_bf16(attn, attn_stride, rows, w_o, NULL, projected, num_threads);
    if (status) goto done;
    radixrt_rms_norm_bf16(hidden, projected, norm_weight, normed, rows, dim, eps, num_threads);
    status = radixrt_matrix_matmul_bf16(normed, dim, rows, w_gate_up, NULL, gate_up, num_threads);
    if (status) goto done;
    for (int64_t r = 0; r < rows; r++)
        radixrt_silu_times(gate_up + r * 2 * intermediate, gate_up + r * 2 * intermediate + intermediate,
                   activated + r * intermediate, intermediate);
    status = radixrt_matrix_matmul_bf16(activated, intermediate, rows, w_down, NULL, projected, num_threads);
    if (status) goto done;
    for (int64_t r = 0; r < rows * dim; r++)
        hidden[r] = float_to_bf16(bf16_to_float(hidden[r]) + bf16_to_float(projected[r]));
done:
    free(projected);
    free(normed);
    free(gate_up);
    free(activated);
    return status;
}
