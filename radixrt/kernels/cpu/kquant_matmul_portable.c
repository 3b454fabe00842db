/*
 * Plain-C product and dequantizer over format_layout.h's tiles (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1):
 * the reference the SIMD kernels are tested against, and the kernel of builds without them.
 *
 * The arithmetic is the SIMD kernels': codes exact, bf16 inputs, float32 sums of q x per
 * sub-block, then  acc += (d sc) dot  and  acc -= (dmin m) sum x  (the scale products are exact
 * in float32, as in gguf's dequantizer). A tile's codes are decoded once per unit for every row
 * of x, and each row runs the same loops (16 lanes, fixed trip counts) whatever m, the tile range
 * or the thread split: a row's result does not depend on its batch.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"
#include "scalar.h"

#define UNIT_MAX QK_K
#define SUBS_MAX 16  /* Q6_K's sub-blocks of 16 */
#define LANES LAYOUT_TILE_ROWS

/* A tile's unit decoded: w[k][n] = scale[s][n] * code[k][n] (+ offset[s][n]), s = k / sub_inputs. */
typedef struct {
    float code[UNIT_MAX][LANES];
    float scale[SUBS_MAX][LANES], offset[SUBS_MAX][LANES];
} DecodedUnit;

static inline int sub_inputs(int format) { return format == FORMAT_Q6_K ? 16 : 32; }

/* (inlined with a constant format, so that its branches fold and its loops vectorize) */
static inline __attribute__((always_inline)) void decode_unit(int format, const uint8_t *unit, DecodedUnit *out) {
    const int inputs = layout_unit_inputs(format), high = layout_high_bytes(format);
    const int bias = format == FORMAT_Q6_K ? 32 : format == FORMAT_Q5_0 ? 16 : 0;
    for (int k = 0; k < inputs; k++) {
        const int g = k / 32, c = (k % 32) / 4, e = k & 1, b = (k >> 1) & 1;
        const uint8_t *nibbles = unit + LAYOUT_NIBBLE_BYTES * g + 32 * c;
        const uint8_t *plane = unit + layout_high_at(format) + high * g;
        for (int n = 0; n < LANES; n++) {
            const int lane = 2 * n + e;
            int q = b ? nibbles[lane] >> 4 : nibbles[lane] & 15;
            if (high == 64) q |= ((plane[32 * (c / 4) + lane] >> (2 * (c % 4) + b)) & 1) << 4;
            if (high == 128) q |= ((plane[32 * (c / 2) + lane] >> (4 * (c % 2) + 2 * b)) & 3) << 4;
            out->code[k][n] = (float)(q - bias);
        }
    }
    const uint8_t *scales = unit + layout_scales_at(format), *fp16 = unit + layout_d_at(format);
    for (int n = 0; n < LANES; n++) {
        uint16_t half_d, half_second = 0;
        memcpy(&half_d, fp16 + 2 * n, 2);
        if (layout_has_offset(format)) memcpy(&half_second, fp16 + 32 + 2 * n, 2);
        const float d = fp16_to_float(half_d), second = fp16_to_float(half_second);
        for (int s = 0; s < inputs / sub_inputs(format); s++) {
            switch (format) {
            case FORMAT_Q4_K:
            case FORMAT_Q5_K:
                out->scale[s][n] = d * (float)scales[16 * s + n];
                out->offset[s][n] = -(second * (float)scales[128 + 16 * s + n]);
                break;
            case FORMAT_Q6_K: out->scale[s][n] = d * (float)(int8_t)scales[16 * s + n]; break;
            default: out->scale[s][n] = d, out->offset[s][n] = second;  /* Q5_1's m; unused for Q5_0 */
            }
        }
    }
}

int64_t kquant_matmul_scratch_bytes_portable(int64_t m, int64_t num_cols) {
    return (int64_t)sizeof(DecodedUnit) + 64 + m * (num_cols / 32 + LANES) * (int64_t)sizeof(float);
}

