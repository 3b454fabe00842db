/*
 * The quantized matmul (quantized_matmul.c) in plain C, compiled in every build: the reference
 * the SIMD versions are tested against, and the version CPUs without AVX2 run.
 *
 * x is read as float32 (bf16 widens exactly), a group's codes as float32 integers, and each
 * output's group sum is sum_{k in g} q_k x_k added in k order in float32 (each product exact),
 * then acc += d * sum and acc += m * sum_{k in g} x_k. Each output is its own chain of float32
 * operations in a fixed order: a row's bits depend on nothing but the row and the weight.
 *
 * A tile's group is decoded once into a [32][16] table (input k, tile row n) for every row of x,
 * so the innermost loop runs over the tile's 16 rows, independent outputs the compiler may
 * vectorize without reassociating any sum. The order of a row's operations does not depend on M.
 */
#include "quantized_matmul.h"
#include "scalar.h"

/* Group g of a tile: codes[k][n] = q[n][32 g + k] (as float), d[n] and (4-bit) m[n]. */
static void decode_group(const uint8_t *block, int bits, float codes[GROUP][TILE_ROWS], float d[TILE_ROWS],
                         float offset[TILE_ROWS]) {
    const uint16_t *halves;
    if (bits == 4) {
        for (int c = 0; c < CHUNKS; c++)
            for (int n = 0; n < TILE_ROWS; n++)
                for (int e = 0; e < 2; e++) {
                    const uint8_t byte = block[CHUNK_BYTES(4) * c + 2 * n + e];
                    codes[4 * c + e][n] = (float)(byte & 15);
                    codes[4 * c + 2 + e][n] = (float)(byte >> 4);
                }
    } else {
        for (int c = 0; c < CHUNKS; c++)
            for (int n = 0; n < TILE_ROWS; n++)
                for (int j = 0; j < 4; j++) codes[4 * c + j][n] = (float)((int)block[CHUNK_BYTES(8) * c + 4 * n + j] - 128);
    }
    halves = (const uint16_t *)(block + CHUNKS * CHUNK_BYTES(bits));
    for (int n = 0; n < TILE_ROWS; n++) {
        d[n] = fp16_to_float(halves[n]);
        offset[n] = bits == 4 ? fp16_to_float(halves[TILE_ROWS + n]) : 0.0f;
    }
}

/* One row's group: dots[n] = sum_k codes[k][n] x_k, k in order (the loop over n vectorizes). */
static inline void group_dots(const float codes[GROUP][TILE_ROWS], const uint16_t *xs, float dots[TILE_ROWS]) {
    for (int n = 0; n < TILE_ROWS; n++) dots[n] = 0.0f;
    for (int k = 0; k < GROUP; k++) {
        const float value = bf16_to_float(xs[k]);
        for (int n = 0; n < TILE_ROWS; n++) dots[n] += codes[k][n] * value;
    }
}

void radixrt_quantized_matmul_tiles_portable(
    const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first, int64_t last
) {
    const int64_t groups = num_cols / GROUP;
    float *x_sums = scratch;  /* [m][groups]: each group's sum of x, in k order */
    float (*acc)[TILE_ROWS] = (float (*)[TILE_ROWS])(x_sums + m * groups);  /* [m][16]: a tile's sums */
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float total = 0.0f;
            for (int k = 0; k < GROUP; k++) total += bf16_to_float(x[r * x_stride + g * GROUP + k]);
            x_sums[r * groups + g] = total;
        }
    /* A tile's group is decoded once for every row of x; each row's 16 sums wait in acc. */
    for (int64_t tile = first; tile < last; tile++) {
        for (int64_t r = 0; r < m; r++)
            for (int n = 0; n < TILE_ROWS; n++) acc[r][n] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *block = tiles + (tile * groups + g) * BLOCK_BYTES(bits);
            float codes[GROUP][TILE_ROWS], d[TILE_ROWS], offset[TILE_ROWS];
            prefetch_next_group(block, bits, 0, 1, g, groups, 0);
            decode_group(block, bits, codes, d, offset);
            for (int64_t r = 0; r < m; r++) {
                float dots[TILE_ROWS];
                group_dots(codes, x + r * x_stride + g * GROUP, dots);
                const float x_sum = x_sums[r * groups + g];
                for (int n = 0; n < TILE_ROWS; n++) {
                    acc[r][n] += d[n] * dots[n];
                    if (bits == 4) acc[r][n] += offset[n] * x_sum;
                }
            }
        }
        for (int64_t r = 0; r < m; r++)
            for (int n = 0; n < TILE_ROWS; n++) {
                const int64_t at = r * num_rows + tile * TILE_ROWS + n;
                if (out_bf16 != NULL) out_bf16[at] = float_to_bf16(acc[r][n]);
                else out[at] = acc[r][n];
            }
    }
}
