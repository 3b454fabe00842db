/*
 * Decode attention over the paged KV pool, bf16 (or float32, for deterministic mode), for the CPU.
 *
 * Query rows attend keys where they sit in the pool (no gather copy, no
 * padding). The keys come as segments (kernels.h): runs of pool slots, each
 * with the query rows that see all of it. A plain decode is one segment per
 * sequence, its slots and its new token; a shared prefix is one segment for
 * all its sequences' rows, so its keys are read once for all of them.
 * The G query heads that share a KV head are computed together, so each key
 * and value is read once per KV head and block of rows. Dot products and the
 * softmax run in float32.
 *
 * Work is split into (segment, KV head, chunk of keys, block of rows) items
 * so that one long sequence still keeps every thread busy; when there are
 * pieces of keys enough for every thread without that, an item takes all the
 * KV heads of its piece, whose rows interleave in the pool, so that one core
 * reads each cache line of them (a batch-8 step over 1,024-token contexts
 * 10.01 -> 9.32 and 9.69 -> 9.34 ms, batch 1 over 4,096 keys 4.83 -> 4.61 ms;
 * results unchanged: each head computes alone either way). Each item leaves
 * partial results (running max, sum of exponentials, unnormalised output);
 * the thread that leaves a row's last partial for a KV head merges that
 * row's partials for it, over its segments and their chunks in order, by
 * their log-sum-exps (radixrt_attention_run).
 *
 * Layouts: q rows are [Hq, D] with head stride D and row stride q_row_stride
 * (elements); the pools are [slots, Hkv, D]; out rows are [Hq, D], contiguous;
 * lse (optional) is [rows, Hq] float32, natural log.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scalar.h"

#define CHUNK 256
/* Rows of keys (and values) requested ahead of the score loop. A K or V row of one head is 128
 * bytes at head_dim 64: 8 rows ahead kept ~1 KB in flight, a tenth of what a core needs to read
 * at its share of the bandwidth, and the value pass began with misses; 32 rows ahead with the
 * values requested in the same pass (two builds in one process, alternating steps, one round): a
 * batch-1 step over 1,500 keys 4.36 -> 3.75 ms, batch 8 over 1,500 keys 19.6 -> 15.1 ms, a batch-1
 * step over 256 keys 3.03 -> 2.91 ms. */
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
 * L2 (the value pass reads them after the whole score loop). A batch-1 decode run's step, with the
 * sixteen-key scores (attend_chunk_wide): 0.985x in fast-memory minutes (48 rounds), 0.977x in
 * slow ones (12), against neither (one process alternating settings of a test build).
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
 * and the sum of the exponentials are returned. */
static inline void softmax_rows(float *scores, int64_t n, int group, float *max_out, float *sum_out) {
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

/* One item: queries of KV head h of sequence s against keys [k0, k1) of it. Always inlined,
 * so the calls below with a literal head_dim get loops the compiler fully unrolls. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *q, /* [G, D] float32, already scaled */
    const void *k_pool, const void *v_pool, const int64_t *slots,
    int64_t k0, int64_t k1, int h, int num_kv_heads, int head_dim, int group,
    float *max_out, float *sum_out, float *acc /* [G, D] */, int f32
) {
    float scores[MAX_GROUP * CHUNK];
    int64_t n = k1 - k0;
    float kf[MAX_HEAD_DIM];
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = (slots[k0 + j] * num_kv_heads + h) * head_dim;
        prefetch_ahead(k_pool, v_pool, slots + k0, j, n, h, num_kv_heads, head_dim, f32);
        #pragma omp simd
        for (int d = 0; d < head_dim; d++) kf[d] = load1(k_pool, k + d, f32);
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int d = 0; d < head_dim; d++) dot += qg[d] * kf[d];
            scores[g * CHUNK + j] = dot;
        }
    }
    softmax_rows(scores, n, group, max_out, sum_out);
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t j = 0; j < n; j++) {
        const int64_t v = (slots[k0 + j] * num_kv_heads + h) * head_dim;
        float vf[MAX_HEAD_DIM];
        #pragma omp simd
        for (int d = 0; d < head_dim; d++) vf[d] = load1(v_pool, v + d, f32);
        for (int g = 0; g < group; g++) {
            float p = scores[g * CHUNK + j];
            float *out = acc + g * head_dim;
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) out[d] += p * vf[d];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bf16 (f32 = 0) or float32 (f32 = 1) values from element `at` on, as float32 (exact). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t at, int f32) {
    if (f32) return _mm512_loadu_ps((const float *)base + at);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* dots[g * stride] = the lane products of query vector g and the key at element `at`, summed over
 * the head's 16-lane slices in order: lane_sum of it is their dot product. */
static inline __attribute__((always_inline)) void key_dots(
    const float *q, const void *k_pool, int64_t at, int W, int group, __m512 *dots, int stride, int f32
) {
    __m512 kv[8];
    _Pragma("GCC unroll 8") for (int s = 0; s < W; s++) kv[s] = load16(k_pool, at + 16 * s, f32);
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * 16 * W;
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
        _Pragma("GCC unroll 8") for (int s = 1; s < W; s++) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * s), kv[s], dot);
        dots[g * stride] = dot;
    }
}

