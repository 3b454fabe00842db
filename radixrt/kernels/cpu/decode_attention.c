/*
 * Decode attention over the paged KV pool, bf16, for the CPU.
 *
 * One new query token per sequence attends its keys where they sit in the
 * pool (no gather copy, no padding): slots kv_indices[kv_starts[s] ...
 * kv_starts[s] + kv_lens[s]). The G query heads that share a KV head are
 * computed together, so each key and value is read once per KV head. Dot
 * products and the softmax run in float32.
 *
 * Work is split into (sequence, KV head, chunk of keys) items so that one
 * long sequence still keeps every thread busy; each item leaves a partial
 * result (running max, sum of exponentials, unnormalised output), and a
 * second pass merges a sequence's chunks by their log-sum-exps.
 *
 * Layouts: q rows are [Hq, D] with head stride D and row stride q_row_stride
 * (elements); the pools are [slots, Hkv, D]; out rows are [Hq, D], contiguous;
 * lse (optional) is [rows, Hq] float32, natural log.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar.h"

#define CHUNK 256
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define PREFETCH_AHEAD 8

/* One item: queries of KV head h of sequence s against keys [k0, k1) of it. Always inlined,
 * so the calls below with a literal head_dim get loops the compiler fully unrolls. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *q, /* [G, D] float32, already scaled */
    const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *slots,
    int64_t k0, int64_t k1, int h, int num_kv_heads, int head_dim, int group,
    float *max_out, float *sum_out, float *acc /* [G, D] */
) {
    float scores[MAX_GROUP * CHUNK];
    int64_t n = k1 - k0;
    float kf[MAX_HEAD_DIM];
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *k = k_pool + (slots[k0 + j] * num_kv_heads + h) * head_dim;
        if (j + PREFETCH_AHEAD < n) {  /* slots may be anywhere in the pool: hide the misses */
            const uint16_t *next = k_pool + (slots[k0 + j + PREFETCH_AHEAD] * num_kv_heads + h) * head_dim;
            for (int line = 0; line < head_dim * 2; line += 64) __builtin_prefetch((const char *)next + line);
        }
        #pragma omp simd
        for (int d = 0; d < head_dim; d++) kf[d] = bf16_to_float(k[d]);
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int d = 0; d < head_dim; d++) dot += qg[d] * kf[d];
            scores[g * CHUNK + j] = dot;
        }
    }
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
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *v = v_pool + (slots[k0 + j] * num_kv_heads + h) * head_dim;
        if (j + PREFETCH_AHEAD < n) {
            const uint16_t *next = v_pool + (slots[k0 + j + PREFETCH_AHEAD] * num_kv_heads + h) * head_dim;
            for (int line = 0; line < head_dim * 2; line += 64) __builtin_prefetch((const char *)next + line);
        }
        float vf[MAX_HEAD_DIM];
        #pragma omp simd
        for (int d = 0; d < head_dim; d++) vf[d] = bf16_to_float(v[d]);
        for (int g = 0; g < group; g++) {
            float p = scores[g * CHUNK + j];
            float *out = acc + g * head_dim;
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) out[d] += p * vf[d];
        }
    }
}

/* Returns 0, or -1 for shapes this kernel was not built for (the caller checks them first). */
int radixrt_decode_attention_bf16(
    const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
    const uint16_t *k_pool, const uint16_t *v_pool,
    const int64_t *kv_indices, const int64_t *kv_starts, const int64_t *kv_lens,
    int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, float scale, int num_threads,
    const int64_t *out_rows, uint16_t *out, float *lse
) {
    int group = num_q_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || num_q_heads % num_kv_heads) return -1;

    /* item i covers chunk c of (sequence, KV head) pair p; first_item[s] indexes sequence s's first */
    int64_t *first_item = malloc(sizeof(int64_t) * (num_seqs + 1));
    first_item[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        int64_t chunks = (kv_lens[s] + CHUNK - 1) / CHUNK;
        first_item[s + 1] = first_item[s] + chunks * num_kv_heads;
    }
    int64_t num_items = first_item[num_seqs];
    size_t acc_size = (size_t)group * head_dim;
    float *maxes = malloc(sizeof(float) * num_items * group);
    float *sums = malloc(sizeof(float) * num_items * group);
    float *accs = malloc(sizeof(float) * num_items * acc_size);

    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        int s = 0;
        while (first_item[s + 1] <= item) s++;
        int64_t local = item - first_item[s];
        int64_t chunks = (kv_lens[s] + CHUNK - 1) / CHUNK;
        int h = (int)(local / chunks);
        int64_t c = local % chunks;
        int64_t k0 = c * CHUNK;
        int64_t k1 = k0 + CHUNK < kv_lens[s] ? k0 + CHUNK : kv_lens[s];
        float qf[MAX_GROUP * MAX_HEAD_DIM];
        const uint16_t *qs = q + q_rows[s] * q_row_stride + (int64_t)h * group * head_dim;
        for (int i = 0; i < group * head_dim; i++) qf[i] = bf16_to_float(qs[i]) * scale;
        const int64_t *slots = kv_indices + kv_starts[s];
        float *m = maxes + item * group, *l = sums + item * group, *acc = accs + item * acc_size;
        switch (head_dim) {
        case 64: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, num_kv_heads, 64, group, m, l, acc); break;
        case 128: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, num_kv_heads, 128, group, m, l, acc); break;
        default: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, num_kv_heads, head_dim, group, m, l, acc);
        }
    }

    #pragma omp parallel for num_threads(num_threads)
    for (int64_t pair = 0; pair < (int64_t)num_seqs * num_kv_heads; pair++) {
        int s = (int)(pair / num_kv_heads);
        int h = (int)(pair % num_kv_heads);
        int64_t chunks = (kv_lens[s] + CHUNK - 1) / CHUNK;
        int64_t base = first_item[s] + (int64_t)h * chunks;
        for (int g = 0; g < group; g++) {
            float m = maxes[base * group + g];
            for (int64_t c = 1; c < chunks; c++) {
                float mc = maxes[(base + c) * group + g];
                m = mc > m ? mc : m;
            }
            float total = 0.0f;
            float merged[MAX_HEAD_DIM];
            memset(merged, 0, sizeof(float) * head_dim);
            for (int64_t c = 0; c < chunks; c++) {
                float w = expf(maxes[(base + c) * group + g] - m);
                total += w * sums[(base + c) * group + g];
                const float *acc = accs + (base + c) * acc_size + (size_t)g * head_dim;
                #pragma omp simd
                for (int d = 0; d < head_dim; d++) merged[d] += w * acc[d];
            }
            int head = h * group + g;
            uint16_t *o = out + (out_rows[s] * num_q_heads + head) * head_dim;
            float inv = 1.0f / total;
            for (int d = 0; d < head_dim; d++) o[d] = float_to_bf16(merged[d] * inv);
            if (lse) lse[out_rows[s] * num_q_heads + head] = m + logf(total);
        }
    }
    free(first_item);
    free(maxes);
    free(sums);
    free(accs);
    return 0;
}
