/*
 * The packed layout of the 5- and 6-bit formats and of the K-quants (pack_formats.c writes it,
 * kquant_matmul_*.c read it). Rows in tiles of 16; a tile's inputs in units (a K-quant's
 * super-block of 256, a Q5_0/Q5_1 block of 32), one tile's units after each other, tile after
 * tile. Within a unit, groups g of 32 inputs, each in 8 chunks c of 4 (k = 32 g + 4 c + j), and
 * 16-bit lanes L = 2 n + e (row n, e in 0..1) as in quantized_matmul.c's 4-bit layout:
 *
 *   nibbles  256 bytes a group: chunk c byte L = low 4 bits of q[n][32g+4c+e] | those of
 *            q[n][32g+4c+2+e] << 4 (codes A and B of lane L)
 *   high     Q5 (Q5_0, Q5_1, Q5_K), 64 bytes a group: half h (chunks 4h..4h+3) byte L bit
 *            2 (c - 4h) + b = bit 4 of code b (A: 0, B: 1) of chunk c
 *            Q6_K, 128 bytes a group: pair p (chunks 2p, 2p+1) byte L bits 4 (c - 2p) + 2b,
 *            + 1 = bits 4, 5 of code b of chunk c
 *            One load widened to 16-bit lanes puts a lane's high bits beside its nibbles.
 *   scales   Q4_K/Q5_K: sc[8][16] then m[8][16], the 6-bit values as bytes, lane = row;
 *            Q6_K: sc[16][16] int8, sub-block (16 inputs) j = 2 g + (c >= 4)
 *   d        16 fp16 (every format); then dmin (Q4_K/Q5_K) or m (Q5_1), 16 fp16
 *
 * A weight is  d sc q - dmin m  (Q4_K, Q5_K),  d sc (q - 32)  (Q6_K),  d (q - 16)  (Q5_0),
 * d q + m  (Q5_1): the file's values as it stores them, nothing rounded at packing.
 */
#ifndef RADIXRT_CPU_FORMAT_LAYOUT_H
#define RADIXRT_CPU_FORMAT_LAYOUT_H

#include <stdint.h>

#include "formats.h"

#define LAYOUT_TILE_ROWS 16
#define LAYOUT_GROUP 32
#define LAYOUT_NIBBLE_BYTES 256  /* a group's nibbles for a tile */

/* 1 for the formats this layout serves (the rest delegate to quantized_matmul.c's) */
static inline int layout_serves(int format) {
    return format == FORMAT_Q4_K || format == FORMAT_Q5_K || format == FORMAT_Q6_K || format == FORMAT_Q5_0 ||
           format == FORMAT_Q5_1;
}

static inline int layout_unit_inputs(int format) { return format == FORMAT_Q5_0 || format == FORMAT_Q5_1 ? 32 : 256; }
static inline int layout_groups(int format) { return layout_unit_inputs(format) / LAYOUT_GROUP; }
/* high-bit bytes a group: 0 for 4-bit codes */
static inline int layout_high_bytes(int format) { return format == FORMAT_Q6_K ? 128 : format == FORMAT_Q4_K ? 0 : 64; }
static inline int layout_high_at(int format) { return layout_groups(format) * LAYOUT_NIBBLE_BYTES; }
static inline int layout_scales_at(int format) { return layout_high_at(format) + layout_groups(format) * layout_high_bytes(format); }
static inline int layout_scale_bytes(int format) {
    return format == FORMAT_Q4_K || format == FORMAT_Q5_K || format == FORMAT_Q6_K ? 256 : 0;
}
static inline int layout_d_at(int format) { return layout_scales_at(format) + layout_scale_bytes(format); }
/* 1 where a second row of 16 fp16 (dmin or m) follows d */
static inline int layout_has_offset(int format) { return format != FORMAT_Q6_K && format != FORMAT_Q5_0; }
static inline int layout_unit_bytes(int format) { return layout_d_at(format) + (1 + layout_has_offset(format)) * 32; }
/* bytes of a file block (a unit of one row) */
static inline int layout_file_block_bytes(int format) {
    switch (format) {
    case FORMAT_Q4_K: return (int)sizeof(BlockQ4_K);
    case FORMAT_Q5_K: return (int)sizeof(BlockQ5_K);
    case FORMAT_Q6_K: return (int)sizeof(BlockQ6_K);
    case FORMAT_Q5_0: return (int)sizeof(BlockQ5_0);
    case FORMAT_Q5_1: return (int)sizeof(BlockQ5_1);
    default: return 0;
    }
}

/* pack_formats.c: radixrt_pack_format_rows' contract for the formats this layout serves */
int kquant_pack_rows(int format, const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out,
                     int num_threads);
/* kquant_matmul_portable.c: the formats this layout serves, radixrt_format_matmul_tiles' contract */
void kquant_matmul_tiles_portable(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                  int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                  int64_t first_tile, int64_t last_tile);
int64_t kquant_matmul_scratch_bytes_portable(int64_t m, int64_t num_cols);
/* rows [first_row, last_row) as bf16 (the fp32 weight as gguf computes it, rounded once) */
void kquant_dequantize_tiles_bf16(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                  int64_t last_row, uint16_t *out);
/* kquant_matmul_avx512.c (AVX-512 builds only) */
void kquant_matmul_tiles_avx512(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                                int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                int64_t first_tile, int64_t last_tile);
int64_t kquant_matmul_scratch_bytes_avx512(int64_t m, int64_t num_cols);
/* kquant_dequantize_avx512.c (AVX-512 builds only): kquant_dequantize_tiles_bf16's contract and
 * bits; the second for quantized_matmul.c's 4-bit tiles of Q4_0/Q4_1 rows */
void kquant_dequantize_tiles_bf16_avx512(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                         int64_t last_row, uint16_t *out);
void dequantize_nibble_tiles_bf16_avx512(int format, const uint8_t *tiles, int64_t num_cols, int64_t first_row,
                                         int64_t last_row, uint16_t *out);
/* kquant_matmul_avx2.c (AVX2 builds below AVX-512) */
void kquant_matmul_tiles_avx2(int format, const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles,
                              int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                              int64_t first_tile, int64_t last_tile);
int64_t kquant_matmul_scratch_bytes_avx2(int64_t m, int64_t num_cols);

#endif
