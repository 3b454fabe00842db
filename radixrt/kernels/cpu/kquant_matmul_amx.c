/*
 * kquant_matmul_avx512.c's product for the rows amx_rows gives the tiles (whole blocks of
 * AMX_ROWS, and a last partial block of enough rows) on AMX's int8 tiles, where the CPU has
 * them: the same integer sums, so the same bits as the VPDPWSSD blocks (and a row's result
 * still does not depend on its batch). x16 = 256 high + low (high signed, low unsigned bytes:
 * integer_rows' planes); a tile's codes, decoded once for every row
 * of a panel as bytes q - bias, are the B operand: row kk of a sub-block's codes holds each
 * output's 4 codes k = 4 kk .. 4 kk + 3. Per sub-block (32 inputs; Q6_K 16) and 16 rows of x,
 * TDPBSSD and TDPBUSD give the two planes' int32 sums, 256 high_sum + low_sum is the VPDPWSSD
 * blocks' integer, and scale_into applies the same float32 steps.
 */
#include <stdint.h>
#include <string.h>

#include "format_layout.h"
#include "isa.h"

#if RADIXRT_ISA_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include "kquant_avx512.h"
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_PANEL_BYTES (1 << 20)  /* a panel's byte planes: half of a core's L2 on the CPUs with AMX */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux lets a process use the tile registers only after it asks (the first tile instruction
 * faults otherwise): asked once; where refused, the VPDPWSSD blocks serve every step. */
static int amx_granted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void ask_for_amx(void) { amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }
int kquant_amx_usable(void) {
    pthread_once(&amx_once, ask_for_amx);
    return amx_granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* tmm0, tmm1 and tmm5, tmm6: the high and low planes' int32 sums, 16 x 16; tmm2, tmm3: the planes'
 * 16 rows of `inputs` bytes; tmm4: the codes, inputs / 4 rows of 16 outputs x 4 */
static void configure_tiles(int inputs) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 2; i++) config.colsb[i] = config.colsb[i + 5] = 64, config.rows[i] = config.rows[i + 5] = AMX_ROWS;
    for (int i = 2; i < 4; i++) config.colsb[i] = (uint16_t)inputs, config.rows[i] = AMX_ROWS;
    config.colsb[4] = 64, config.rows[4] = (uint8_t)(inputs / 4);
    _tile_loadconfig(&config);
}

static inline __m512i shifted(__m512i v, int bits) {
    return bits > 0 ? _mm512_slli_epi32(v, bits) : bits < 0 ? _mm512_srli_epi32(v, -bits) : v;
}

/*
 * Group g of a unit as 8 rows of 64 code bytes, row c = chunk c: a lane pair's 16 bits hold
 * q0 | q2 << 4 | q1 << 8 | q3 << 12 (format_layout.h), wanted as bytes q0, q1, q2, q3, so
 * (w | w << 12) & 0x0F0F0F0F; the high planes' bits move beside them the same way.
 */
static inline __attribute__((always_inline)) void decode_group_bytes(int format, const uint8_t *unit, int g,
                                                                    int8_t *out) {
    const int high_bytes = layout_high_bytes(format);
    const int bias = format == FORMAT_Q6_K ? 32 : format == FORMAT_Q5_0 ? 16 : 0;
    const uint8_t *plane = unit + layout_high_at(format) + high_bytes * g;
    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
        const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(unit + LAYOUT_NIBBLE_BYTES * g + 32 * c)));
        __m512i codes = _mm512_and_si512(_mm512_or_si512(words, _mm512_slli_epi32(words, 12)), _mm512_set1_epi32(0x0F0F0F0F));
        if (high_bytes == 64) {  /* q0, q2's bit 4 at 2 j, 2 j + 1; q1, q3's 8 higher (j = c % 4) */
            const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(plane + 32 * (c / 4))));
            const int j = c % 4;
            codes = _mm512_or_si512(codes, _mm512_and_si512(shifted(high, 4 - 2 * j), _mm512_set1_epi32(0x00001010)));
            codes = _mm512_or_si512(codes, _mm512_and_si512(shifted(high, 19 - 2 * j), _mm512_set1_epi32(0x10100000)));
        } else if (high_bytes == 128) {  /* q0, q2's bits 4, 5 at 4 j, 4 j + 2; q1, q3's 8 higher (j = c % 2) */
            const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(plane + 32 * (c / 2))));
            const int j = c % 2;
            codes = _mm512_or_si512(codes, _mm512_and_si512(shifted(high, 4 - 4 * j), _mm512_set1_epi32(0x00003030)));
            codes = _mm512_or_si512(codes, _mm512_and_si512(shifted(high, 18 - 4 * j), _mm512_set1_epi32(0x30300000)));
        }
        if (bias) codes = _mm512_sub_epi8(codes, _mm512_set1_epi8((char)bias));
        _mm512_storeu_si512(out + 64 * c, codes);
    }
}

