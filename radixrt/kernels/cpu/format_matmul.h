/*
 * One product API for every GGUF weight format the CPU kernels run natively: the file's blocks
 * repacked into tiles of 16 rows at load (pack), bf16 rows times a packed weight (matmul), and
 * a packed weight's rows back as bf16 (dequantize). Q4_0/Q4_1 and Q8_0 use quantized_matmul.c's
 * 4- and 8-bit layouts and kernels; Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 format_layout.h's layout and
 * the kquant_matmul_* kernels. `format` is GGUF's type number (FORMAT_* in formats.h).
 */
#ifndef RADIXRT_CPU_FORMAT_MATMUL_H
#define RADIXRT_CPU_FORMAT_MATMUL_H

#include <stdint.h>

#include "formats.h"

/* bytes of one tile of 16 rows of num_cols inputs in `format`'s packed layout; 0 for a format
 * without one or num_cols not a whole number of its blocks */
int64_t radixrt_format_tile_bytes(int format, int64_t num_cols);

/* scratch a radixrt_format_matmul_tiles call of m rows needs (the caller's own, per thread) */
int64_t radixrt_format_matmul_scratch_bytes(int format, int64_t m, int64_t num_cols);

/*
 * rows[i]: the address of row i's file blocks (num_cols / block elements blocks); out: num_rows /
 * 16 tiles. Returns 0; -1 (nothing promised about out) on a value the layout cannot hold; -2 for
 * an unknown format or a shape that is not whole tiles and blocks (nothing written); -3 without
 * memory.
 */
int radixrt_pack_format_rows(int format, const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out,
                             int num_threads);

/*
 * out[r][col] = x[r] @ w.T for r < m and the output columns of tiles [first_tile, last_tile), out
 * row stride num_rows (bf16 into out_bf16 when it is not NULL, else fp32 into out); scratch:
 * radixrt_format_matmul_scratch_bytes(format, m, num_cols). A row's result does not depend on m,
 * the tile range or the thread split. An unknown format writes nothing.
 */
void radixrt_format_matmul_tiles(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                 int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                 int64_t first_tile, int64_t last_tile);
/* the plain-C kernel of the same contract, the reference the SIMD kernels are tested against */
void radixrt_format_matmul_tiles_portable(int format, const uint16_t *x, int64_t x_stride, int64_t m,
                                          const uint8_t *tiles, int64_t num_rows, int64_t num_cols, float *out,
                                          uint16_t *out_bf16, void *scratch, int64_t first_tile, int64_t last_tile);

/* The whole product on num_threads threads (equal shares of the tiles). Returns 0, -1 without
 * memory, -2 for an unknown format or a shape that is not whole tiles and blocks. */
int radixrt_format_matmul_bf16(int format, int portable, const uint16_t *x, int64_t x_stride, int64_t m,
                               const uint8_t *tiles, int64_t num_rows, int64_t num_cols, float *out,
                               uint16_t *out_bf16, int num_threads);

/* The packed weight's rows [first_row, last_row) as bf16 (out: (last_row - first_row) * num_cols),
 * exact where the weight (as gguf's dequantizer computes it in fp32) is exact in bf16, else that
 * value rounded to nearest even. Nothing is written for an unknown format or shape. */
void radixrt_format_dequantize_tiles_bf16(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                          int64_t last_row, uint16_t *out);
/* the plain-C version, the same bits */
void radixrt_format_dequantize_tiles_bf16_portable(int format, const uint8_t *tiles, int64_t num_cols,
                                                   int64_t first_row, int64_t last_row, uint16_t *out);

#endif