static inline __attribute__((always_inline)) void matmul_tiles(
    int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first_tile, int64_t last_tile
) {
    const int inputs = layout_unit_inputs(format), sub = sub_inputs(format), offsets = layout_has_offset(format);
    const int64_t units = num_cols / inputs, groups = num_cols / 32, unit_bytes = layout_unit_bytes(format);
    DecodedUnit *unit = (DecodedUnit *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *x_sums = (float *)(unit + 1), *acc = x_sums + m * groups;  /* acc: [m][16] */
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int k = 0; k < 32; k++) sum += bf16_to_float(x[r * x_stride + 32 * g + k]);
            x_sums[r * groups + g] = sum;
        }
    for (int64_t tile = first_tile; tile < last_tile; tile++) {
        memset(acc, 0, (size_t)m * LANES * sizeof(float));
        for (int64_t u = 0; u < units; u++) {
            decode_unit(format, tiles + (tile * units + u) * unit_bytes, unit);
            for (int64_t r = 0; r < m; r++) {
                const uint16_t *xs = x + r * x_stride + u * inputs;
                float *row_acc = acc + r * LANES;
                for (int s = 0; s < inputs / sub; s++) {
                    float dot[LANES] = {0};
                    for (int k = s * sub; k < (s + 1) * sub; k++) {
                        const float xk = bf16_to_float(xs[k]);
                        for (int n = 0; n < LANES; n++) dot[n] += unit->code[k][n] * xk;
                    }
                    for (int n = 0; n < LANES; n++) row_acc[n] += unit->scale[s][n] * dot[n];
                    if (offsets) {
                        const float x_sum = x_sums[r * groups + u * (inputs / 32) + s];
                        for (int n = 0; n < LANES; n++) row_acc[n] += unit->offset[s][n] * x_sum;
                    }
                }
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int n = 0; n < LANES; n++) {
                const int64_t at = r * num_rows + tile * LANES + n;
                if (out_bf16 != NULL) out_bf16[at] = float_to_bf16(acc[r * LANES + n]);
                else out[at] = acc[r * LANES + n];
            }
    }
}

/* Each format's own copy of `body` (a call with FORMAT standing for the format's constant). */
#define FOR_FORMAT(format, body) \
    switch (format) { \
    case FORMAT_Q4_K: { const int FORMAT = FORMAT_Q4_K; body; break; } \
    case FORMAT_Q5_K: { const int FORMAT = FORMAT_Q5_K; body; break; } \
    case FORMAT_Q6_K: { const int FORMAT = FORMAT_Q6_K; body; break; } \
    case FORMAT_Q5_0: { const int FORMAT = FORMAT_Q5_0; body; break; } \
    case FORMAT_Q5_1: { const int FORMAT = FORMAT_Q5_1; body; break; } \
    default: break; \
    }

void kquant_matmul_tiles_portable(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                  int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                  int64_t first_tile, int64_t last_tile) {
    FOR_FORMAT(format, matmul_tiles(FORMAT, x, x_stride, m, tiles, num_rows, num_cols, out, out_bf16, scratch,
                                    first_tile, last_tile))
}

static inline __attribute__((always_inline)) void dequantize_tiles(int format, const uint8_t *tiles, int64_t num_cols,
                                                                  int64_t first_row, int64_t last_row, uint16_t *out) {
    const int inputs = layout_unit_inputs(format), sub = sub_inputs(format), offsets = layout_has_offset(format);
    const int64_t units = num_cols / inputs, unit_bytes = layout_unit_bytes(format);
    DecodedUnit unit;
    for (int64_t tile = first_row / LANES; tile * LANES < last_row; tile++) {
        for (int64_t u = 0; u < units; u++) {
            decode_unit(format, tiles + (tile * units + u) * unit_bytes, &unit);
            for (int n = 0; n < LANES; n++) {
                const int64_t row = tile * LANES + n;
                if (row < first_row || row >= last_row) continue;
                uint16_t *dst = out + (row - first_row) * num_cols + u * inputs;
                for (int k = 0; k < inputs; k++) {
                    /* gguf's order: (d sc) q, then - dmin m (or + m); d sc q is exact */
                    float w = unit.scale[k / sub][n] * unit.code[k][n];
                    if (offsets) w += unit.offset[k / sub][n];
                    dst[k] = float_to_bf16(w);
                }
            }
        }
    }
}

void kquant_dequantize_tiles_bf16(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                  int64_t last_row, uint16_t *out) {
    FOR_FORMAT(format, dequantize_tiles(FORMAT, tiles, num_cols, first_row, last_row, out))
}
