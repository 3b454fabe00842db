/*
 * Scalar helpers the kernels share: bf16 conversions as torch does them,
 * and an exponential that vectorizes.
 */
#ifndef RADIXRT_CPU_SCALAR_H
#define RADIXRT_CPU_SCALAR_H

#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    uint32_t rounding = 0x7FFF + ((v.u >> 16) & 1);  /* round to nearest even, as torch does */
    return (uint16_t)((v.u + rounding) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* An IEEE half (a GGUF scale) as float, exactly: normals, subnormals, zeros, infinities, NaNs. */
static inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1F) {
        v.u = sign | 0x7F800000 | (mantissa << 13);
    } else if (exponent != 0) {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  /* zero or subnormal: mantissa * 2^-24, exact in float */
        v.f = (float)mantissa * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

/*
 * exp(x), x clamped to float's normal range: 2^i * 2^f with i = round(x log2 e), f in
 * [-0.5, 0.5] and Cephes' polynomial for 2^f (relative error ~2e-7, far below bf16's).
 * Unlike expf it vectorizes without -ffast-math, which would switch the whole process to
 * flush-to-zero; the rounding adds and subtracts 1.5 * 2^23 because roundf and floorf keep
 * GCC from vectorizing loops over bf16 data.
 */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504088896341f;
    float i = (t + 12582912.0f) - 12582912.0f;
    float f = t - i;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } two_to_i = { ((int32_t)i + 127) << 23 };
    return p * two_to_i.f;
}

#endif
