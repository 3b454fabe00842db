/*
 * out = x @ w.T for bf16 activations x [M, K] and a weight w [N, K] kept as
 * GGUF stores it, with a scale d (and offset m) per row and group of 32 inputs:
 *   4-bit (Q4_0/Q4_1 blocks):  w = d * q + m, q in 0..15
 *   8-bit (Q8_0 blocks):       w = d * q,     q in -128..127
 *
 * A decode step multiplies a few rows by every weight of the model once.
 * torch's CPU 4-bit kernel dequantizes to float32 and multiplies one row at
 * a time with float32 FMAs: at 8 rows it does 8 times the work of 1, and a
 * batch-8 step of the bundled model spent most of its time there. Here the
 * codes are turned into bf16 integers in registers (exact: |q| <= 128) and
 * multiplied with AVX512-BF16 dot products, 32 products an instruction; the
 * decoded codes are reused for every row of a block of M, and the group's
 * scale and offset are applied once per group:
 *
 *     sum_k x_k w_k  =  sum_g [ d_g * sum_{k in g} q_k x_k  +  m_g * sum_{k in g} x_k ]
 *
 * Products of bf16 values are exact in float32 and the codes are exact, so
 * this is the file's weight times x with float32 accumulation; nothing is
 * rounded to bf16 but the output.
 *
 * 8-bit codes cost 8 instructions per 64 weights that way (widen, convert
 * to float32, narrow to bf16) and bound the LM head's product by
 * instructions rather than memory. They take integer dot products instead,
 * used as loaded: VPDPBUSD multiplies 64 unsigned bytes by 64 signed ones
 * and adds them in fours. Each row's inputs become 16-bit integers per group
 * of 32, x ~ s * x16, s = max|x| / 32639, split into two signed bytes,
 * x16 = 256 hi + lo, so a group's sum is s * (256 sum q hi + sum q lo), two
 * dot products per vector of codes, exact in 32 bits. The rounding of x to
 * x16 is at most s / 2 per input, 1/128 of bf16's own spacing near a group's
 * largest input. (Bytes alone, x8 with s = max|x| / 127 as llama.cpp does,
 * would take one dot product: on this VM 4-bit products read 10-35% faster
 * than in bf16, 8-bit ones 0-9% faster than with two planes; but they
 * moved the bundled model away from the file's: the next-token
 * distribution's KL divergence from float32 arithmetic on the same weights
 * was 0.014-0.020 nats a token against 0.0007-0.0008 with bf16 inputs, and
 * its top token agreed 92-93% of the time against 98-99%
 * (bench/quality_bench.py). The 4-bit codes keep bf16: with two byte planes
 * their products were no faster.)
 *
 * Every row runs the same instruction sequence whatever M and the blocking
 * are, so a row's result does not depend on the batch it is in.
 *
 * Layout (`QuantizedMatmul.pack_*` in Python): the N rows in tiles of 16,
 * vector lanes running over the tile's rows; a group's 32 inputs in 8
 * chunks of 4 (k = 32 g + 4 c + j), each chunk decoding to two vectors of
 * (row, 2 inputs) bf16 pairs, the layout of the dot-product instruction.
 * For tile t and group g:
 *   4-bit, 320 bytes: 8 chunks of 32 bytes, byte 2n + e (row n, e in 0..1):
 *       low nibble q[n][32g + 4c + e], high nibble q[n][32g + 4c + 2 + e];
 *       16 fp16 scales d, 16 fp16 offsets m
 *   8-bit, 544 bytes: 8 vectors of 64 bytes, the operand layout of VPDPBUSD:
 *       vector c byte 4n + j = q[n][32g + 4c + j] + 128 (unsigned); 16 fp16 scales d
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define TILE_ROWS QUANTIZED_TILE_ROWS
#define MAX_BLOCK_TILES 4  /* tiles_per_block */
#define GROUP 32
#define CHUNKS 8
#define CHUNK_BYTES(bits) ((bits) == 4 ? 32 : 64)
#define BLOCK_BYTES(bits) (CHUNKS * CHUNK_BYTES(bits) + ((bits) == 4 ? 2 : 1) * TILE_ROWS * 2)
#define MAX_BYTE_BLOCK_TILES 8  /* 8-bit codes: two accumulators a tile (tiles_per_block) */
#define PREFETCH_BYTES 5120  /* prefetch_next_group */
#define X16_MAX 32639  /* 127 * 256 + 127: hi = (x16 + 128) >> 8 stays in -127..127 */