/* The sum of v's lanes, added pairwise: lanes l and l + 8, then l + 4, l + 2 and l + 1. */
static inline float lane_sum(__m512 v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_movehdup_ps(s2));
}

/*
 * lane_sum of each of 16 vectors, v[i]'s in lane i, with the same pairs added in the same order
 * (so the same bits), the 16 sums at once: each level adds the halves of two vectors' partial sums
 * side by side, 15 additions in all instead of 60 and one vector store instead of 16 scalar ones.
 */
static inline __attribute__((always_inline)) __m512 lane_sums16(const __m512 v[16]) {
    __m512 s8[8], s4[4], s2[2];
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)  /* [v 2i: lanes l + (l + 8), v 2i + 1: same] */
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)  /* a 128-bit block each for v 4i .. 4i + 3: l + (l + 4) */
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++)  /* block b: v 8i + b, v 8i + 4 + b, l + (l + 2) */
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* block b: the sums of v b, v 4 + b, v 8 + b, v 12 + b */
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s1);
}

/*
 * attend_chunk with head_dim = 16 * W (W literal, 4 or 8) in AVX-512 registers: a key's row is
 * loaded and widened once for all the item's query vectors, and a block of VB query vectors'
 * outputs stays in registers for the whole chunk (the loop above kept them in memory, and ran
 * ~110 cycles a key and KV head). Same float32 arithmetic, per-key dot products reduced across
 * lanes at the end, sixteen keys' at once (lane_sums16): one KV head's 256 keys, cache-resident,
 * took 13.8 TSC ticks a key in the score loop with a reduction per key and 9.8 with them (the
 * value loop 4.5), the same bits. In a batch-1 step, on K/V from memory, that alone bought
 * nothing (1.001x, fast minutes); with prefetch_start and the barriers' requests going on to the
 * product after (kernels.h), 0.974x against 0.988x without it (48 fast-minute rounds).
 */
