/*
 * What the kernel sources share with each other (they are compiled into one
 * library): pieces that run inside a caller's OpenMP parallel region, so that
 * a whole decode step (decode_stack.c) forks its threads once instead of
 * once per op.
 */
#ifndef RADIXRT_CPU_KERNELS_H
#define RADIXRT_CPU_KERNELS_H

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

/*
 * The threads of one parallel region, meeting at our own spin barrier.
 *
 * libgomp's barriers spin only ~100 iterations before sleeping in the kernel once the process
 * has more OpenMP threads than CPUs, which it does as soon as two Python threads have run
 * parallel torch ops (the engine's thread and the one that loaded the model): every barrier of
 * a step then paid a futex sleep and wake-up. This barrier spins (with pause) and yields the CPU
 * after 2,000 spins: longer than a phase of a step waits for its partner, short enough that a
 * partner pushed off its core by another thread (a server's event loop) gets it back soon.
 * Figures: docs/kernels.md, "Spin barrier".
 */
typedef struct {
    atomic_int arrived;
    atomic_int generation;
} SpinBarrier;

typedef struct {
    SpinBarrier *barrier;
    int thread, threads;
} Team;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/*
 * Bytes a thread asks the memory for while it waits at a barrier: its share of the weights of
 * the step's next product. While a thread waits (for its partner's row work, attention, the
 * slower thread's share) nothing reads memory; requested then, into L2, those bytes no longer
 * wait in the product. A thread that has requested all of that share goes on to its share of
 * the product after. Figures: docs/kernels.md, "Barrier prefetch".
 */
typedef struct {
    const char *next, *end;  /* the next product's share, from where the requests have got to */
    const char *then, *then_end;  /* the share of the product after it, requested once that is done */
} Prefetch;

#define PREFETCH_WAIT_LINES 32  /* cache lines requested between two looks at the barrier */

/* Requests the next few lines of `pending` into L2; 0 when nothing is left to request. */
static inline int prefetch_some(Prefetch *pending) {
    if (pending->next >= pending->end) {
        if (pending->then >= pending->then_end) return 0;
        pending->next = pending->then, pending->end = pending->then_end;
        pending->then = pending->then_end = NULL;
    }
    for (int i = 0; i < PREFETCH_WAIT_LINES && pending->next < pending->end; i++, pending->next += 64)
        __builtin_prefetch(pending->next, 0, 2);  /* into L2 (prefetcht1 on x86) */
    return 1;
}

/* A barrier during which this thread requests `pending` (may be NULL), as far as it gets. */
static inline void team_wait(const Team *team, Prefetch *pending) {
    if (team->threads == 1) return;
    SpinBarrier *b = team->barrier;
    const int generation = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == team->threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->generation, generation + 1, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == generation; spins++) {
        if (pending != NULL && prefetch_some(pending)) continue;
        if (spins < 2000) cpu_relax();
        else sched_yield();
    }
}

static inline void team_barrier(const Team *team) { team_wait(team, NULL); }

/* This thread's equal share [first, last) of n items. */
static inline void team_share(const Team *team, int64_t n, int64_t *first, int64_t *last) {
    *first = n * team->thread / team->threads;
    *last = n * (team->thread + 1) / team->threads;
}

/* The entry points other kernels call, as the Python side does. */
int radixrt_quantized_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits,
                                  int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, int num_threads);
void radixrt_rms_norm_bf16(uint16_t *hidden, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                           int64_t rows, int64_t dim, float eps, int num_threads);

/* rms_norm.c: one row, y = rms_norm(x (+= residual first, in place, when residual is not NULL)) */
void radixrt_rms_norm_row(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *y, int64_t dim,
                          float eps);

/* int4_layer.c: out = silu(gate) * up, or gelu_tanh(gate) * up; RoPE on the first rotary_dim dims of each
 * of `heads` heads of one row (cos, signed_sin: [rotary_dim]); bf16 roundings of the torch layer */
void radixrt_silu_times(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n);
void radixrt_gelu_tanh_times(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n);
void radixrt_rope_row(uint16_t *heads_row, int64_t heads, int64_t head_dim, const uint16_t *cos,
                      const uint16_t *signed_sin);
void radixrt_rope_row_partial(uint16_t *heads_row, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                              const uint16_t *cos, const uint16_t *signed_sin);
/* int4_layer.c: Gemma's RMSNorm of one row: x * rsqrt(mean(x^2) + eps) * (1 + weight) in float32, rounded
 * once to bf16 (y may be x) */