int64_t radixrt_quantized_tile_bytes(int bits, int64_t num_cols) { return num_cols / GROUP * BLOCK_BYTES(bits); }

/* Scratch for m rows of K inputs: 4-bit, each group's sum x; 8-bit, x16's two bytes and each
 * group's s and sum x16. */
int64_t radixrt_quantized_matmul_scratch_bytes(int64_t m, int64_t num_cols) {
    return m * (2 * num_cols + (num_cols / GROUP) * (int64_t)(sizeof(float) + sizeof(int32_t)));
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <omp.h>

int radixrt_quantized_matmul_available(void) { return 1; }

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
 * Streaming a weight, the kernel asks for each tile's group `ahead` groups on while it multiplies
 * the current one: line `line` of that group's block when it reads chunk `line` of this one, one
 * prefetch per load, so that a block of nt tiles keeps about PREFETCH_BYTES in flight. The
 * out-of-order window alone sees too little ahead (a group of 16 tiles is ~800 instructions), so
 * without it decoding and memory took turns: on the project's 2-core Zen 4 VM one row times a 94
 * MB 4-bit weight read 49 GB/s when the same loads alone read 83 and a float32 sum 70; with the
 * next group asked for, 74 (5 KB ahead for 16 tiles; 10 KB read as fast, 20 KB slower). Asking
 * for a whole group at once stalled on the outstanding misses and bought nothing. Blocks of few
 * tiles (several rows) gain most: a batch-8 step 6.13 -> 5.47 ms when they looked 16 / nt
 * groups ahead rather than one. The hint is non-temporal: the codes are read once a step, and
 * the step was 0.1-1.4% faster than with `prefetcht0` in each of ten A/Bs.
 * Near a tile's end the next block's tile t is asked for instead of the tile after this one
 * (which is in this block, already read): the next block then starts with its codes in flight
 * (a batch-1 step in decode runs 0.8-1.5% faster, three A/Bs at 41-50 GB/s).
 * A single row (`far`: a batch-1 step, memory-bound) also asks for the same line three times as
 * far on, into L2 (`prefetcht1`): a request into L1 holds one of the core's few L1 miss buffers
 * until its line arrives, so the near requests alone kept too little in flight when memory
 * answered fast; the far ones fill L2's deeper queue, and the near ones then mostly find their
 * lines there. Introduced twice as far, with 16 tiles a block: a batch-1 decode run's step
 * 0.944x, 0.949x and 0.947x in the minutes when a float32 sum read 66-78 GB/s, 0.985x, 0.997x
 * and 0.950x at 31-61 GB/s (one process alternating settings); far requests without the near
 * ones 1.09x. With 4 tiles a block (tiles_per_block), three times as far took 0.948x the time of
 * twice in fast minutes (40 rounds), four times 1.000x of three, six 1.045x. Batches of 8 and 32
 * rows, which read each block once for all of them, gained nothing (1.000x, 1.004x), nor did a
 * 512-token prefill (2,274-2,364 against 2,314-2,389 tokens/s).
 * In a share's last block the requests run past the thread's tiles (into the other thread's, or
 * past the weight). Keeping them within the share (a compare and branch each) made a batch-1
 * step 1.076x slower in fast minutes in an A/B of the two builds (185 runs each), and sending
 * them into the thread's share of the next product 1.20-1.22x slower than that; test builds with
 * either switched on and off had shown gains, with the check's instructions in both settings:
 * this function runs once per load of codes.
 * A 4-bit block is 5 lines read over 8 chunks: its far requests go out with chunks 2-6 rather
 * than beside the near ones in chunks 0-4, so the group's requests are spread over its work
 * (0.977x over 54 fast-minute rounds, 0.972x and 0.991x slow; 1 or 3 chunks later 0.982-0.988x).
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
    if (64 * line < BLOCK_BYTES(bits)) _mm_prefetch(near_group + 64 * line, _MM_HINT_NTA);
    if (far && far_line >= 0 && 64 * far_line < BLOCK_BYTES(bits)) _mm_prefetch(far_group + 64 * far_line, _MM_HINT_T1);
    if (line == 0 && BLOCK_BYTES(bits) > 64 * CHUNKS) {
        _mm_prefetch(near_group + 64 * CHUNKS, _MM_HINT_NTA);
        if (far) _mm_prefetch(far_group + 64 * CHUNKS, _MM_HINT_T1);
    }
}