static inline __attribute__((always_inline)) void attend_chunk_wide(
    const float *q, const void *k_pool, const void *v_pool, const int64_t *slots,
    int64_t k0, int64_t k1, int h, int num_kv_heads, int W, int VB, int group,
    float *max_out, float *sum_out, float *acc, int f32
) {
    float scores[MAX_GROUP * CHUNK];
    const int head_dim = 16 * W;
    const int64_t n = k1 - k0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 dots[MAX_GROUP][16];
        for (int i = 0; i < 16; i++) {
            prefetch_ahead(k_pool, v_pool, slots + k0, j + i, n, h, num_kv_heads, head_dim, f32);
            key_dots(q, k_pool, (slots[k0 + j + i] * num_kv_heads + h) * head_dim, W, group, &dots[0][i], 16, f32);
        }
        for (int g = 0; g < group; g++) _mm512_storeu_ps(scores + g * CHUNK + j, lane_sums16(dots[g]));
    }
    for (; j < n; j++) {
        prefetch_ahead(k_pool, v_pool, slots + k0, j, n, h, num_kv_heads, head_dim, f32);
        __m512 dots[MAX_GROUP];
        key_dots(q, k_pool, (slots[k0 + j] * num_kv_heads + h) * head_dim, W, group, dots, 1, f32);
        for (int g = 0; g < group; g++) scores[g * CHUNK + j] = lane_sum(dots[g]);
    }
    softmax_rows(scores, n, group, max_out, sum_out);
    for (int g0 = 0; g0 < group; g0 += VB) {
        const int nb = group - g0 < VB ? group - g0 : VB;
        __m512 out[4][8];
        _Pragma("GCC unroll 4") for (int b = 0; b < VB; b++)
            _Pragma("GCC unroll 8") for (int i = 0; i < W; i++) out[b][i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const int64_t v = (slots[k0 + j] * num_kv_heads + h) * head_dim;
            __m512 vv[8];
            _Pragma("GCC unroll 8") for (int i = 0; i < W; i++) vv[i] = load16(v_pool, v + 16 * i, f32);
            _Pragma("GCC unroll 4") for (int b = 0; b < VB; b++) {
                if (b < nb) {
                    const __m512 p = _mm512_set1_ps(scores[(g0 + b) * CHUNK + j]);
                    _Pragma("GCC unroll 8") for (int i = 0; i < W; i++) out[b][i] = _mm512_fmadd_ps(p, vv[i], out[b][i]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int b = 0; b < VB; b++)
            if (b < nb)
                _Pragma("GCC unroll 8") for (int i = 0; i < W; i++)
                    _mm512_storeu_ps(acc + (g0 + b) * head_dim + 16 * i, out[b][i]);
    }
}
#endif

struct AttentionWork {
    Segments seg;
    int group, block_rows;  /* G query heads per KV head; rows per item (block_rows * G <= MAX_GROUP) */
    int heads_per_item;  /* KV heads an item attends, one after another: 1, or all of them */
    int64_t num_items;
    int64_t *items;  /* [num_items, 4]: segment, first KV head, chunk, first row of the block (in the segment) */
    int64_t *part_offset;  /* [num_segments]: the segment's first partial vector */
    /* merge: for each row its (segment, position in the segment) entries in order */
    int64_t *entry_ptr, *entry_segment, *entry_position;
    float *maxes, *sums, *accs;  /* one per partial vector: (segment, chunk, KV head, row, g) */
    int64_t *partials;  /* [max row + 1]: a row's partials for each KV head (its segments' chunks) */
    atomic_long *finished;  /* [max row + 1, Hkv]: partials computed, counted over every run */
};

static int64_t chunks_of(int64_t len) { return (len + CHUNK - 1) / CHUNK; }

/* Keys reduced as one piece: a row's result depends on where its segments cut its keys into these. */
int radixrt_attention_chunk(void) { return CHUNK; }

static int64_t segment_rows(const Segments *seg, int s) { return seg->row_ptr[s + 1] - seg->row_ptr[s]; }

/* Partial vector of (segment s, chunk c, KV head h, row p of the segment, g). */
static int64_t part_index(const AttentionWork *w, int s, int64_t c, int h, int64_t p, int g) {
    return w->part_offset[s] + ((c * w->seg.num_kv_heads + h) * segment_rows(&w->seg, s) + p) * w->group + g;
}

void radixrt_attention_work_free(AttentionWork *w) {
    if (w == NULL) return;
    free(w->items);
    free(w->part_offset);
    free(w->entry_ptr);
    free(w->entry_segment);
    free(w->entry_position);
    free(w->maxes);
    free(w->sums);
    free(w->accs);
    free(w->partials);
    free(w->finished);
    free(w);
}

AttentionWork *radixrt_attention_work_new(const Segments *seg, int threads) {
    AttentionWork *w = calloc(1, sizeof(AttentionWork));
    if (w == NULL) return NULL;
    w->seg = *seg;
    w->group = seg->num_q_heads / seg->num_kv_heads;
    w->block_rows = MAX_GROUP / w->group;
    const int hkv = seg->num_kv_heads;
    int64_t pieces = 0, num_vectors = 0, num_entries = seg->row_ptr[seg->num_segments], max_row = -1;
    w->part_offset = malloc(sizeof(int64_t) * (seg->num_segments + 1));
    if (w->part_offset == NULL) goto fail;
    for (int s = 0; s < seg->num_segments; s++) {
        int64_t rows = segment_rows(seg, s), chunks = chunks_of(seg->lens[s]);
        pieces += chunks * ((rows + w->block_rows - 1) / w->block_rows);
        w->part_offset[s] = num_vectors;
        num_vectors += chunks * hkv * rows * w->group;
    }
    /* Enough pieces of keys to keep every thread busy: each piece's heads in one item, so that
     * one core reads the piece's K and V rows, which interleave the heads in the pool, and each
     * cache line comes from memory once (split by head, both cores fetched the same lines). */
    w->heads_per_item = pieces >= ITEMS_PER_THREAD * threads ? hkv : 1;
    const int64_t num_items = pieces * (hkv / w->heads_per_item);
    for (int64_t e = 0; e < num_entries; e++) max_row = seg->rows[e] > max_row ? seg->rows[e] : max_row;
    w->num_items = num_items;
    w->items = malloc(sizeof(int64_t) * 4 * (num_items + 1));
    w->maxes = malloc(sizeof(float) * (num_vectors + 1));
    w->sums = malloc(sizeof(float) * (num_vectors + 1));
    w->accs = malloc(sizeof(float) * (num_vectors + 1) * seg->head_dim);
    w->entry_ptr = calloc(max_row + 2, sizeof(int64_t));  /* first a count per row, then its CSR offsets */
    w->entry_segment = malloc(sizeof(int64_t) * (num_entries + 1));
    w->entry_position = malloc(sizeof(int64_t) * (num_entries + 1));
    w->partials = calloc(max_row + 2, sizeof(int64_t));
    w->finished = calloc((size_t)((max_row + 2) * hkv), sizeof(atomic_long));
    if (!w->items || !w->maxes || !w->sums || !w->accs || !w->entry_ptr || !w->entry_segment || !w->entry_position ||
        !w->partials || !w->finished)
        goto fail;
    int64_t item = 0;
    for (int s = 0; s < seg->num_segments; s++) {
        int64_t rows = segment_rows(seg, s), chunks = chunks_of(seg->lens[s]);
        for (int h = 0; h < hkv; h += w->heads_per_item)
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t p = 0; p < rows; p += w->block_rows, item++) {
                    int64_t *it = w->items + 4 * item;
                    it[0] = s, it[1] = h, it[2] = c, it[3] = p;
                }
    }
    /* each row's entries in segment order: count, offsets, fill */
    int64_t *count = w->entry_ptr + 1;
    for (int64_t e = 0; e < num_entries; e++) count[seg->rows[e]]++;
    for (int64_t r = 0; r <= max_row; r++) w->entry_ptr[r + 1] += w->entry_ptr[r];
    int64_t *fill = calloc(max_row + 1, sizeof(int64_t));
    if (fill == NULL) goto fail;
    for (int s = 0; s < seg->num_segments; s++)
        for (int64_t p = 0; p < segment_rows(seg, s); p++) {
            int64_t row = seg->rows[seg->row_ptr[s] + p], at = w->entry_ptr[row] + fill[row]++;
            w->entry_segment[at] = s;
            w->entry_position[at] = p;
            w->partials[row] += chunks_of(seg->lens[s]);
        }
    free(fill);
    return w;
fail:
    radixrt_attention_work_free(w);
    return NULL;
}

/* The rows of item `it`'s block: from row it[3] of its segment on, block_rows of them or, for the
 * segment's last block, what is left. */
static int64_t block_size(const AttentionWork *w, const int64_t *it) {
    const int64_t left = segment_rows(&w->seg, (int)it[0]) - it[3];
    return left < w->block_rows ? left : w->block_rows;
}

/* One item's partial results, for bf16 (f32 = 0) or float32 (f32 = 1) data: inlined with a literal. */
static inline __attribute__((always_inline)) void run_item_of(
    AttentionWork *w, int64_t item, const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
    const int64_t *kv_indices, float scale, int f32
) {
    const Segments *seg = &w->seg;
    const int64_t *it = w->items + 4 * item;
    const int s = (int)it[0], first_head = (int)it[1];
    const int64_t c = it[2], p0 = it[3];
    const int nb = (int)block_size(w, it);
    const int group = w->group, head_dim = seg->head_dim, vectors = nb * group;
    const int64_t k0 = c * CHUNK, k1 = k0 + CHUNK < seg->lens[s] ? k0 + CHUNK : seg->lens[s];
    const int64_t *slots = kv_indices + seg->starts[s];
    const int hkv = seg->num_kv_heads;
    for (int h = first_head; h < first_head + w->heads_per_item; h++) {
        prefetch_start(k_pool, v_pool, slots + k0, k1 - k0, h, hkv, head_dim, f32);
        float qf[MAX_GROUP * MAX_HEAD_DIM];
        for (int b = 0; b < nb; b++) {
            const int64_t qs = seg->rows[seg->row_ptr[s] + p0 + b] * q_row_stride + (int64_t)h * group * head_dim;
            for (int i = 0; i < group * head_dim; i++) qf[b * group * head_dim + i] = load1(q, qs + i, f32) * scale;
        }
        const int64_t first = part_index(w, s, c, h, p0, 0);
        float *m = w->maxes + first, *l = w->sums + first, *acc = w->accs + first * head_dim;
        switch (head_dim) {
#if defined(__AVX512F__)
        case 64: attend_chunk_wide(qf, k_pool, v_pool, slots, k0, k1, h, hkv, 4, 4, vectors, m, l, acc, f32); break;
        case 128: attend_chunk_wide(qf, k_pool, v_pool, slots, k0, k1, h, hkv, 8, 2, vectors, m, l, acc, f32); break;
#else
        case 64: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, hkv, 64, vectors, m, l, acc, f32); break;
        case 128: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, hkv, 128, vectors, m, l, acc, f32); break;
#endif
        default: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, hkv, head_dim, vectors, m, l, acc, f32);
        }
    }
}

