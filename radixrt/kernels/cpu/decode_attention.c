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
 * softmax run in float32. The per-chunk loop here is the portable reference;
 * AVX-512 builds run decode_attention_avx512.c's for head_dim 64 and 128.
 *
 * Work is split into (segment, KV head, chunk of keys, block of rows) items
 * so that one long sequence still keeps every thread busy; when there are
 * pieces of keys enough for every thread without that, an item takes all the
 * KV heads of its piece, whose rows interleave in the pool, so that one core
 * reads each cache line of them (results unchanged: each head computes alone
 * either way; docs/kernels.md, "Decode attention: items"). Each item leaves
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

#include "decode_attention.h"
#include "isa.h"

/* One item: queries of KV head h of sequence s against keys [k0, k1) of it. Always inlined,
 * so the calls below with a literal head_dim get loops the compiler fully unrolls. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *q, /* [G, D] float32, already scaled */
    const void *k_pool, const void *v_pool, const int64_t *slots,
    int64_t k0, int64_t k1, int h, int num_kv_heads, int head_dim, int group,
    float *max_out, float *sum_out, float *acc /* [G, D] */, int f32, float softcap
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
    softmax_rows(scores, n, group, max_out, sum_out, softcap);
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
    const int64_t *kv_indices, float scale, float softcap, int f32
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
#if RADIXRT_ISA_AVX512
        case 64:
        case 128: radixrt_attend_chunk_avx512(qf, k_pool, v_pool, slots, k0, k1, h, hkv, head_dim, vectors, m, l, acc, f32, softcap); break;
#else
        case 64: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, hkv, 64, vectors, m, l, acc, f32, softcap); break;
        case 128: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, hkv, 128, vectors, m, l, acc, f32, softcap); break;
#endif
        default: attend_chunk(qf, k_pool, v_pool, slots, k0, k1, h, hkv, head_dim, vectors, m, l, acc, f32, softcap);
        }
    }
}

static void run_item(AttentionWork *w, int64_t item, const void *q, int64_t q_row_stride, const void *k_pool,
                     const void *v_pool, const int64_t *kv_indices, float scale, float softcap) {
    if (w->seg.f32) run_item_of(w, item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, softcap, 1);
    else run_item_of(w, item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, softcap, 0);
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
 * A merge pass after a barrier would keep both threads waiting at one more barrier a layer, while
 * the thread with fewer heads can merge the ones already done (docs/kernels.md, "Decode attention:
 * merging"). The work serves every layer of a step, each run adding a row's partials
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
                           const int64_t *kv_indices, float scale, float softcap, void *out, float *lse,
                           Prefetch *pending) {
    for (long item; (item = atomic_fetch_add_explicit(next_item, 1, memory_order_relaxed)) < w->num_items;) {
        run_item(w, item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, softcap);
        merge_finished_rows(w, item, out, lse);
    }
    team_wait(team, pending);
}

/*
 * Attention of the query rows over the segments (kernels.h), written to the same rows of out
 * (and lse); q, the pools and out are bf16, or float32 with f32 = 1 (deterministic mode in
 * float32). softcap > 0: scores soft-capped (softmax_rows), 0: not. Returns 0, -1 for shapes
 * this kernel was not built for (the caller checks them first), -2 without memory.
 */
int radixrt_segment_attention(
    const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
    const int64_t *kv_indices, int num_segments, const int64_t *starts, const int64_t *lens,
    const int64_t *row_ptr, const int64_t *rows, int num_q_heads, int num_kv_heads, int head_dim, float scale,
    float softcap, int num_threads, void *out, float *lse, int f32
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
        radixrt_attention_run(&team, work, &next_item, q, q_row_stride, k_pool, v_pool, kv_indices, scale, softcap, out,
                              lse, NULL);
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
                                           row_ptr, q_rows, num_q_heads, num_kv_heads, head_dim, scale, 0.0f,
                                           num_threads, out, lse, 0);
    free(row_ptr);
    return status;
}
