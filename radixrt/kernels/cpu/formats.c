/*
 * The format table's reference half: each GGUF format's block dequantized in plain C, with the
 * arithmetic of gguf's Python dequantizer (gguf/quants.py) operation for operation, so the two
 * agree bit for bit. Every kernel of a format is tested against these. Contraction into fused
 * multiply-adds is off in this file: `d * q + m` must round twice, as numpy does.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "formats.h"
#include "scalar.h"

typedef void (*DequantizeBlock)(const void *block, float *out);

typedef struct {
    int format;
    int block_elements, block_bytes;
    DequantizeBlock dequantize;
} FormatTraits;

static void dequantize_f32(const void *block, float *out) { memcpy(out, block, sizeof(float)); }
static void dequantize_f16(const void *block, float *out) { *out = fp16_to_float(*(const uint16_t *)block); }
static void dequantize_bf16(const void *block, float *out) { *out = bf16_to_float(*(const uint16_t *)block); }

static void dequantize_q4_0(const void *block, float *out) {
    const BlockQ4_0 *b = block;
    const float d = fp16_to_float(b->d);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)((b->qs[j] & 15) - 8);
        out[j + QK / 2] = d * (float)((b->qs[j] >> 4) - 8);
    }
}

static void dequantize_q4_1(const void *block, float *out) {
    const BlockQ4_1 *b = block;
    const float d = fp16_to_float(b->d), m = fp16_to_float(b->m);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)(b->qs[j] & 15) + m;
        out[j + QK / 2] = d * (float)(b->qs[j] >> 4) + m;
    }
}

/* element j's 5-bit code: its nibble from qs, its 5th bit from the little-endian word qh */
static inline int five_bit_code(const uint8_t qh[4], const uint8_t qs[QK / 2], int j) {
    const uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    const int nibble = j < QK / 2 ? qs[j] & 15 : qs[j - QK / 2] >> 4;
    return nibble | (int)((high >> j) & 1) << 4;
}

static void dequantize_q5_0(const void *block, float *out) {
    const BlockQ5_0 *b = block;
    const float d = fp16_to_float(b->d);
    for (int j = 0; j < QK; j++) out[j] = d * (float)(five_bit_code(b->qh, b->qs, j) - 16);
}

static void dequantize_q5_1(const void *block, float *out) {
    const BlockQ5_1 *b = block;
    const float d = fp16_to_float(b->d), m = fp16_to_float(b->m);
    for (int j = 0; j < QK; j++) out[j] = d * (float)five_bit_code(b->qh, b->qs, j) + m;
}

static void dequantize_q8_0(const void *block, float *out) {
    const BlockQ8_0 *b = block;
    const float d = fp16_to_float(b->d);
    for (int j = 0; j < QK; j++) out[j] = (float)b->qs[j] * d;
}

/* Q4_K/Q5_K: sub-block j's 6-bit scale and min (the packing formats.h describes) */
static inline void scale_min(const uint8_t s[K_SCALE_BYTES], int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63, *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dequantize_q4_k(const void *block, float *out) {
    const BlockQ4_K *b = block;
    const float d = fp16_to_float(b->d), dmin = fp16_to_float(b->dmin);
    for (int j = 0; j < 8; j++) {
        int scale, min;
        scale_min(b->scales, j, &scale, &min);
        const float dj = d * (float)scale, mj = dmin * (float)min;
        const uint8_t *qs = b->qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) out[32 * j + l] = dj * (float)((j & 1) ? qs[l] >> 4 : qs[l] & 15) - mj;
    }
}

static void dequantize_q5_k(const void *block, float *out) {
    const BlockQ5_K *b = block;
    const float d = fp16_to_float(b->d), dmin = fp16_to_float(b->dmin);
    for (int j = 0; j < 8; j++) {
        int scale, min;
        scale_min(b->scales, j, &scale, &min);
        const float dj = d * (float)scale, mj = dmin * (float)min;
        const uint8_t *qs = b->qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            const int q = ((j & 1) ? qs[l] >> 4 : qs[l] & 15) | ((b->qh[l] >> j) & 1) << 4;
            out[32 * j + l] = dj * (float)q - mj;
        }
    }
}

static void dequantize_q6_k(const void *block, float *out) {
    const BlockQ6_K *b = block;
    const float d = fp16_to_float(b->d);
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 4; s++) {
            for (int l = 0; l < 32; l++) {
                const uint8_t low = b->ql[64 * h + 32 * (s & 1) + l];
                const int q = (s < 2 ? low & 15 : low >> 4) | ((b->qh[32 * h + l] >> (2 * s)) & 3) << 4;
                const float scale = d * (float)b->scales[8 * h + 2 * s + l / 16];
                out[128 * h + 32 * s + l] = scale * (float)(q - 32);
            }
        }
    }
}

/* One row per format: adding a format is adding a row (and its kernels elsewhere). */
static const FormatTraits FORMATS[] = {
    {FORMAT_F32, 1, 4, dequantize_f32},
    {FORMAT_F16, 1, 2, dequantize_f16},
    {FORMAT_BF16, 1, 2, dequantize_bf16},
    {FORMAT_Q4_0, QK, sizeof(BlockQ4_0), dequantize_q4_0},
    {FORMAT_Q4_1, QK, sizeof(BlockQ4_1), dequantize_q4_1},
    {FORMAT_Q5_0, QK, sizeof(BlockQ5_0), dequantize_q5_0},
    {FORMAT_Q5_1, QK, sizeof(BlockQ5_1), dequantize_q5_1},
    {FORMAT_Q8_0, QK, sizeof(BlockQ8_0), dequantize_q8_0},
    {FORMAT_Q4_K, QK_K, sizeof(BlockQ4_K), dequantize_q4_k},
    {FORMAT_Q5_K, QK_K, sizeof(BlockQ5_K), dequantize_q5_k},
    {FORMAT_Q6_K, QK_K, sizeof(BlockQ6_K), dequantize_q6_k},
};

static const FormatTraits *traits(int format) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].format == format) return &FORMATS[i];
    return NULL;
}

int radixrt_format_block(int format, int *block_elements, int *block_bytes) {
    const FormatTraits *t = traits(format);
    if (t == NULL) return -1;
    *block_elements = t->block_elements, *block_bytes = t->block_bytes;
    return 0;
}

int radixrt_dequantize_rows(int format, const void *data, int64_t row_bytes, int64_t rows, int64_t cols, float *out) {
    const FormatTraits *t = traits(format);
    if (t == NULL || cols <= 0 || cols % t->block_elements != 0 || row_bytes < cols / t->block_elements * t->block_bytes)
        return -1;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)data + r * row_bytes;
        for (int64_t b = 0; b < cols / t->block_elements; b++)
            t->dequantize(row + b * t->block_bytes, out + r * cols + b * t->block_elements);
    }
    return 0;
}