static void run_item(AttentionWork *w, int64_t item, const void *q, int64_t q_row_stride, const void *k_pool,
                     const void *v_pool, const int64_t *kv_indices, float scale) {
    if (w->seg.f32) run_item_of(w, item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, 1);
    else run_item_of(w, item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, 0);
}

/* Row `row`, KV head h: its partials over its segments and their chunks, in order, merged. */
static void merge_row(const AttentionWork *w, int64_t row, int h, void *out, float *lse) {
    const Segments *seg = &w->seg;
    const int head_dim = seg->head_dim;
    for (int g = 0; g < w->group; g++) {
        float m = -INFINITY;
        for (int64_t e = w->entry_ptr[row]; e < w->entry_ptr[row + 1]; e++) {
            int s = (int)w->entry_segment[e];
            for (int64_t c = 0; c < chunks_of(seg->lens[s]); c++) {
                float mc = w->maxes[part_index(w, s, c, h, w->entry_position[e], g)];
                m = mc > m ? mc : m;
            }
        }
        float total = 0.0f;
        float merged[MAX_HEAD_DIM];
        memset(merged, 0, sizeof(float) * head_dim);
        for (int64_t e = w->entry_ptr[row]; e < w->entry_ptr[row + 1]; e++) {
            int s = (int)w->entry_segment[e];
            for (int64_t c = 0; c < chunks_of(seg->lens[s]); c++) {
                int64_t v = part_index(w, s, c, h, w->entry_position[e], g);
                float weight = expf(w->maxes[v] - m);
                total += weight * w->sums[v];
                const float *acc = w->accs + v * head_dim;
                #pragma omp simd
                for (int d = 0; d < head_dim; d++) merged[d] += weight * acc[d];
            }
        }
        int head = h * w->group + g;
        const int64_t o = (row * seg->num_q_heads + head) * head_dim;
        float inv = 1.0f / total;
        if (seg->f32)
            for (int d = 0; d < head_dim; d++) ((float *)out)[o + d] = merged[d] * inv;
        else
            for (int d = 0; d < head_dim; d++) ((uint16_t *)out)[o + d] = float_to_bf16(merged[d] * inv);
        if (lse) lse[row * seg->num_q_heads + head] = m + logf(total);
    }
}