/* One tile times rows [first_row, last_row) of x (first_row a multiple of AMX_ROWS; a partial
 * last block's tile products run on its zero rows, which are neither scaled nor stored); codes:
 * the tile's decoded bytes (K * 16), sums: 2 x 16 x 16 int32. */
static inline __attribute__((always_inline)) void amx_tile(int format, const uint8_t *tiles, int64_t units,
                                                          const IntegerRows *rows, int64_t first_row,
                                                          int64_t last_row, int64_t num_cols, int64_t tile,
                                                          int8_t *codes, int32_t *sums, float *out,
                                                          int64_t out_stride, uint16_t *out_bf16) {
    const int unit_bytes = layout_unit_bytes(format), unit_groups = layout_groups(format);
    const int subs = format == FORMAT_Q6_K ? 2 : 1, sub_inputs = LAYOUT_GROUP / subs;
    const int64_t all_groups = num_cols / LAYOUT_GROUP;
    const uint8_t *first = tiles + tile * units * unit_bytes;
    const int lines = (unit_bytes + 63) / 64;
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *unit = first + u * unit_bytes;
        for (int g = 0; g < unit_groups; g++) {
            /* the stream PREFETCH_BYTES on (into L1) and three times that (into L2), a group's
             * share of the unit's lines with each group; past the tile's end lies the next tile */
            for (int line = g * lines / unit_groups; line < (g + 1) * lines / unit_groups; line++) {
                _mm_prefetch((const char *)unit + 64 * line + PREFETCH_BYTES, _MM_HINT_NTA);
                _mm_prefetch((const char *)unit + 64 * line + 3 * PREFETCH_BYTES, _MM_HINT_T1);
            }
            decode_group_bytes(format, unit, g, codes + (u * unit_groups + g) * 8 * 64);
        }
    }
    const int64_t steps = units * unit_groups * subs;  /* sub-blocks of the tile's inputs */
    for (int64_t r0 = first_row; r0 < last_row; r0 += AMX_ROWS) {
        const int live = last_row - r0 < AMX_ROWS ? (int)(last_row - r0) : AMX_ROWS;
        __m512 acc[AMX_ROWS];
        for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
        /* Sub-block i's products go to tmm0, tmm1 (i even) or tmm5, tmm6 (odd) while sub-block
         * i - 1's sums are stored and scaled: the tiles' work overlaps the vector work. */
        for (int64_t i = 0; i <= steps; i++) {
            if (i < steps) {
                const int64_t at = plane_at(r0, sub_inputs * i, num_cols);
                const int8_t *own = codes + i * sub_inputs * 16;
                _tile_loadd(2, rows->high + at, LAYOUT_GROUP);
                _tile_loadd(3, rows->low + at, LAYOUT_GROUP);
                _tile_loadd(4, own, 64);
                if (i & 1) {
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_dpbssd(5, 2, 4);
                    _tile_dpbusd(6, 3, 4);
                } else {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_dpbssd(0, 2, 4);
                    _tile_dpbusd(1, 3, 4);
                }
            }
            if (i == 0) continue;
            const int64_t j = i - 1, group = j / subs, u = group / unit_groups;
            const int g = (int)(group % unit_groups), h = (int)(j % subs);
            int32_t *own = sums + (j & 1) * 2 * AMX_ROWS * 16;
            if (j & 1) {
                _tile_stored(5, own, 64);
                _tile_stored(6, own + AMX_ROWS * 16, 64);
            } else {
                _tile_stored(0, own, 64);
                _tile_stored(1, own + AMX_ROWS * 16, 64);
            }
            __m512i dots[AMX_ROWS];
            for (int r = 0; r < live; r++)
                dots[r] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(own + 16 * r), 8),
                                           _mm512_loadu_si512(own + AMX_ROWS * 16 + 16 * r));
            const int64_t first_group = r0 * all_groups + u * unit_groups;
            scale_into(format, first + u * unit_bytes, subs * g + h, g, acc, dots, live, rows->scale + first_group,
                       h + 1 == subs ? rows->offset_x + first_group : NULL, all_groups);
        }
        for (int r = 0; r < live; r++) {
            const int64_t at = (r0 + r) * out_stride + tile * LAYOUT_TILE_ROWS;
            if (out_bf16 != NULL)
                _mm256_storeu_si256((__m256i *)(out_bf16 + at), (__m256i)_mm512_cvtneps_pbh(acc[r]));
            else
                _mm512_storeu_ps(out + at, acc[r]);
        }
    }
}

