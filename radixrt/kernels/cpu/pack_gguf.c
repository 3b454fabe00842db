/*
 * GGUF Q4_0 / Q4_1 rows repacked straight from the file's blocks into quantized_matmul.c's 4-bit
 * layout: the codes and fp16 scales as stored, no float detour, one pass over the bytes.
 *
 *   GGUF, per row and group g of 32 inputs:  Q4_1: d (fp16) | m (fp16) | 16 bytes    w = d q + m
 *                                            Q4_0: d (fp16) | 16 bytes               w = d (q - 8)
 *       byte j: low nibble q[j], high nibble q[j + 16]
 *   ours, per tile of 16 rows and group: 8 chunks of 32 bytes, byte 2n + e of chunk c (row n):
 *       low nibble q[n][4c + e], high nibble q[n][4c + 2 + e]; 16 fp16 scales d; 16 fp16 offsets m
 *
 * A Q4_0 row's offset is -8 d, exact in fp16 unless it overflows (|d| > 8192): then -1, nothing
 * promised about `out`. Rows come by address, so the caller fuses projections and reorders q/k
 * rows (llama.cpp's rotary order) for free. Tiles go to the threads a few at a time as each
 * comes for more (a thread slowed by faults or another process holds no one up); a tile's bytes
 * are its rows' alone, so every thread count writes the same bytes.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "scalar.h"

#define PACK_TILE_ROWS 16
#define PACK_GROUP 32
#define PACK_GROUP_BYTES (8 * 32 + 2 * PACK_TILE_ROWS * 2)

/* -8 times an fp16 value, as fp16: exact by moving the exponent; -1 where it overflows. */
static int times_minus_8(uint16_t d, uint16_t *out) {
    const uint16_t sign = (uint16_t)((d ^ 0x8000) & 0x8000), exponent = (d >> 10) & 0x1F, mantissa = d & 0x3FF;
    if (exponent == 0x1F) return -1;
    if (exponent == 0 && mantissa == 0) { *out = sign; return 0; }
    if (exponent == 0) {  /* subnormal: mantissa * 2^-24; times 8, renormalized */
        uint32_t m = (uint32_t)mantissa << 3;
        int e = 0;
        if (m < 0x400) { *out = (uint16_t)(sign | m); return 0; }
        while (m >= 0x800) { m >>= 1; e++; }  /* m carried no bits below: mantissa << 3 shifted back */
        *out = (uint16_t)(sign | ((uint16_t)(e + 1) << 10) | (m & 0x3FF));
        return 0;
    }
    if (exponent + 3 >= 0x1F) return -1;
    *out = (uint16_t)(sign | ((exponent + 3) << 10) | mantissa);
    return 0;
}

/*
 * rows [num_rows] addresses of GGUF rows, kinds [num_rows] 0 (Q4_0) or 1 (Q4_1), num_rows a
 * multiple of 16, num_cols of 32; out [num_rows / 16, num_cols / 32, 320] bytes.
 * Returns 0, -1 for an offset fp16 cannot hold, -2 for another shape or kind.
 */
int radixrt_pack_gguf_q4_rows(const int64_t *rows, const uint8_t *kinds, int64_t num_rows, int64_t num_cols,
                              uint8_t *out, int num_threads) {
    if (num_rows % PACK_TILE_ROWS || num_cols % PACK_GROUP) return -2;
    for (int64_t r = 0; r < num_rows; r++)
        if (kinds[r] > 1) return -2;
    const int64_t tiles = num_rows / PACK_TILE_ROWS, groups = num_cols / PACK_GROUP;
    int status = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4) reduction(| : status)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *block = out + (t * groups + g) * PACK_GROUP_BYTES;
            for (int n = 0; n < PACK_TILE_ROWS; n++) {
                const int64_t r = t * PACK_TILE_ROWS + n;
                const int kind = kinds[r];
                const uint8_t *src = (const uint8_t *)(intptr_t)rows[r] + g * (kind ? 20 : 18);
                const uint8_t *qs = src + (kind ? 4 : 2);
                uint16_t d, m;
                memcpy(&d, src, 2);
                if (kind) memcpy(&m, src + 2, 2);
                else status |= times_minus_8(d, &m) ? 1 : 0;
                memcpy(block + 256 + 2 * n, &d, 2);
                memcpy(block + 288 + 2 * n, &m, 2);
                for (int c = 0; c < 8; c++) {
                    for (int e = 0; e < 2; e++) {
                        const int low = 4 * c + e, high = 4 * c + 2 + e;
                        const uint8_t q_low = low < 16 ? qs[low] & 0x0F : qs[low - 16] >> 4;
                        const uint8_t q_high = high < 16 ? qs[high] & 0x0F : qs[high - 16] >> 4;
                        block[32 * c + 2 * n + e] = (uint8_t)(q_low | (q_high << 4));
                    }
                }
            }
        }
    }
    return status ? -1 : 0;
}

/*
 * GGUF Q8_0 rows (per group of 32: d fp16 | 32 int8 codes, w = d q) into the 8-bit layout: per
 * tile and group 8 vectors of 64 bytes, byte 4n + j of vector c = q[n][4c + j] + 128, then the 16
 * rows' fp16 scales. rows [num_rows] addresses; out [num_rows / 16, num_cols / 32, 544] bytes.
 * Returns 0, -2 for a shape that is not whole tiles.
 */
int radixrt_pack_gguf_q8_rows(const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out,
                              int num_threads) {
    if (num_rows % PACK_TILE_ROWS || num_cols % PACK_GROUP) return -2;
    const int64_t tiles = num_rows / PACK_TILE_ROWS, groups = num_cols / PACK_GROUP, block_bytes = 8 * 64 + 32;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *block = out + (t * groups + g) * block_bytes;
            for (int n = 0; n < PACK_TILE_ROWS; n++) {
                const uint8_t *src = (const uint8_t *)(intptr_t)rows[t * PACK_TILE_ROWS + n] + g * 34;
                memcpy(block + 512 + 2 * n, src, 2);
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 4; j++)
                        block[64 * c + 4 * n + j] = (uint8_t)(src[2 + 4 * c + j] ^ 0x80);  /* int8 q + 128 */
            }
        }
    }
    return 0;
}