/*
 * After an item: each of its rows whose partials for one of its heads are now all there is merged
 * by this thread (the release and acquire of the count make the other threads' partials visible).
 * A merge pass after a barrier kept both threads of a batch-1 step waiting at one more barrier a
 * layer, while the thread with fewer heads could merge the ones already done: a decode run's step
 * took 0.988x and 0.985x the time this way (two builds alternating, 85 and 95 runs each, fast
 * minutes; outputs equal). The work serves every layer of a step, each run adding a row's partials
 * to its count once, so the count's multiples mark its runs' ends.
 */
static void merge_finished_rows(AttentionWork *w, int64_t item, void *out, float *lse) {
    const Segments *seg = &w->seg;
    const int64_t *it = w->items + 4 * item;
    const int s = (int)it[0], first_head = (int)it[1], hkv = seg->num_kv_heads;
    const int64_t p0 = it[3], p1 = p0 + block_size(w, it);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t row = seg->rows[seg->row_ptr[s] + p];
        for (int h = first_head; h < first_head + w->heads_per_item; h++) {
            const long done = atomic_fetch_add_explicit(&w->finished[row * hkv + h], 1, memory_order_acq_rel) + 1;
            if (done % w->partials[row] == 0) merge_row(w, row, h, out, lse);
        }
    }
}

