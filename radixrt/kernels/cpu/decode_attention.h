/*
 * What decode attention's versions share (decode_attention.c holds the work split, the portable
 * per-chunk loop, the merge and the entry points; decode_attention_avx512.c the AVX-512 loop):
 * chunking, prefetching of K/V rows, and the softmax over a chunk's scores.
 */
#ifndef RADIXRT_CPU_DECODE_ATTENTION_H
#define RADIXRT_CPU_DECODE_ATTENTION_H

#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "scalar.h"

#define CHUNK 256
/* Rows of keys (and values) requested ahead of the score loop, the values in the same pass: fewer
 * kept too little in flight for a core's share of the bandwidth, and the value pass began with
 * misses (docs/kernels.md, "Decode attention: prefetching"). */
#define PREFETCH_AHEAD 32
/* radixrt_attention_work_new: items per thread, at least, with all of a piece's heads in one */
#define ITEMS_PER_THREAD 2

/* Element `at` of a bf16 (f32 = 0) or float32 (f32 = 1) array, as float32 (exact). */
static inline __attribute__((always_inline)) float load1(const void *base, int64_t at, int f32) {
    return f32 ? ((const float *)base)[at] : bf16_to_float(((const uint16_t *)base)[at]);
}

/* Prefetch the head_dim elements from element `at` on, into L1 or (into_l2, a literal) L2. */
static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t at, int head_dim, int f32,
                                                              int into_l2) {
    const int size = f32 ? 4 : 2;
    const char *row = (const char *)base + at * size;
    for (int line = 0; line < head_dim * size; line += 64) {
        if (into_l2) __builtin_prefetch(row + line, 0, 2);
        else __builtin_prefetch(row + line);
    }
}

/*
 * Before an item's score loop: the K rows of its first PREFETCH_AHEAD keys, which prefetch_ahead
 * does not ask for (its requests run PREFETCH_AHEAD keys ahead of the loop), and their V rows, into
 * L2 (the value pass reads them after the whole score loop).
 */
static inline __attribute__((always_inline)) void prefetch_start(
    const void *k_pool, const void *v_pool, const int64_t *slots, int64_t n, int h, int num_kv_heads, int head_dim,
    int f32
) {
    for (int64_t j = 0; j < n && j < PREFETCH_AHEAD; j++) {
        prefetch_row(k_pool, (slots[j] * num_kv_heads + h) * head_dim, head_dim, f32, 0);
        prefetch_row(v_pool, (slots[j] * num_kv_heads + h) * head_dim, head_dim, f32, 1);
    }
}

/* At key j of n (score loop): the K and V rows of key j + PREFETCH_AHEAD, or, near the end, the
 * V rows of the first keys, which the value pass reads first. Slots may be anywhere in the pool:
 * the hardware cannot guess the next row. */
static inline __attribute__((always_inline)) void prefetch_ahead(
    const void *k_pool, const void *v_pool, const int64_t *slots, int64_t j, int64_t n, int h, int num_kv_heads,
    int head_dim, int f32
) {
    const int64_t ahead = j + PREFETCH_AHEAD;
    if (ahead < n) {
        prefetch_row(k_pool, (slots[ahead] * num_kv_heads + h) * head_dim, head_dim, f32, 0);
        prefetch_row(v_pool, (slots[ahead] * num_kv_heads + h) * head_dim, head_dim, f32, 0);
    } else if (ahead - n < n) {
        prefetch_row(v_pool, (slots[ahead - n] * num_kv_heads + h) * head_dim, head_dim, f32, 0);
    }
}

/* Each of the `group` rows of scores (n of CHUNK used) becomes exp(score - its max); the max
 * and the sum of the exponentials are returned. softcap > 0: each score first becomes
 * softcap * tanh(score / softcap) (a pass of its own, so an uncapped chunk runs the loops as before). */
static inline void softmax_rows(float *scores, int64_t n, int group, float *max_out, float *sum_out, float softcap) {
    if (softcap > 0.0f)
        for (int g = 0; g < group; g++)
            for (int64_t j = 0; j < n; j++) scores[g * CHUNK + j] = softcap * tanhf(scores[g * CHUNK + j] / softcap);
    for (int g = 0; g < group; g++) {
        float *row = scores + g * CHUNK;
        float m = row[0];
        #pragma omp simd reduction(max:m)
        for (int64_t j = 1; j < n; j++) m = row[j] > m ? row[j] : m;
        float total = 0.0f;
        #pragma omp simd reduction(+:total)
        for (int64_t j = 0; j < n; j++) {
            row[j] = exp_approx(row[j] - m);
            total += row[j];
        }
        max_out[g] = m;
        sum_out[g] = total;
    }
}

/* One item's keys [k0, k1) of KV head h, for head_dim 64 or 128 in AVX-512 registers (builds of
 * that level only): what decode_attention.c's attend_chunk computes, with the same float32 work
 * per key reduced across lanes in a fixed tree. */
void radixrt_attend_chunk_avx512(const float *q, const void *k_pool, const void *v_pool, const int64_t *slots,
                                 int64_t k0, int64_t k1, int h, int num_kv_heads, int head_dim, int group,
                                 float *max_out, float *sum_out, float *acc, int f32, float softcap);

#endif
