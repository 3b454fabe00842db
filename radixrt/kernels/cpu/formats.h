/*
 * GGUF weight formats as the file stores them: one block struct per format, its size checked at
 * compile time, and the numbering GGUF uses for tensor types (ggml's `ggml_type`). A format's
 * reference dequantizer (formats.c) is the plain-C definition every kernel of that format is
 * tested against, and it equals gguf's Python dequantizer bit for bit.
 *
 *   format  elements  bytes  a weight is
 *   Q4_0       32      18    d (q - 8),            q in 0..15
 *   Q4_1       32      20    d q + m,              q in 0..15
 *   Q5_0       32      22    d (q - 16),           q in 0..31 (4 low bits in qs, the 5th in qh)
 *   Q5_1       32      24    d q + m,              q in 0..31
 *   Q8_0       32      34    d q,                  q in -128..127
 *   Q4_K      256     144    d sc_j q - dmin m_j,  8 sub-blocks j of 32, 6-bit sc_j and m_j
 *   Q5_K      256     176    d sc_j q - dmin m_j,  q in 0..31
 *   Q6_K      256     210    d sc_j (q - 32),      16 sub-blocks j of 16, 8-bit signed sc_j, q in 0..63
 *
 * Every scale is an IEEE half (`uint16_t` here, decoded by fp16_to_float in scalar.h).
 */
#ifndef RADIXRT_CPU_FORMATS_H
#define RADIXRT_CPU_FORMATS_H

#include <stdint.h>

/* GGUF's tensor type numbers (the `ggml_type` values written in every file). */
enum {
    FORMAT_F32 = 0,
    FORMAT_F16 = 1,
    FORMAT_Q4_0 = 2,
    FORMAT_Q4_1 = 3,
    FORMAT_Q5_0 = 6,
    FORMAT_Q5_1 = 7,
    FORMAT_Q8_0 = 8,
    FORMAT_Q4_K = 12,
    FORMAT_Q5_K = 13,
    FORMAT_Q6_K = 14,
    FORMAT_BF16 = 30,
};

#define QK 32         /* elements of a Q4_0 .. Q8_0 block */
#define QK_K 256      /* elements of a K-quant super-block */
#define K_SCALE_BYTES 12  /* Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins, packed */

/* byte j of qs: low nibble element j, high nibble element j + 16 (Q4_0 .. Q5_1) */
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } BlockQ4_0;
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } BlockQ4_1;
/* bit j of qh (little-endian word): the 5th bit of element j */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } BlockQ5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } BlockQ5_1;
typedef struct { uint16_t d; int8_t qs[QK]; } BlockQ8_0;
/*
 * Q4_K: 4 groups of 64 elements; qs[32 i + l] holds element 64 i + l (low nibble) and
 * 64 i + 32 + l (high nibble). Sub-block j's scale and min: for j < 4, scales[j] & 63 and
 * scales[j + 4] & 63; for j >= 4, (scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4) and
 * (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4).
 */
typedef struct { uint16_t d, dmin; uint8_t scales[K_SCALE_BYTES]; uint8_t qs[QK_K / 2]; } BlockQ4_K;
/* Q5_K: Q4_K's codes plus, for element 64 i + l (+ 32), bit 2 i (+ 1) of qh[l] */
typedef struct { uint16_t d, dmin; uint8_t scales[K_SCALE_BYTES]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } BlockQ5_K;
/*
 * Q6_K: two halves of 128; in half h, for l < 32 and quarter s in 0..3 the element
 * 128 h + 32 s + l has low 4 bits from ql[64 h + l + 32 (s & 1)] (low nibble for s < 2, high
 * for s >= 2) and high 2 bits (qh[32 h + l] >> 2 s) & 3; its sub-block scale scales[8 h + 2 s + l / 16].
 */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } BlockQ6_K;

_Static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");
_Static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block");
_Static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block");
_Static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block");
_Static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block");
_Static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block");

/*
 * formats.c: `rows` rows of `cols` elements of `format`, stored row after row (`row_bytes` apart,
 * cols a multiple of the format's block), as float32 (out: rows * cols). Returns 0, or -1 for a
 * format without a row in the table or cols not a whole number of blocks (nothing written).
 */
int radixrt_dequantize_rows(int format, const void *data, int64_t row_bytes, int64_t rows, int64_t cols, float *out);
/* formats.c: a format's block size in elements and bytes; -1 for a format without a row */
int radixrt_format_block(int format, int *block_elements, int *block_bytes);

#endif