void radixrt_attention_run(const Team *team, AttentionWork *w, atomic_long *next_item, const void *q,
                           int64_t q_row_stride, const void *k_pool, const void *v_pool,
                           const int64_t *kv_indices, float scale, void *out, float *lse, Prefetch *pending) {
    for (long item; (item = atomic_fetch_add_explicit(next_item, 1, memory_order_relaxed)) < w->num_items;) {
        run_item(w, item, q, q_row_stride, k_pool, v_pool, kv_indices, scale);
        merge_finished_rows(w, item, out, lse);
    }
    team_wait(team, pending);
}

/*
 * Attention of the query rows over the segments (kernels.h), written to the same rows of out
 * (and lse); q, the pools and out are bf16, or float32 with f32 = 1 (deterministic mode in
 * float32). Returns 0, -1 for shapes this kernel was not built for (the caller checks them
 * first), -2 without memory.
 */
int radixrt_segment_attention(
    const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
    const int64_t *kv_indices, int num_segments, const int64_t *starts, const int64_t *lens,
    const int64_t *row_ptr, const int64_t *rows, int num_q_heads, int num_kv_heads, int head_dim, float scale,
    int num_threads, void *out, float *lse, int f32
) {
    if (num_q_heads % num_kv_heads || num_q_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;
    Segments seg = {num_segments, starts, lens, row_ptr, rows, num_q_heads, num_kv_heads, head_dim, f32};
    AttentionWork *work = radixrt_attention_work_new(&seg, num_threads);
    if (work == NULL) return -2;
    SpinBarrier barrier = {0, 0};
    atomic_long next_item = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        Team team = {&barrier, omp_get_thread_num(), omp_get_num_threads()};
        radixrt_attention_run(&team, work, &next_item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, out, lse,
                              NULL);
    }
    radixrt_attention_work_free(work);
    return 0;
}

/* Decode: sequence s's query row q_rows[s] over the slots kv_indices[kv_starts[s] ..][:kv_lens[s]]
 * (one segment each), written to the same row of out (and lse). Returns as above. */
int radixrt_decode_attention_bf16(
    const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
    const uint16_t *k_pool, const uint16_t *v_pool,
    const int64_t *kv_indices, const int64_t *kv_starts, const int64_t *kv_lens,
    int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, float scale, int num_threads,
    uint16_t *out, float *lse
) {
    int64_t *row_ptr = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (row_ptr == NULL) return -2;
    for (int s = 0; s <= num_seqs; s++) row_ptr[s] = s;
    int status = radixrt_segment_attention(q, q_row_stride, k_pool, v_pool, kv_indices, num_seqs, kv_starts, kv_lens,
                                           row_ptr, q_rows, num_q_heads, num_kv_heads, head_dim, scale, num_threads,
                                           out, lse, 0);
    free(row_ptr);
    return status;
}
