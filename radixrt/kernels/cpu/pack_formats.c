/*
 * GGUF Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 rows repacked straight from the file's blocks into
 * format_layout.h's tiles: codes split into the nibble and high-bit planes, K-quant scales
 * unpacked to bytes (lane = row), the fp16 scales copied as stored. No value is rounded, so no
 * file block is refused. Rows come by address, so a caller fuses projections and reorders rows.
 */
#include <stdint.h>
#include <string.h>
#ifdef __BMI2__
#include <immintrin.h>
#endif

#include "format_layout.h"

/* A tile's unit, decoded row by row into what the layout stores. The nibble and high planes are
 * 16-bit lanes: word x of the planes (x = 8 g + c in the nibbles, then the high plane's words)
 * holds lanes 2 n and 2 n + 1, i.e. row n's two bytes, so row n's words are written here as
 * words[n][x] and the planes are their transpose, word x * 16 + n. */
#define MAX_WORDS (8 * (8 + 4))  /* a K-quant unit: 8 groups of 8 nibble words and up to 4 high words */
typedef struct {
    uint16_t words[LAYOUT_TILE_ROWS][MAX_WORDS];
    int8_t sc[LAYOUT_TILE_ROWS][QK_K / 16];
    uint8_t mins[LAYOUT_TILE_ROWS][QK_K / 32];
    uint16_t d[LAYOUT_TILE_ROWS], second[LAYOUT_TILE_ROWS];
} TileUnit;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Q4_K/Q5_K sub-block j's 6-bit scale and min (formats.h) */
ALWAYS_INLINE void k_scale_min(const uint8_t *scales, int j, int8_t *sc, uint8_t *min) {
    if (j < 4) {
        *sc = (int8_t)(scales[j] & 63), *min = scales[j + 4] & 63;
    } else {
        *sc = (int8_t)((scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4));
        *min = (uint8_t)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

/* A chunk's nibble word from the 4 bytes holding its codes 0..3 (byte j: code j in its low
 * nibble, or in its high one with `high`): byte e = code e | code 2 + e << 4. */
ALWAYS_INLINE uint16_t nibble_word(const uint8_t *bytes, int high) {
    uint32_t w;
    memcpy(&w, bytes, 4);
    return (uint16_t)(high ? ((w >> 4) & 0x0F0F) | ((w >> 16) & 0xF0F0) : (w & 0x0F0F) | ((w >> 12) & 0xF0F0));
}

/* The bits of `value` under `mask`, packed to the low end (BMI2's pext, or its loop). */
ALWAYS_INLINE uint64_t gather_bits(uint64_t value, uint64_t mask) {
#ifdef __BMI2__
    return _pext_u64(value, mask);
#else
    uint64_t out = 0;
    for (int bit = 0; mask; mask &= mask - 1) {
        out |= ((value >> __builtin_ctzll(mask)) & 1) << bit++;
    }
    return out;
#endif
}

/* Row n of the unit from its file block `src`; `format` is a constant where this is inlined, so
 * each format decodes in branch-free loops. High words: Q5, half h of group g, byte e bit m =
 * bit 4 of code 16 h + 2 m + e; Q6_K, pair p of group g, byte e bits 2 m, 2 m + 1 = bits 4, 5
 * of code 8 p + 2 m + e (format_layout.h's planes, regrouped by lane). */
ALWAYS_INLINE void read_row(int format, const uint8_t *src, TileUnit *t, int n) {
    uint16_t *words = t->words[n];
    switch (format) {
    case FORMAT_Q4_K:
    case FORMAT_Q5_K: {
        const int five = format == FORMAT_Q5_K;
        const uint8_t *scales = src + 4, *qh = src + 4 + K_SCALE_BYTES;
        const uint8_t *qs = five ? qh + QK_K / 8 : qh;
        memcpy(&t->d[n], src, 2), memcpy(&t->second[n], src + 2, 2);
        for (int j = 0; j < 8; j++) k_scale_min(scales, j, &t->sc[n][j], &t->mins[n][j]);
        for (int i = 0; i < 4; i++)  /* qs[32 i + l]: code l of group 2 i (low), of 2 i + 1 (high) */
            for (int c = 0; c < 8; c++) {
                words[8 * (2 * i) + c] = nibble_word(qs + 32 * i + 4 * c, 0);
                words[8 * (2 * i + 1) + c] = nibble_word(qs + 32 * i + 4 * c, 1);
            }
        if (five)  /* bit 4 of code l of group g: bit g of qh[l] */
            for (int h = 0; h < 2; h++) {
                uint64_t low, high;  /* bytes 16 h .. 16 h + 7, + 8 .. + 15 */
                memcpy(&low, qh + 16 * h, 8), memcpy(&high, qh + 16 * h + 8, 8);
                for (int g = 0; g < 8; g++) {
                    const uint64_t a = low >> g, b = high >> g;
                    words[64 + 2 * g + h] = (uint16_t)(gather_bits(a, 0x0001000100010001u) |
                                                       gather_bits(b, 0x0001000100010001u) << 4 |
                                                       gather_bits(a, 0x0100010001000100u) << 8 |
                                                       gather_bits(b, 0x0100010001000100u) << 12);
                }
            }
        break;
    }
    case FORMAT_Q6_K: {  /* group g = 4 H + s: low bits in ql[64 H + 32 (s & 1) + l] (s >= 2: high
                          * nibble), bits 4, 5 of code l: (qh[32 H + l] >> 2 s) & 3 (formats.h) */
        const BlockQ6_K *b = (const BlockQ6_K *)src;
        memcpy(&t->d[n], &b->d, 2);
        for (int j = 0; j < 16; j++) t->sc[n][j] = b->scales[j];
        for (int half = 0; half < 2; half++)
            for (int s = 0; s < 2; s++)  /* groups 4 half + s (low nibbles) and + 2 (high ones) */
                for (int c = 0; c < 8; c++) {
                    const uint8_t *ql = b->ql + 64 * half + 32 * s + 4 * c;
                    words[8 * (4 * half + s) + c] = nibble_word(ql, 0);
                    words[8 * (4 * half + s + 2) + c] = nibble_word(ql, 1);
                }
        for (int g = 0; g < 8; g++) {
            const int half = g / 4, s = g % 4;
            const uint8_t *qh = b->qh + 32 * half;
            for (int p = 0; p < 4; p++) {
                uint64_t bytes;  /* codes 8 p .. 8 p + 7's bits 4, 5 at bits 2 s, 2 s + 1 of each byte */
                memcpy(&bytes, qh + 8 * p, 8);
                bytes >>= 2 * s;
                words[64 + 4 * g + p] = (uint16_t)(gather_bits(bytes, 0x0003000300030003u) |
                                                   gather_bits(bytes, 0x0300030003000300u) << 8);
            }
        }
        break;
    }
    default: {  /* Q5_0, Q5_1: d (m) | qh (4 bytes, little-endian) | qs; code j < 16 in qs[j]'s
                 * low nibble, code 16 + j in its high one, bit 4 of code j: bit j of qh */
        const int offset = format == FORMAT_Q5_1;
        uint32_t qh;
        memcpy(&t->d[n], src, 2);
        if (offset) memcpy(&t->second[n], src + 2, 2);
        memcpy(&qh, src + 2 + 2 * offset, 4);
        const uint8_t *qs = src + 6 + 2 * offset;
        for (int c = 0; c < 8; c++) words[c] = nibble_word(qs + 4 * (c % 4), c >= 4);
        for (int h = 0; h < 2; h++)
            words[8 + h] = (uint16_t)(gather_bits(qh >> (16 * h), 0x5555u) | gather_bits(qh >> (16 * h), 0xAAAAu) << 8);
    }
    }
}

/* The decoded unit into the tile's unit `out`, every byte written once, in order. */
ALWAYS_INLINE void write_unit(int format, const TileUnit *t, uint8_t *out) {
    const int num_words = layout_groups(format) * (8 + layout_high_bytes(format) / 32);
    for (int x = 0; x < num_words; x++) {
        uint16_t lanes[LAYOUT_TILE_ROWS];
        for (int n = 0; n < LAYOUT_TILE_ROWS; n++) lanes[n] = t->words[n][x];
        memcpy(out + 32 * x, lanes, 32);
    }
    uint8_t *scales = out + layout_scales_at(format);
    if (format == FORMAT_Q6_K) {
        for (int j = 0; j < 16; j++)
            for (int n = 0; n < LAYOUT_TILE_ROWS; n++) scales[16 * j + n] = (uint8_t)t->sc[n][j];
    } else if (format == FORMAT_Q4_K || format == FORMAT_Q5_K) {
        for (int j = 0; j < 8; j++)
            for (int n = 0; n < LAYOUT_TILE_ROWS; n++)
                scales[16 * j + n] = (uint8_t)t->sc[n][j], scales[128 + 16 * j + n] = t->mins[n][j];
    }
    uint8_t *d = out + layout_d_at(format);
    memcpy(d, t->d, 32);
    if (layout_has_offset(format)) memcpy(d + 32, t->second, 32);
}

/* Tiles [first, last) of one format: the tile's rows decoded a unit at a time, then written. */
ALWAYS_INLINE void pack_tiles(int format, const int64_t *rows, int64_t units, uint8_t *out, int64_t first,
                              int64_t last) {
    const int64_t unit_bytes = layout_unit_bytes(format), block_bytes = layout_file_block_bytes(format);
    TileUnit unit;
    for (int64_t t = first; t < last; t++)
        for (int64_t u = 0; u < units; u++) {
            for (int n = 0; n < LAYOUT_TILE_ROWS; n++)
                read_row(format, (const uint8_t *)(intptr_t)rows[t * LAYOUT_TILE_ROWS + n] + u * block_bytes, &unit, n);
            write_unit(format, &unit, out + (t * units + u) * unit_bytes);
        }
}

static void pack_q4_k(const int64_t *r, int64_t u, uint8_t *o, int64_t f, int64_t l) { pack_tiles(FORMAT_Q4_K, r, u, o, f, l); }
static void pack_q5_k(const int64_t *r, int64_t u, uint8_t *o, int64_t f, int64_t l) { pack_tiles(FORMAT_Q5_K, r, u, o, f, l); }
static void pack_q6_k(const int64_t *r, int64_t u, uint8_t *o, int64_t f, int64_t l) { pack_tiles(FORMAT_Q6_K, r, u, o, f, l); }
static void pack_q5_0(const int64_t *r, int64_t u, uint8_t *o, int64_t f, int64_t l) { pack_tiles(FORMAT_Q5_0, r, u, o, f, l); }
static void pack_q5_1(const int64_t *r, int64_t u, uint8_t *o, int64_t f, int64_t l) { pack_tiles(FORMAT_Q5_1, r, u, o, f, l); }

/* The tiles are handed to the threads a few at a time, as each thread comes for more: a thread
 * slowed by page faults or by another process on its core does not hold the others up. A
 * tile's bytes depend on its rows alone, so the packed bytes are the same whatever the thread
 * count and split. */
#define PACK_CHUNK_TILES 4
int kquant_pack_rows(int format, const int64_t *rows, int64_t num_rows, int64_t num_cols, uint8_t *out,
                     int num_threads) {
    if (!layout_serves(format) || num_rows % LAYOUT_TILE_ROWS || num_cols % layout_unit_inputs(format) ||
        num_rows < 0 || num_cols <= 0)
        return -2;
    const int64_t tiles = num_rows / LAYOUT_TILE_ROWS, units = num_cols / layout_unit_inputs(format);
    const int64_t chunks = (tiles + PACK_CHUNK_TILES - 1) / PACK_CHUNK_TILES;
    void (*pack)(const int64_t *, int64_t, uint8_t *, int64_t, int64_t) =
        format == FORMAT_Q4_K ? pack_q4_k : format == FORMAT_Q5_K ? pack_q5_k : format == FORMAT_Q6_K ? pack_q6_k
        : format == FORMAT_Q5_0 ? pack_q5_0 : pack_q5_1;
    #pragma omp parallel for num_threads(num_threads > 1 && chunks > 1 ? num_threads : 1) schedule(dynamic, 1)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t first = chunk * PACK_CHUNK_TILES;
        pack(rows, units, out, first, first + PACK_CHUNK_TILES < tiles ? first + PACK_CHUNK_TILES : tiles);
    }
    return 0;
}
