/*
 * out = x @ w.T for bf16 activations x [M, K] and a 4-bit weight w [N, K]
 * with one scale d and one offset m per row and group of 32 inputs
 * (w = d * q + m, q in 0..15: GGUF's Q4_0/Q4_1 blocks, as stored).
 *
 * A decode step multiplies a few rows by every weight of the model once.
 * torch's CPU 4-bit kernel dequantizes to float32 and multiplies one row at
 * a time with float32 FMAs: at 8 rows it does 8 times the work of 1, and a
 * batch-8 step of the bundled model spent most of its time there. Here the
 * codes are turned into bf16 integers in registers (exact: 0..15) and
 * multiplied with AVX512-BF16 dot products, 32 products an instruction; the
 * decoded codes are reused for every row of a block of M, and the group's
 * scale and offset are applied once per group:
 *
 *     sum_k x_k w_k  =  sum_g [ d_g * sum_{k in g} q_k x_k  +  m_g * sum_{k in g} x_k ]
 *
 * Products of bf16 values are exact in float32 and the codes are exact, so
 * this is the file's weight times x with float32 accumulation; nothing is
 * rounded to bf16 but the output. Every row runs the same instruction
 * sequence whatever M and the blocking are, so a row's result does not
 * depend on the batch it is in.
 *
 * Layout (`pack_q4` in Python): the N rows in tiles of 16, vector lanes
 * running over the tile's rows. For tile t and group g, 320 bytes:
 *   8 chunks of 32 bytes: chunk c, byte j = 2n + e (row n of the tile, e in 0..1)
 *       low nibble  = q[n][32g + 4c + e]      high nibble = q[n][32g + 4c + 2 + e]
 *   16 fp16 scales d (one per row), 16 fp16 offsets m
 * A zero-extended chunk's low nibbles are then the (row, pair of inputs)
 * layout the dot-product instruction wants, and its high nibbles the next pair.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 16
#define GROUP 32
#define CHUNKS 8
#define BLOCK_BYTES (CHUNKS * 32 + 2 * TILE_ROWS * 2)

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

int radixrt_q4_matmul_available(void) { return 1; }

/* bf16 bit patterns of i & 15: a permute by the 16-bit lanes' low 5 bits decodes a nibble. */
static const uint16_t CODE_TABLE[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
};

static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/*
 * NT consecutive tiles times MB rows of x: 2 * NT * MB independent chains of
 * dot products (a chain per tile, row and nibble), enough to hide the
 * instruction's latency at M = 1 by taking 4 tiles at once.
 */
static inline __attribute__((always_inline)) void tile_block(
    const uint8_t *tiles, int64_t groups, const uint16_t *x, int64_t x_stride, const float *x_sums,
    int64_t tile, int nt, int mb, float *out, int64_t out_stride, uint16_t *out_bf16, int accumulate
) {
    const __m512i table = _mm512_loadu_si512(CODE_TABLE);
    __m512 acc[4][4];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 low[4][4], high[4][4];
        for (int t = 0; t < nt; t++)
            for (int r = 0; r < mb; r++) low[t][r] = high[t][r] = _mm512_setzero_ps();
        for (int c = 0; c < CHUNKS; c++) {
            for (int t = 0; t < nt; t++) {
                const uint8_t *chunk = tiles + ((tile + t) * groups + g) * BLOCK_BYTES + 32 * c;
                __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)chunk));
                __m512bh low_codes = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
                __m512bh high_codes = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
                for (int r = 0; r < mb; r++) {
                    const uint16_t *xs = x + r * x_stride + g * GROUP + 4 * c;
                    low[t][r] = _mm512_dpbf16_ps(low[t][r], low_codes, (__m512bh)_mm512_set1_epi32(load_pair(xs)));
                    high[t][r] = _mm512_dpbf16_ps(high[t][r], high_codes, (__m512bh)_mm512_set1_epi32(load_pair(xs + 2)));
                }
            }
        }
        for (int t = 0; t < nt; t++) {
            const uint8_t *block = tiles + ((tile + t) * groups + g) * BLOCK_BYTES;
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + CHUNKS * 32)));
            __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + CHUNKS * 32 + 32)));
            for (int r = 0; r < mb; r++) {
                acc[t][r] = _mm512_fmadd_ps(scale, _mm512_add_ps(low[t][r], high[t][r]), acc[t][r]);
                acc[t][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[r * groups + g]), acc[t][r]);
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        for (int r = 0; r < mb; r++) {
            int64_t column = (tile + t) * TILE_ROWS;
            if (out_bf16 != NULL) {
                _mm256_storeu_si256((__m256i *)(out_bf16 + r * out_stride + column),
                                    (__m256i)_mm512_cvtneps_pbh(acc[t][r]));
            } else {
                float *dst = out + r * out_stride + column;
                __m512 value = accumulate ? _mm512_add_ps(_mm512_loadu_ps(dst), acc[t][r]) : acc[t][r];
                _mm512_storeu_ps(dst, value);
            }
        }
    }
}

