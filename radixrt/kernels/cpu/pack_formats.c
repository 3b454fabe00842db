/*
 * GGUF Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 rows repacked straight from the file's blocks into
 * format_layout.h's tiles: codes split into the nibble and high-bit planes, K-quant scales
 * unpacked to bytes (lane = row), the fp16 scales copied as stored. No value is rounded, so no
 * file block is refused. Rows come by address, so a caller fuses projections and reorders rows.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"

/* One row's unit: its codes q (0..15, 0..31 or 0..63 as stored), sub-block scales and mins
 * (K-quants), d and the second fp16 (dmin or m). */
typedef struct {
    uint8_t q[QK_K];
    int16_t sc[QK_K / 16], mins[QK_K / 32];
    uint16_t d, second;
} RowUnit;

/* Q4_K/Q5_K sub-block j's 6-bit scale and min (formats.h) */
static void k_scale_min(const uint8_t *scales, int j, int16_t *sc, int16_t *min) {
    if (j < 4) {
        *sc = scales[j] & 63, *min = scales[j + 4] & 63;
    } else {
        *sc = (int16_t)((scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4));
        *min = (int16_t)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

static void read_unit(int format, const uint8_t *src, RowUnit *u) {
    switch (format) {
    case FORMAT_Q4_K:
    case FORMAT_Q5_K: {
        const int five = format == FORMAT_Q5_K;
        const uint8_t *scales = src + 4, *qh = src + 4 + K_SCALE_BYTES;
        const uint8_t *qs = five ? qh + QK_K / 8 : qh;
        memcpy(&u->d, src, 2), memcpy(&u->second, src + 2, 2);
        for (int j = 0; j < 8; j++) k_scale_min(scales, j, &u->sc[j], &u->mins[j]);
        for (int i = 0; i < 4; i++)
            for (int l = 0; l < 32; l++) {
                const uint8_t byte = qs[32 * i + l];
                u->q[64 * i + l] = (uint8_t)((byte & 15) | (five ? ((qh[l] >> (2 * i)) & 1) << 4 : 0));
                u->q[64 * i + 32 + l] = (uint8_t)((byte >> 4) | (five ? ((qh[l] >> (2 * i + 1)) & 1) << 4 : 0));
            }
        break;
    }
    case FORMAT_Q6_K: {
        const BlockQ6_K *b = (const BlockQ6_K *)src;
        memcpy(&u->d, &b->d, 2);
        for (int j = 0; j < 16; j++) u->sc[j] = b->scales[j];
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t low = b->ql[64 * h + l + 32 * (s & 1)];
                    u->q[128 * h + 32 * s + l] = (uint8_t)((s < 2 ? low & 15 : low >> 4) |
                                                           ((b->qh[32 * h + l] >> (2 * s)) & 3) << 4);
                }
        break;
    }
    default: {  /* Q5_0, Q5_1: d (m) | qh (4 bytes, little-endian) | qs */
        const int offset = format == FORMAT_Q5_1;
        uint32_t qh;
        memcpy(&u->d, src, 2);
        if (offset) memcpy(&u->second, src + 2, 2);
        memcpy(&qh, src + 2 + 2 * offset, 4);
        const uint8_t *qs = src + 6 + 2 * offset;
        for (int j = 0; j < 16; j++) {
            u->q[j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
            u->q[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
    }
    }
}

/* Row n's unit into the tile's unit `out`. */
static void write_unit(int format, const RowUnit *u, int n, uint8_t *out) {
    const int groups = layout_groups(format), high = layout_high_bytes(format);
    for (int g = 0; g < groups; g++) {
        const uint8_t *q = u->q + LAYOUT_GROUP * g;
        uint8_t *high_plane = out + layout_high_at(format) + g * high;
        for (int c = 0; c < 8; c++)
            for (int e = 0; e < 2; e++) {
                const int lane = 2 * n + e;
                const uint8_t a = q[4 * c + e], b = q[4 * c + 2 + e];
                out[LAYOUT_NIBBLE_BYTES * g + 32 * c + lane] = (uint8_t)((a & 15) | (b & 15) << 4);
                if (high == 64) {  /* byte L of half c / 4: bits 2 (c % 4) (A) and + 1 (B) */
                    uint8_t *byte = high_plane + 32 * (c / 4) + lane;
                    *byte = (uint8_t)(*byte | ((a >> 4) & 1) << (2 * (c % 4)) | ((b >> 4) & 1) << (2 * (c % 4) + 1));
                } else if (high == 128) {  /* byte L of pair c / 2: bits 4 (c % 2) (A, 2 bits), + 2 (B) */
                    uint8_t *byte = high_plane + 32 * (c / 2) + lane;
                    *byte = (uint8_t)(*byte | ((a >> 4) & 3) << (4 * (c % 2)) | ((b >> 4) & 3) << (4 * (c % 2) + 2));
                }
            }
    }
    uint8_t *scales = out + layout_scales_at(format);
    if (format == FORMAT_Q6_K) {
        for (int j = 0; j < 16; j++) scales[16 * j + n] = (uint8_t)(int8_t)u->sc[j];
    } else if (format == FORMAT_Q4_K || format == FORMAT_Q5_K) {
        for (int j = 0; j < 8; j++) scales[16 * j + n] = (uint8_t)u->sc[j], scales[128 + 16 * j + n] = (uint8_t)u->mins[j];
    }
    uint8_t *d = out + layout_d_at(format);
    memcpy(d + 2 * n, &u->d, 2);
    if (layout_has_offset(format)) memcpy(d + 32 + 2 * n, &u->second, 2);
}

int kquant_pack_rows(int format, const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out,
                     int num_threads) {
    if (!layout_serves(format) || num_rows % LAYOUT_TILE_ROWS || num_cols % layout_unit_inputs(format) ||
        num_rows < 0 || num_cols <= 0)
        return -2;
    const int64_t tiles = num_rows / LAYOUT_TILE_ROWS, units = num_cols / layout_unit_inputs(format);
    const int64_t unit_bytes = layout_unit_bytes(format), block_bytes = layout_file_block_bytes(format);
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        RowUnit unit;
        for (int64_t u = 0; u < units; u++) {
            uint8_t *tile_unit = out + (t * units + u) * unit_bytes;
            memset(tile_unit, 0, (size_t)unit_bytes);  /* the high planes are or-ed into */
            for (int n = 0; n < LAYOUT_TILE_ROWS; n++) {
                read_unit(format, (const uint8_t *)(intptr_t)rows[t * LAYOUT_TILE_ROWS + n] + u * block_bytes, &unit);
                write_unit(format, &unit, n, tile_unit);
            }
        }
    }
    return 0;
}