void radixrt_gemma_norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t dim, float eps);

/*
 * quantized_matmul.c: out[r] = x[r] @ w.T for r < m (bf16 when out_bf16 is not NULL, else fp32),
 * the output columns of the weight's tiles [first_tile, last_tile) (QUANTIZED_TILE_ROWS rows of
 * w each, radixrt_quantized_tile_bytes(bits, num_cols) bytes, in order). A column's result does
 * not depend on the range it is computed in. scratch: radixrt_quantized_matmul_scratch_bytes(m,
 * num_cols) bytes, the caller's own.
 */
#define QUANTIZED_TILE_ROWS 16
void radixrt_quantized_matmul_tiles(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int bits,
                                    int64_t num_rows, int64_t num_cols, float *out, uint16_t *out_bf16, void *scratch,
                                    int64_t first_tile, int64_t last_tile);
int64_t radixrt_quantized_matmul_scratch_bytes(int64_t m, int64_t num_cols);
int64_t radixrt_quantized_tile_bytes(int bits, int64_t num_cols);

/*
 * packed_matrix.c: a weight matrix in the formats' packed layouts (format_matmul.h), its rows in
 * parts, each a run of rows of one format (a GGUF type number) in that format's tiles of
 * QUANTIZED_TILE_ROWS rows: a fused projection whose parts the file stores in different formats
 * (llama.cpp's Q4_K_M keeps some v and down rows in Q6_K) is one matrix. Every part's rows are
 * whole tiles, so a tile index over the matrix names one tile of one part, and a product's tiles
 * are divided among threads as one range whatever the parts. The embedding table is a matrix
 * too: one part of FORMAT_BF16 is a dense [vocab, dim] bf16 table.
 */
#define MATRIX_MAX_PARTS 3
typedef struct {
    int format;        /* GGUF type number (formats.h) */
    int64_t num_rows;  /* a multiple of QUANTIZED_TILE_ROWS */
    const uint8_t *tiles;
} MatrixPart;
typedef struct {
    int num_parts;
    int64_t num_cols;
    MatrixPart parts[MATRIX_MAX_PARTS];
} PackedMatrix;

int64_t radixrt_matrix_rows(const PackedMatrix *w);
/* 0 when w is num_rows x num_cols of formats with a packed layout in whole tiles (FORMAT_BF16
 * only as the single part of a table: `table` 1), else -1 */
int radixrt_matrix_check(const PackedMatrix *w, int64_t num_rows, int64_t num_cols, int table);
/* scratch bytes a thread's radixrt_matrix_multiply_tiles needs for m rows */
int64_t radixrt_matrix_scratch_bytes(const PackedMatrix *w, int64_t m);
/* radixrt_quantized_matmul_tiles' contract over the matrix's tiles [first_tile, last_tile) */
void radixrt_matrix_multiply_tiles(const PackedMatrix *w, const uint16_t *x, int64_t x_stride, int64_t m,
                                   float *out, uint16_t *out_bf16, void *scratch, int64_t first_tile,
                                   int64_t last_tile);
/* the bytes of tiles [first_tile, last_tile) of the part where first_tile is, and of the next part
 * when the range runs into it (a Prefetch's two ranges) */
void radixrt_matrix_tile_bytes(const PackedMatrix *w, int64_t first_tile, int64_t last_tile, const char *ranges[4]);
/* row `row` of the matrix as bf16 (out [num_cols]) */
void radixrt_matrix_row_bf16(const PackedMatrix *w, int64_t row, uint16_t *out);

/*
 * product_balance.c: how a team's threads divide each kind of a step's products, learnt from
 * their measured speeds (the state lives in a caller's buffer of radixrt_product_balance_bytes(),
 * zeroed, 64-byte aligned, kept from step to step; NULL: equal shares).
 */
enum { PRODUCT_QKV, PRODUCT_O, PRODUCT_GATE_UP, PRODUCT_DOWN, PRODUCT_HEAD, PRODUCT_KINDS };
typedef struct ProductBalance ProductBalance;
int64_t radixrt_product_balance_bytes(void);
/* This thread's tiles [first, last) of a product of `kind` over num_tiles tiles. */
void radixrt_product_tiles(const ProductBalance *balance, const Team *team, int kind, int64_t num_tiles,
                           int64_t *first, int64_t *last);