/* The block shapes, each its own unrolled code: (tiles, rows) = (4, 1), (2, 2), (1, 4). */
static void run_block(const uint8_t *tiles, int64_t groups, const uint16_t *x, int64_t x_stride,
                      const float *x_sums, int64_t tile, int nt, int mb, float *out, uint16_t *out_bf16,
                      int64_t out_stride, int accumulate) {
#define CASE(NT, MB) \
    if (nt == NT && mb == MB) { \
        tile_block(tiles, groups, x, x_stride, x_sums, tile, NT, MB, out, out_stride, out_bf16, accumulate); \
        return; \
    }
    CASE(4, 1) CASE(2, 1) CASE(1, 1) CASE(2, 2) CASE(1, 2) CASE(1, 4) CASE(1, 3)
#undef CASE
}

/*
 * out[r] (fp32, or bf16 when out_bf16 is not NULL; fp32 can be added to
 * instead of overwritten) = x[r] @ w.T for r < m. num_rows % 16 == 0 and
 * num_cols % 32 == 0 (the caller checks). Returns 0, or -1 without memory.
 */
int radixrt_q4_matmul_bf16(
    const uint16_t *x, int64_t x_stride, int64_t m,
    const uint8_t *tiles, int64_t num_rows, int64_t num_cols,
    float *out, uint16_t *out_bf16, int accumulate, int num_threads
) {
    const int64_t groups = num_cols / GROUP, num_tiles = num_rows / TILE_ROWS;
    float *x_sums = malloc(sizeof(float) * (size_t)(m * groups));
    if (x_sums == NULL) return -1;
    const __m512 ones = _mm512_castsi512_ps(_mm512_set1_epi16((short)0x3F80));
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            __m512bh values = (__m512bh)_mm512_loadu_si512(x + r * x_stride + g * GROUP);
            x_sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), values, (__m512bh)ones));
        }
    }
    /* Few rows: blocks of tiles, so the weights are read once. More rows: blocks of 4 rows per tile. */
    const int nt = m == 1 ? 4 : m == 2 ? 2 : 1;
    const int64_t tile_blocks = (num_tiles + nt - 1) / nt;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < tile_blocks; b++) {
        int64_t tile = b * nt;
        int block_tiles = tile + nt <= num_tiles ? nt : (int)(num_tiles - tile);
        for (int64_t r = 0; r < m;) {
            int mb = m - r >= 4 ? 4 : (int)(m - r);
            if (block_tiles == nt || mb > 1) {
                run_block(tiles, groups, x + r * x_stride, x_stride, x_sums + r * groups, tile, block_tiles, mb,
                          out == NULL ? NULL : out + r * num_rows, out_bf16 == NULL ? NULL : out_bf16 + r * num_rows,
                          num_rows, accumulate);
            } else {
                for (int t = 0; t < block_tiles; t++)
                    run_block(tiles, groups, x + r * x_stride, x_stride, x_sums + r * groups, tile + t, 1, mb,
                              out == NULL ? NULL : out + r * num_rows,
                              out_bf16 == NULL ? NULL : out_bf16 + r * num_rows, num_rows, accumulate);
            }
            r += mb;
        }
    }
    free(x_sums);
    return 0;
}

#else

int radixrt_q4_matmul_available(void) { return 0; }

int radixrt_q4_matmul_bf16(
    const uint16_t *x, int64_t x_stride, int64_t m,
    const uint8_t *tiles, int64_t num_rows, int64_t num_cols,
    float *out, uint16_t *out_bf16, int accumulate, int num_threads
) {
    (void)x; (void)x_stride; (void)m; (void)tiles; (void)num_rows; (void)num_cols;
    (void)out; (void)out_bf16; (void)accumulate; (void)num_threads;
    return -1;
}

#endif