/* A block's results, tile t and row r in acc[t][r]: bf16 when out_bf16 is not NULL, else fp32. */
static inline __attribute__((always_inline)) void store_block(
    __m512 acc[][8], int nt, int mb, int64_t tile, float *out, int64_t out_stride, uint16_t *out_bf16
) {
    _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
            int64_t column = (tile + t) * TILE_ROWS;
            if (out_bf16 != NULL) {
                _mm256_storeu_si256((__m256i *)(out_bf16 + r * out_stride + column),
                                    (__m256i)_mm512_cvtneps_pbh(acc[t][r]));
            } else {
                _mm512_storeu_ps(out + r * out_stride + column, acc[t][r]);
            }
        }
    }
}

/*
 * 4-bit codes: NT consecutive tiles times MB rows of x, NT * MB independent chains of dot
 * products (one per tile and row, in a fixed order), so that 6-8 chains hide
 * the instruction's latency: 2-4 tiles at M = 2-4, 1 tile at M >= 5. Each
 * tile's codes are a stream of their own in memory: a single row (a batch-1
 * step, memory-bound) takes up to 4 tiles at once (tiles_per_block).
 */
static inline __attribute__((always_inline)) void nibble_block(
    const uint8_t *tiles, int64_t groups, const uint16_t *x, int64_t x_stride, const float *x_sums,
    int64_t tile, int nt, int mb, float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int bits = 4;
    const __m512i table = _mm512_loadu_si512(CODE_TABLE);
    __m512 acc[MAX_BLOCK_TILES][8];
    _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 dots[MAX_BLOCK_TILES][8];
        _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dots[t][r] = _mm512_setzero_ps();
        for (int c = 0; c < CHUNKS; c++) {
            _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++) {
                const uint8_t *group = tiles + ((tile + t) * groups + g) * BLOCK_BYTES(bits);
                prefetch_next_group(group, bits, c, nt, g, groups, mb == 1);
                __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(group + CHUNK_BYTES(bits) * c)));
                __m512bh low_codes = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
                __m512bh high_codes = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
                _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                    const uint16_t *xs = x + r * x_stride + g * GROUP + 4 * c;
                    dots[t][r] = _mm512_dpbf16_ps(dots[t][r], low_codes, (__m512bh)_mm512_set1_epi32(load_pair(xs)));
                    dots[t][r] = _mm512_dpbf16_ps(dots[t][r], high_codes, (__m512bh)_mm512_set1_epi32(load_pair(xs + 2)));
                }
            }
        }
        _Pragma("GCC unroll 16") for (int t = 0; t < nt; t++) {
            const uint8_t *scales = tiles + ((tile + t) * groups + g) * BLOCK_BYTES(bits) + CHUNKS * CHUNK_BYTES(bits);
            __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_fmadd_ps(scale, dots[t][r], acc[t][r]);
            __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++)
                acc[t][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[r * groups + g]), acc[t][r]);
        }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

/*
 * Tiles in the next block for mb rows, `left` tiles to go. Several rows: about 8 chains. One
 * row: 4, 2 or 1 tiles of 4-bit codes (8-bit: 8, 4, 2 or 1), the most there are left, each an
 * independent stream of codes in memory. Before the weights were asked for from L2 as well
 * (prefetch_next_group), a row needed many streams to keep enough in flight: 16 tiles a block
 * took 2% less time than 8 in a batch-1 step. With those requests, fewer streams each asked for
 * further ahead read faster: a batch-1 decode run's step (one process alternating settings,
 * rounds split by a float32 sum's reading) took 0.941x the time with 4 tiles against 16 when the
 * sum read over 62 GB/s (40 rounds), 0.934x in another A/B (23 rounds, 0.963x in its 17 slow
 * ones), 8 tiles 0.941x, 2 tiles 1.006x; and with the far requests three times as far as the
 * near ones instead of twice, 4 tiles against 16 and twice: 0.892x (40 rounds), 0.887x (17) and
 * 0.936x (20) in fast minutes, 0.934x, 0.953x and 0.984x (60 rounds) in slow ones; 8 tiles so
 * 0.914x. The 8-bit head keeps 8 (4 tiles with it: 1.012x) and three times as far (twice: 1.022x).
 * Those were settings of one test build; as two whole builds alternating, this change took 0.922x
 * the time in fast minutes (1.606 -> 1.480 ms, 175 runs each), 0.969x and 0.972x in slow ones.
 */
static inline int tiles_per_block(int mb, int bits, int64_t left) {
    if (mb == 1) {
        int nt = bits == 4 ? MAX_BLOCK_TILES : MAX_BYTE_BLOCK_TILES;
        while (nt > left) nt /= 2;
        return nt;
    }
    const int nt = mb == 2 ? 4 : mb <= 4 ? 2 : 1;
    return nt <= left ? nt : 1;
}