/* This thread computed `tiles` tiles of a product of `kind` in `ticks`. */
void radixrt_product_record(ProductBalance *balance, const Team *team, int kind, int64_t tiles, uint64_t ticks);
/* Thread 0, while the team's other threads neither record nor divide: the shares from what was recorded. */
void radixrt_product_rebalance(ProductBalance *balance, int threads);
/* A monotonic clock for the measurements (cycles where the CPU has a counter, else nanoseconds). */
uint64_t radixrt_ticks(void);

/* row_stats.c: one float32 row's first argmax, largest value and log-sum-exp */
void radixrt_row_stats_row(const float *x, int64_t cols, int64_t *argmax, float *maximum, float *lse);
/* row_stats.c: one float32 row's `count` largest values (largest first, ties in token order) as
 * tokens and values minus `shift`; count <= cols */
void radixrt_top_row(const float *x, int64_t cols, int count, float shift, int64_t *tokens, float *values);

/* sample_rows.c: one row's tokens that `allowed` (a bit per token, token t at bit t % 32 of word
 * t / 32) does not allow set to -inf, in place */
void radixrt_mask_row(float *x, int64_t cols, const int32_t *allowed);
/* sample_rows.c: one row's repetition, frequency and presence penalties, in place */
void radixrt_penalize_row(float *x, int64_t cols, const int32_t *seen, const int32_t *output_counts, float repetition,
                          float frequency, float presence);
/*
 * sample_rows.c: one float32 row's token drawn at `uniform` from softmax(x / temperature) after
 * its top-k, top-p and min-p filters (see radixrt_sample_rows). weights: cols floats of scratch
 * (read only with top_p < 1); block_scratch: a float per block of SAMPLE_BLOCK tokens.
 */
#define SAMPLE_BLOCK 64
int64_t radixrt_sample_row(const float *x, int64_t cols, float maximum, float temperature, int64_t top_k,
                           float top_p, float min_p, double uniform, float *weights, float *block_scratch);

/*
 * decode_attention.c: attention of query rows over runs of pool slots ("segments"), merged per
 * row by log-sum-exp. Segment s is the slots kv_indices[starts[s] ..][:lens[s]] and the query
 * rows rows[row_ptr[s] .. row_ptr[s + 1]); every key of a segment is visible to each of its
 * rows. A row listed in several segments attends their union: a shared prefix once for many
 * sequences, a sequence's own keys, a new token's keys among the step's new tokens.
 * Shapes: at most MAX_GROUP query heads per KV head, head_dim at most MAX_HEAD_DIM (the
 * `supports` check in Python).
 */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

typedef struct {
    int num_segments;
    const int64_t *starts, *lens, *row_ptr, *rows;
    int num_q_heads, num_kv_heads, head_dim;
    int f32;  /* q, the pools and out hold float32; 0 (what an initializer leaves): bf16 */
} Segments;

typedef struct AttentionWork AttentionWork;  /* the split into work items and the partial results */

/* the items for a team of `threads` (NULL without memory) */
AttentionWork *radixrt_attention_work_new(const Segments *segments, int threads);
void radixrt_attention_work_free(AttentionWork *work);

/*
 * Called by every thread of a team (ends with a barrier): out[row] ([*, Hq, D] bf16, or float32
 * with segments.f32) and, if lse
 * is not NULL, lse[row] ([*, Hq] float32, natural log) for each listed row. q rows [*, Hq, D],
 * head stride D; pools [slots, Hkv, D]. next_item: zero, shared by the team; the work items
 * are taken from it in turn (the last chunk of each segment is shorter). pending (may be NULL):
 * requested while the thread waits at the run's barriers (team_wait). softcap > 0: each score
 * (q * scale) . k becomes softcap * tanh(score / softcap) before the softmax (Gemma 2); 0: none.
 */
void radixrt_attention_run(const Team *team, AttentionWork *work, atomic_long *next_item, const void *q,
                           int64_t q_row_stride, const void *k_pool, const void *v_pool,
                           const int64_t *kv_indices, float scale, float softcap, void *out, float *lse,
                           Prefetch *pending);

/*
 * decode_stack.c: a Llama-family model on packed quantized weights as the whole-step kernels read
 * it, and one step of it run by every thread of a team (decode_run.c runs several in a row).
 * A plain Llama layer is the four products, two norms, SwiGLU and full rotary; what other
 * families add is in optional fields, each NULL or 0 when absent and looked at once a phase, never
 * inside a loop over a row's elements.
 */