static void amx_tiles(int format, const uint8_t *tiles, int64_t units, const IntegerRows *rows, int64_t first_row,
                      int64_t last_row, int64_t num_cols, int64_t tile, int8_t *codes, int32_t *sums, float *out,
                      int64_t out_stride, uint16_t *out_bf16) {
    switch (format) {
#define CASE(F) \
    case F: \
        amx_tile(F, tiles, units, rows, first_row, last_row, num_cols, tile, codes, sums, out, out_stride, out_bf16); \
        break;
    CASE(FORMAT_Q4_K) CASE(FORMAT_Q5_K) CASE(FORMAT_Q6_K) CASE(FORMAT_Q5_0) CASE(FORMAT_Q5_1)
#undef CASE
    default: break;
    }
}

int64_t kquant_amx_scratch_bytes(int64_t num_cols) {
    return 64 + 16 * num_cols + 4 * AMX_ROWS * 16 * (int64_t)sizeof(int32_t);
}

void kquant_amx_tiles(int format, const uint8_t *tiles, const IntegerRows *rows, int64_t full, int64_t num_cols,
                      int64_t first_tile, int64_t last_tile, void *scratch, float *out, int64_t out_stride,
                      uint16_t *out_bf16) {
    const int64_t units = num_cols / layout_unit_inputs(format);
    int8_t *codes = (int8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *sums = (int32_t *)(codes + 16 * num_cols);
    /* Panels of rows whose byte planes stay in L2 while every tile of the range meets them (a
     * tile's codes are decoded again for each panel). */
    int64_t panel = AMX_PANEL_BYTES / (2 * num_cols) / AMX_ROWS * AMX_ROWS;
    if (panel < AMX_ROWS) panel = AMX_ROWS;
    configure_tiles(format == FORMAT_Q6_K ? 16 : LAYOUT_GROUP);
    for (int64_t r0 = 0; r0 < full; r0 += panel)
        for (int64_t tile = first_tile; tile < last_tile; tile++)
            amx_tiles(format, tiles, units, rows, r0, r0 + panel < full ? r0 + panel : full, num_cols, tile, codes,
                      sums, out, out_stride, out_bf16);
    _tile_release();
}

#elif RADIXRT_ISA_AVX512
#include "kquant_avx512.h"

int kquant_amx_usable(void) { return 0; }
int64_t kquant_amx_scratch_bytes(int64_t num_cols) {
    (void)num_cols;
    return 0;
}
void kquant_amx_tiles(int format, const uint8_t *tiles, const IntegerRows *rows, int64_t full, int64_t num_cols,
                      int64_t first_tile, int64_t last_tile, void *scratch, float *out, int64_t out_stride,
                      uint16_t *out_bf16) {
    (void)format, (void)tiles, (void)rows, (void)full, (void)num_cols, (void)first_tile, (void)last_tile, (void)scratch;
    (void)out, (void)out_stride, (void)out_bf16;
}
#endif