typedef struct {
    int8_t *hi, *lo;  /* [m][K]: x16 = 256 hi + lo */
    float *scale;  /* [m][groups]: s */
    int32_t *sum16;  /* [m][groups]: sum x16 */
} ByteRows;

/* The m rows of x as 16-bit integers in two byte planes (see the top of the file). */
static ByteRows byte_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t num_cols, void *scratch) {
    const int64_t groups = num_cols / GROUP;
    int8_t *bytes = scratch;
    float *scale = (float *)(bytes + 2 * m * num_cols);
    ByteRows rows = {bytes, bytes + m * num_cols, scale, (int32_t *)(scale + m * groups)};
    const __m512i limit = _mm512_set1_epi32(X16_MAX), low_limit = _mm512_set1_epi32(-X16_MAX);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const __m512i raw = _mm512_loadu_si512(x + r * x_stride + g * GROUP);
            const __m512 halves[2] = {  /* bf16 -> float32: the bits shifted up */
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16)),
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16)),
            };
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(halves[0]), _mm512_abs_ps(halves[1])));
            const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? (float)X16_MAX / amax : 0.0f);
            rows.scale[r * groups + g] = amax / (float)X16_MAX;
            __m512i total = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                /* |x / s| <= X16_MAX up to the quotient's rounding: clamp before splitting */
                __m512i x16 = _mm512_cvtps_epi32(_mm512_mul_ps(halves[h], inverse));
                x16 = _mm512_max_epi32(_mm512_min_epi32(x16, limit), low_limit);
                const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(x16, _mm512_set1_epi32(128)), 8);
                const int64_t at = r * num_cols + g * GROUP + 16 * h;
                _mm_storeu_si128((__m128i *)(rows.hi + at), _mm512_cvtepi32_epi8(hi));
                const __m512i lo = _mm512_sub_epi32(x16, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(rows.lo + at), _mm512_cvtepi32_epi8(lo));
                total = _mm512_add_epi32(total, x16);
            }
            rows.sum16[r * groups + g] = _mm512_reduce_add_epi32(total);
        }
    }
    return rows;
}

/* Bytes k .. k + 3 of a plane in every 32-bit lane. */
static inline __m512i broadcast4(const int8_t *plane) {
    int32_t v;
    memcpy(&v, plane, sizeof v);
    return _mm512_set1_epi32(v);
}

/*
 * 8-bit codes: NT consecutive tiles times MB rows of x, in integers (see the top of the file).
 * For each group, vector by vector, the block's tiles in turn, so that their streams advance
 * together; a single row takes up to 8 tiles (two accumulators a tile and row: 16 fill half the
 * vector registers).
 */
static inline __attribute__((always_inline)) void byte_block(
    const uint8_t *tiles, int64_t groups, int64_t num_cols, const ByteRows *rows, int64_t tile, int nt, int mb,
    float *out, int64_t out_stride, uint16_t *out_bf16
) {
    const int64_t tile_stride = groups * BLOCK_BYTES(8);
    __m512 acc[MAX_BYTE_BLOCK_TILES][8];
    _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++)
        _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = tiles + (tile * groups + g) * BLOCK_BYTES(8);
        __m512i dot_hi[MAX_BYTE_BLOCK_TILES][8], dot_lo[MAX_BYTE_BLOCK_TILES][8];
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++)
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) dot_hi[t][r] = dot_lo[t][r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int c = 0; c < CHUNKS; c++) {
            _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
                prefetch_next_group(group + t * tile_stride, 8, c, nt, g, groups, mb == 1);
                const __m512i codes = _mm512_loadu_si512(group + t * tile_stride + CHUNK_BYTES(8) * c);
                _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                    const int64_t at = r * num_cols + g * GROUP + 4 * c;
                    dot_hi[t][r] = _mm512_dpbusd_epi32(dot_hi[t][r], codes, broadcast4(rows->hi + at));
                    dot_lo[t][r] = _mm512_dpbusd_epi32(dot_lo[t][r], codes, broadcast4(rows->lo + at));
                }
            }
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < nt; t++) {
            const uint8_t *scales = group + t * tile_stride + CHUNKS * CHUNK_BYTES(8);
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            _Pragma("GCC unroll 8") for (int r = 0; r < mb; r++) {
                /* sum (q + 128) x16 - 128 sum x16 = sum q x16, |.| < 2^28 */
                const int64_t at = r * groups + g;
                const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(dot_hi[t][r], 8), dot_lo[t][r]),
                                                     _mm512_set1_epi32(rows->sum16[at] * 128));
                acc[t][r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(rows->scale[at])),
                                            _mm512_cvtepi32_ps(dot), acc[t][r]);
            }
        }
    }
    store_block(acc, nt, mb, tile, out, out_stride, out_bf16);
}

