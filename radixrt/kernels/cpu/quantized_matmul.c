/*
 * out = x @ w.T for bf16 activations x [M, K] and a 4- or 8-bit weight w [N, K] in the tile layout
 * of quantized_matmul.h, with the group's scale and offset applied once per group:
 *
 *     sum_k x_k w_k  =  sum_g [ d_g * sum_{k in g} q_k x_k  +  m_g * sum_{k in g} x_k ]
 *
 * A decode step multiplies a few rows by every weight of the model once: the codes are decoded
 * in registers once for several rows of x and never widened to a float32 copy in memory.
 *
 * One version per instruction set, each in its own file, all reading the same layout:
 *   quantized_matmul_portable.c  plain C, x as float32 (exact), float32 sums: the reference
 *   quantized_matmul_avx2.c      16-bit integer activations per group, VPMADDWD
 *   quantized_matmul_avx512.c    AVX512-BF16 dot products (4-bit), VNNI byte products (8-bit)
 * This file holds the entry points and calls the version of this build's level (isa.h).
 *
 * In every version each output row runs the same instructions whatever M, the blocking and the
 * range of tiles are, so a row's result does not depend on the batch it is in.
 */
#include <omp.h>
#include <stdlib.h>

#include "isa.h"
#include "quantized_matmul.h"

int64_t radixrt_quantized_tile_bytes(int bits, int64_t num_cols) { return num_cols / GROUP * BLOCK_BYTES(bits); }

/* Scratch for m rows of K inputs: 2 bytes an input (the AVX versions' 16-bit or byte-plane
 * activations) and 8 bytes a group (its scale, sum or integer sum). */
int64_t radixrt_quantized_matmul_scratch_bytes(int64_t m, int64_t num_cols) {
    return m * (2 * num_cols + (num_cols / GROUP) * (int64_t)(sizeof(float) + sizeof(int32_t)));
}

/* Every build has a version (the portable one at least). */
int radixrt_quantized_matmul_available(void) { return 1; }

void radixrt_quantized_matmul_tiles(
    const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first, int64_t last
) {
#if RADIXRT_ISA_AVX512
    radixrt_quantized_matmul_tiles_avx512(x, x_stride, m, tiles, bits, num_rows, num_cols, out, out_bf16, scratch, first,
                                          last);
#elif RADIXRT_ISA_AVX2
    radixrt_quantized_matmul_tiles_avx2(x, x_stride, m, tiles, bits, num_rows, num_cols, out, out_bf16, scratch, first,
                                        last);
#else
    radixrt_quantized_matmul_tiles_portable(x, x_stride, m, tiles, bits, num_rows, num_cols, out, out_bf16, scratch,
                                            first, last);
#endif
}

/*
 * out[r] (fp32, or bf16 when out_bf16 is not NULL) = x[r] @ w.T for r < m. num_rows % 16 == 0 and
 * num_cols % 32 == 0 (the caller checks). Returns 0, -1 without memory, -2 for other bits.
 */
int radixrt_quantized_matmul_bf16(
    const uint16_t *x, int64_t x_stride, int64_t m,
    const uint8_t *tiles, int bits, int64_t num_rows, int64_t num_cols,
    float *out, uint16_t *out_bf16, int num_threads
) {
    if (bits != 4 && bits != 8) return -2;
    const int64_t scratch_bytes = radixrt_quantized_matmul_scratch_bytes(m, num_cols);
    char *scratch = malloc((size_t)(scratch_bytes * num_threads));
    if (scratch == NULL) return -1;
    #pragma omp parallel num_threads(num_threads)
    {
        const Team team = {NULL, omp_get_thread_num(), omp_get_num_threads()};  /* no barrier: the region's end */
        int64_t first, last;  /* an equal share of the tiles */
        team_share(&team, num_rows / TILE_ROWS, &first, &last);
        radixrt_quantized_matmul_tiles(x, x_stride, m, tiles, bits, num_rows, num_cols, out, out_bf16,
                                       scratch + scratch_bytes * team.thread, first, last);
    }
    free(scratch);
    return 0;
}

/* Which version the entry points run: 0 portable, 1 avx2, 2 avx512 (the build's level). */
int radixrt_isa_level(void) { return RADIXRT_ISA_LEVEL; }
