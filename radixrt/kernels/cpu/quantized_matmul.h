/*
 * The quantized matmul's tile layout and what its versions share (quantized_matmul.c holds the
 * entry points and picks the version this build's instruction set runs).
 *
 * A weight w [N, K] is kept as GGUF stores it, with a scale d (and offset m) per row and group of
 * 32 inputs:
 *   4-bit (Q4_0/Q4_1 blocks):  w = d * q + m, q in 0..15
 *   8-bit (Q8_0 blocks):       w = d * q,     q in -128..127
 * The N rows are in tiles of 16; a group's 32 inputs in 8 chunks of 4 (k = 32 g + 4 c + j). For
 * tile t and group g, one block:
 *   4-bit, 320 bytes: 8 chunks of 32 bytes, byte 2n + e (row n, e in 0..1):
 *       low nibble q[n][32g + 4c + e], high nibble q[n][32g + 4c + 2 + e];
 *       16 fp16 scales d, 16 fp16 offsets m
 *   8-bit, 544 bytes: 8 vectors of 64 bytes, vector c byte 4n + j = q[n][32g + 4c + j] + 128
 *       (unsigned); 16 fp16 scales d
 * The blocks of a tile follow one another (group order), the tiles too. The layout is data:
 * pack_gguf.c writes it, `QuantizedMatmul.pack_*` in Python too, and every version reads it.
 */
#ifndef RADIXRT_CPU_QUANTIZED_MATMUL_H
#define RADIXRT_CPU_QUANTIZED_MATMUL_H

#include <stdint.h>

#include "kernels.h"

#define TILE_ROWS QUANTIZED_TILE_ROWS
#define GROUP 32
#define CHUNKS 8
#define CHUNK_BYTES(bits) ((bits) == 4 ? 32 : 64)
#define BLOCK_BYTES(bits) (CHUNKS * CHUNK_BYTES(bits) + ((bits) == 4 ? 2 : 1) * TILE_ROWS * 2)
#define PREFETCH_BYTES 5120  /* prefetch_next_group */

/* The versions: the same arguments and results as radixrt_quantized_matmul_tiles (kernels.h).
 * The portable one is in every build; a SIMD one only in builds of its level (isa.h). */
typedef void QuantizedTiles(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits,
                            int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                            int64_t first, int64_t last);
QuantizedTiles radixrt_quantized_matmul_tiles_portable;
QuantizedTiles radixrt_quantized_matmul_tiles_avx2;
QuantizedTiles radixrt_quantized_matmul_tiles_avx512;

/*
 * Streaming a weight, a kernel asks for each tile's group `ahead` groups on while it multiplies
 * the current one: line `line` of that group's block when it reads chunk `line` of this one, one
 * request per load, so that a block of nt tiles keeps about PREFETCH_BYTES in flight (the
 * out-of-order window alone sees too little ahead). The hint is non-temporal: the codes are read
 * once a step. Near a tile's end the next block's tile is asked for instead (the tile after this
 * one is in this block, already read). The SIMD kernels (`far`) also ask for the same line three
 * times as far on, into L2, whatever the block's rows: near requests into L1 hold the core's few
 * L1 miss buffers, the far ones fill L2's deeper queue, and a block of several rows waits on
 * memory as a single row does. A 4-bit block is 5 lines over 8 chunks: its far requests go
 * with chunks 2-6, spread over the group's work. In a share's last block the requests run past
 * the thread's tiles; keeping them inside cost more than the stray lines (a check per load).
 * docs/kernels.md, "Quantized matmul: prefetching", has the measurements behind each choice.
 */
static inline __attribute__((always_inline)) const char *group_ahead(const uint8_t *group, int bits, int nt, int64_t g,
                                                                    int64_t groups, int ahead) {
    const int64_t wrap = g + ahead >= groups ? (int64_t)(nt - 1) * groups : 0;  /* into the next block's tile */
    return (const char *)group + (ahead + wrap) * BLOCK_BYTES(bits);
}

static inline __attribute__((always_inline)) void prefetch_next_group(const uint8_t *group, int bits, int line, int nt,
                                                                     int64_t g, int64_t groups, int far) {
    const int ahead = nt * BLOCK_BYTES(bits) >= PREFETCH_BYTES ? 1 : PREFETCH_BYTES / (nt * BLOCK_BYTES(bits));
    const char *near_group = group_ahead(group, bits, nt, g, groups, ahead);
    const char *far_group = group_ahead(group, bits, nt, g, groups, 3 * ahead);
    const int far_line = bits == 4 ? line - 2 : line;  /* a 4-bit block's 5 lines: with chunks 2-6 */
    if (64 * line < BLOCK_BYTES(bits)) __builtin_prefetch(near_group + 64 * line, 0, 0);
    if (far && far_line >= 0 && 64 * far_line < BLOCK_BYTES(bits)) __builtin_prefetch(far_group + 64 * far_line, 0, 2);
    if (line == 0 && BLOCK_BYTES(bits) > 64 * CHUNKS) {
        __builtin_prefetch(near_group + 64 * CHUNKS, 0, 0);
        if (far) __builtin_prefetch(far_group + 64 * CHUNKS, 0, 2);
    }
}

#endif