/* The block shapes and code widths, each its own unrolled code. */
static void run_block(const uint8_t *tiles, int64_t groups, int64_t num_cols, const uint16_t *x, int64_t x_stride,
                      const float *x_sums, const ByteRows *rows, int64_t tile, int nt, int mb, int bits, float *out,
                      uint16_t *out_bf16, int64_t out_stride) {
#define NIBBLES(NT, MB) \
    if (bits == 4 && nt == NT && mb == MB) { \
        nibble_block(tiles, groups, x, x_stride, x_sums, tile, NT, MB, out, out_stride, out_bf16); \
        return; \
    }
#define BYTES(NT, MB) \
    if (bits == 8 && nt == NT && mb == MB) { \
        byte_block(tiles, groups, num_cols, rows, tile, NT, MB, out, out_stride, out_bf16); \
        return; \
    }
#define SHAPES(CASE) \
    CASE(4, 1) CASE(2, 1) CASE(4, 2) CASE(2, 3) CASE(2, 4) \
    CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(1, 5) CASE(1, 6) CASE(1, 7) CASE(1, 8)
    SHAPES(NIBBLES) BYTES(8, 1) SHAPES(BYTES)
#undef SHAPES
#undef BYTES
#undef NIBBLES
}

/* The 4-bit offsets' factor: each row's sum over each group of 32 inputs. */
static void group_sums(const uint16_t *x, int64_t x_stride, int64_t m, int64_t groups, float *x_sums) {
    const __m512 ones = _mm512_castsi512_ps(_mm512_set1_epi16((short)0x3F80));
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            __m512bh values = (__m512bh)_mm512_loadu_si512(x + r * x_stride + g * GROUP);
            x_sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), values, (__m512bh)ones));
        }
    }
}

void radixrt_quantized_matmul_tiles(
    const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first, int64_t last
) {
    const int64_t groups = num_cols / GROUP;
    float *x_sums = scratch;
    ByteRows all = {0};
    if (bits == 4) group_sums(x, x_stride, m, groups, x_sums);
    else all = byte_rows(x, x_stride, m, num_cols, scratch);
    /* Within the run of tiles, a block of tiles is multiplied by every block of 8 rows while its
     * codes are in cache, so the weights are read from memory once. */
    for (int64_t tile = first, nt; tile < last; tile += nt) {
        nt = m <= 8 ? tiles_per_block((int)m, bits, last - tile) : 1;
        for (int64_t r = 0; r < m; r += 8) {
            int mb = m - r >= 8 ? 8 : (int)(m - r);
            const ByteRows rows = bits == 8 ? (ByteRows){all.hi + r * num_cols, all.lo + r * num_cols,
                                                         all.scale + r * groups, all.sum16 + r * groups}
                                            : all;  /* 4-bit: none (and no arithmetic on their NULLs) */
            float *out_rows = out == NULL ? NULL : out + r * num_rows;
            uint16_t *out_rows_bf16 = out_bf16 == NULL ? NULL : out_bf16 + r * num_rows;
            run_block(tiles, groups, num_cols, x + r * x_stride, x_stride, x_sums + r * groups, &rows, tile, (int)nt,
                      mb, bits, out_rows, out_rows_bf16, num_rows);
        }
    }
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

#else

int radixrt_quantized_matmul_available(void) { return 0; }

void radixrt_quantized_matmul_tiles(
    const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits, int64_t num_rows,
    int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch, int64_t first, int64_t last
) {
    (void)x; (void)x_stride; (void)m; (void)tiles; (void)bits; (void)num_rows; (void)num_cols; (void)out;
    (void)out_bf16; (void)scratch; (void)first; (void)last;
}

int radixrt_quantized_matmul_bf16(
    const uint16_t *x, int64_t x_stride, int64_t m,
    const uint8_t *tiles, int bits, int64_t num_rows, int64_t num_cols,
    float *out, uint16_t *out_bf16, int num_threads
) {
    (void)x; (void)x_stride; (void)m; (void)tiles; (void)bits; (void)num_rows; (void)num_cols;
    (void)out; (void)out_bf16; (void)num_threads;
    return -1;
}

#endif