#define STACK_MAX_PLANS 2  /* distinct attention plans (windows) of a model's layers: full and one window */
#define STACK_MAX_ROPES 2  /* rope tables: one, or Gemma 3's global and local ones */

/* A layer's weights as the stack reads them. */
typedef struct {
    const uint16_t *input_norm, *post_norm;  /* [dim] bf16 */
    PackedMatrix qkv, o, gate_up, down;
    const uint16_t *qkv_bias, *o_bias;  /* [qkv rows], [dim] bf16, added to the product's bf16 output */
    const uint16_t *q_norm, *k_norm;  /* [head_dim] bf16: RMSNorm of each q and k head before RoPE */
    /* Gemma: post_norm normalizes the attention output before the residual add; these around the MLP */
    const uint16_t *pre_ff_norm, *post_ff_norm;
    int rope;  /* which of the model's rope tables the layer rotates with */
    int plan;  /* which of the step's attention plans (segments: its window) it attends */
    float scale;  /* softmax scale */
    float softcap;  /* attention scores capped at softcap * tanh(score / softcap); 0: none */
} StackLayer;

typedef struct {
    const uint16_t *cos, *signed_sin;  /* [rows, rotary_dim] bf16 */
    int64_t rows;
} RopeTable;

typedef struct {
    const PackedMatrix *embedding;   /* [vocab, dim], rows dequantized to bf16 as looked up (dense: FORMAT_BF16) */
    int num_layers;
    const StackLayer *layers;        /* [num_layers] */
    const int64_t *k_pools, *v_pools;  /* [num_layers] addresses of [num_slots, Hkv, D] bf16 pools */
    int64_t num_slots;
    float eps;
    int num_q_heads, num_kv_heads, head_dim;
    int64_t dim, intermediate;
    int num_ropes;
    RopeTable ropes[STACK_MAX_ROPES];
    int64_t rotary_dim;  /* the leading dims of each head that rotate (head_dim: all) */
    int num_plans;
    int64_t windows[STACK_MAX_PLANS];  /* plan p's sliding window (0: full attention), for decode runs */
    const uint16_t *final_norm;  /* NULL with head */
    const PackedMatrix *head;    /* the LM head; NULL: no logits */
    ProductBalance *balance;     /* the caller's, learnt on from step to step; NULL: equal shares */
    int gemma;  /* Gemma's arithmetic: every norm radixrt_gemma_norm_row, GELU-tanh instead of SiLU */
    uint16_t embedding_scale;  /* bf16 the looked-up rows are multiplied by (Gemma); 0: none */
    float final_softcap;  /* logits capped at final_softcap * tanh(logit / final_softcap); 0: none */
} StackModel;

/* One step's rows: row r is token token_ids[r] at positions[r], its K/V stored at out_slots[r];
 * each layer attends as works[its plan] plans it over kv_indices (next_items: one zeroed counter
 * a layer); logits [num_logit_rows, head rows] of the normed rows logit_rows; hidden: [rows, dim]
 * or NULL (the buffers' own). */
typedef struct {
    int64_t rows;
    const int64_t *token_ids, *positions, *out_slots, *kv_indices;
    AttentionWork *works[STACK_MAX_PLANS];
    atomic_long *next_items;
    uint16_t *hidden;
    int64_t num_logit_rows;
    const int64_t *logit_rows;
    float *logits;
} StackStep;

/* One attention plan's segments (kernels.h, Segments) over a step's kv_indices. */
typedef struct {
    int num_segments;
    const int64_t *starts, *lens, *row_ptr, *rows;
} SegmentList;

typedef struct StackBuffers StackBuffers;  /* a step's activations and each thread's scratch */

/* -1 for heads, a head size or weight matrices the kernels do not take, else 0 */
int radixrt_stack_model_check(const StackModel *model);
/* buffers for steps of up to `rows` rows and `logit_rows` logit rows (NULL without memory) */
StackBuffers *radixrt_stack_buffers_new(const StackModel *model, int64_t rows, int64_t logit_rows, int own_hidden,
                                        int threads);
void radixrt_stack_buffers_free(StackBuffers *buffers);
/* Called by every thread of a team; no barrier after the head's product. Indices unchecked. */
void radixrt_stack_step(const Team *team, const StackModel *model, const StackStep *step, StackBuffers *buffers);

#endif
