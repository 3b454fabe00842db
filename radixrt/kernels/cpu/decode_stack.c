/*
 * A whole step of a plain Llama model on 4-bit weights, for a few new tokens
 * (a decode batch, a short extend), in one call and one OpenMP parallel
 * region: from token ids to the logits of the rows the caller samples.
 *
 * A batch-1 step is memory-bound: it must stream every 4-bit layer weight and
 * the LM head once. Done as three calls a layer (the two of int4_layer.c
 * around the attention backend) it read them at a fraction of the machine's
 * bandwidth: each op forked the threads again, and Python ran between the
 * calls; with the embedding, RoPE tables, final norm and head left to torch
 * around one call for the layers, a share of the step was still Python
 * (docs/kernels.md, "Whole step in one call"). Here the threads are forked
 * once for the whole step and meet at barriers between its phases:
 *
 *   hidden = embedding[token_ids]                     rows split over threads
 *   per layer:
 *     x = rms_norm(hidden)                            rows split
 *     qkv = x @ w_qkv.T                               weight tiles split
 *     RoPE on q and k; k, v into their pool slots    rows split
 *     attn = attention over the segments             (segment, head, chunk) items
 *     hidden += attn @ w_o.T; x = rms_norm(hidden)    tiles split; rows split
 *     [gate | up] = x @ w_gate_up.T                   tiles split
 *     hidden += (silu(gate) * up) @ w_down.T          rows split; tiles split; rows split
 *   logits = rms_norm(hidden[logit_rows]) @ head.T    rows split; tiles split (when a head is given)
 *
 * The arithmetic and its bf16 roundings are those of int4_layer.c,
 * decode_attention.c, rms_norm.c and quantized_matmul.c, so a step gets bit
 * for bit what the per-layer path computes (tests/test_decode_stack.py).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scalar.h"

enum { INPUT_NORM, QKV, O, POST_NORM, GATE_UP, DOWN, LAYER_WEIGHTS };

/* Widths of a q/k/v row and of the attention output. */
static inline int64_t qkv_width(const StackModel *m) {
    return (int64_t)(m->num_q_heads + 2 * m->num_kv_heads) * m->head_dim;
}
static inline int64_t attn_width(const StackModel *m) { return (int64_t)m->num_q_heads * m->head_dim; }

struct StackBuffers {
    uint16_t *normed, *qkv, *attn, *projected, *gate_up, *activated, *head_input, *own_hidden;
    char *scratch;
    int64_t scratch_per_thread;
};

/* Rows [first, last) of this thread's share of `rows`. */
#define FOR_SHARE(team, n, i) \
    int64_t i##_first, i##_last; \
    team_share(team, n, &i##_first, &i##_last); \
    for (int64_t i = i##_first; i < i##_last; i++)

/* A weight product of the step: its kind (for the balance), packed weight and shape. */
typedef struct {
    int kind;
    const void *weight;
    int bits;
    int64_t num_rows, num_cols;
} Product;

/* This thread's share of the product's weight, as bytes to request while waiting before it. */
static Prefetch share_of(const Team *team, const StackModel *m, Product p) {
    if (p.weight == NULL) return (Prefetch){NULL, NULL, NULL, NULL};
    int64_t first, last;
    radixrt_product_tiles(m->balance, team, p.kind, p.num_rows / QUANTIZED_TILE_ROWS, &first, &last);
    const int64_t tile_bytes = radixrt_quantized_tile_bytes(p.bits, p.num_cols);
    return (Prefetch){(const char *)p.weight + first * tile_bytes, (const char *)p.weight + last * tile_bytes, NULL, NULL};
}

/* Share `first`, then share `after` (kernels.h). */
static Prefetch followed_by(Prefetch first, Prefetch after) {
    first.then = after.next, first.then_end = after.end;
    return first;
}

/* This thread's share of out = x @ w.T ([rows, num_rows]), timed for the balance. */
static void multiply(const Team *team, const StackModel *m, Product p, const uint16_t *x, int64_t rows, float *out,
                     uint16_t *out_bf16, void *scratch) {
    int64_t first, last;
    radixrt_product_tiles(m->balance, team, p.kind, p.num_rows / QUANTIZED_TILE_ROWS, &first, &last);
    const uint64_t start = radixrt_ticks();
    radixrt_quantized_matmul_tiles(x, p.num_cols, rows, p.weight, p.bits, p.num_rows, p.num_cols, out, out_bf16,
                                   scratch, first, last);
    radixrt_product_record(m->balance, team, p.kind, last - first, radixrt_ticks() - start);
}

/* The layer's products, in the order the step multiplies them. */
static void layer_products(const StackModel *m, const int64_t *weights, Product products[4]) {
    const int64_t dim = m->dim, inter = m->intermediate;
    products[0] = (Product){PRODUCT_QKV, (const void *)weights[QKV], 4, qkv_width(m), dim};
    products[1] = (Product){PRODUCT_O, (const void *)weights[O], 4, dim, attn_width(m)};
    products[2] = (Product){PRODUCT_GATE_UP, (const void *)weights[GATE_UP], 4, 2 * inter, dim};
    products[3] = (Product){PRODUCT_DOWN, (const void *)weights[DOWN], 4, dim, inter};
}

/*
 * One layer (its `products`, as layer_products lists them), ending with `pending` set to this
 * thread's share of `next` (the next layer's qkv, or the head), which it then requests while it
 * waits; at each barrier before a product the thread requests its share of that product, and
 * then of the one after it.
 */
static void layer(const Team *team, const StackModel *m, const StackStep *st, const int64_t *weights,
                  const Product products[4], Product next, uint16_t *k_pool, uint16_t *v_pool,
                  atomic_long *next_item, uint16_t *hidden, const StackBuffers *b, void *scratch, Prefetch *pending) {
    const int64_t rows = st->rows, dim = m->dim, qkv_rows = qkv_width(m), attn_dim = attn_width(m);
    const int64_t inter = m->intermediate, kv_elems = (int64_t)m->num_kv_heads * m->head_dim;
    /* this thread's shares of the o, gate_up and down products and of `next` */
    const Prefetch shares[4] = {share_of(team, m, products[1]), share_of(team, m, products[2]),
                                share_of(team, m, products[3]), share_of(team, m, next)};
    {
        FOR_SHARE(team, rows, r)
            radixrt_rms_norm_row(hidden + r * dim, NULL, (const void *)weights[INPUT_NORM], b->normed + r * dim, dim,
                                 m->eps);
    }
    team_wait(team, pending);
    multiply(team, m, products[0], b->normed, rows, NULL, b->qkv, scratch);
    *pending = followed_by(shares[0], shares[1]);
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows, r) {
            uint16_t *row = b->qkv + r * qkv_rows;
            const int64_t table_row = st->positions[r] * m->head_dim;
            radixrt_rope_row(row, m->num_q_heads + m->num_kv_heads, m->head_dim, m->cos + table_row,
                             m->signed_sin + table_row);
            const uint16_t *k = row + attn_dim, *v = k + kv_elems;
            memcpy(k_pool + st->out_slots[r] * kv_elems, k, sizeof(uint16_t) * (size_t)kv_elems);
            memcpy(v_pool + st->out_slots[r] * kv_elems, v, sizeof(uint16_t) * (size_t)kv_elems);
        }
    }
    team_wait(team, pending);
    radixrt_attention_run(team, st->work, next_item, b->qkv, qkv_rows, k_pool, v_pool, st->kv_indices, m->scale,
                          b->attn, NULL, pending);
    multiply(team, m, products[1], b->attn, rows, NULL, b->projected, scratch);
    *pending = followed_by(shares[1], shares[2]);
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows, r)
            radixrt_rms_norm_row(hidden + r * dim, b->projected + r * dim, (const void *)weights[POST_NORM],
                                 b->normed + r * dim, dim, m->eps);
    }
    team_wait(team, pending);
    multiply(team, m, products[2], b->normed, rows, NULL, b->gate_up, scratch);
    *pending = followed_by(shares[2], shares[3]);
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows, r)
            radixrt_silu_times(b->gate_up + r * 2 * inter, b->gate_up + r * 2 * inter + inter,
                               b->activated + r * inter, inter);
    }
    team_wait(team, pending);
    multiply(team, m, products[3], b->activated, rows, NULL, b->projected, scratch);
    *pending = shares[3];
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows * dim, i)
            hidden[i] = float_to_bf16(bf16_to_float(hidden[i]) + bf16_to_float(b->projected[i]));
    }
    team_wait(team, pending);
}

int radixrt_stack_model_check(const StackModel *model) {
    const int hq = model->num_q_heads, hkv = model->num_kv_heads, d = model->head_dim;
    const int table = model->embedding_bits == 16 || (model->embedding_bits == 8 && model->dim % 32 == 0);
    return hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || d % 2 || !table ? -1 : 0;
}

StackBuffers *radixrt_stack_buffers_new(const StackModel *m, int64_t rows, int64_t logit_rows, int own_hidden,
                                        int threads) {
    const int64_t dim = m->dim, inter = m->intermediate, attn_dim = attn_width(m), qkv_rows = qkv_width(m);
    const int64_t widest = dim > attn_dim ? (dim > inter ? dim : inter) : (attn_dim > inter ? attn_dim : inter);
    StackBuffers *b = calloc(1, sizeof(StackBuffers));
    if (b == NULL) return NULL;
    b->scratch_per_thread = radixrt_quantized_matmul_scratch_bytes(rows > logit_rows ? rows : logit_rows, widest);
    b->normed = malloc(sizeof(uint16_t) * rows * dim);
    b->qkv = malloc(sizeof(uint16_t) * rows * qkv_rows);
    b->attn = malloc(sizeof(uint16_t) * rows * attn_dim);
    b->projected = malloc(sizeof(uint16_t) * rows * dim);
    b->gate_up = malloc(sizeof(uint16_t) * rows * 2 * inter);
    b->activated = malloc(sizeof(uint16_t) * rows * inter);
    b->head_input = logit_rows ? malloc(sizeof(uint16_t) * logit_rows * dim) : NULL;
    b->own_hidden = own_hidden ? malloc(sizeof(uint16_t) * rows * dim) : NULL;
    b->scratch = malloc((size_t)(b->scratch_per_thread * threads));
    if (!b->normed || !b->qkv || !b->attn || !b->projected || !b->gate_up || !b->activated ||
        (logit_rows && !b->head_input) || (own_hidden && !b->own_hidden) || !b->scratch) {
        radixrt_stack_buffers_free(b);
        return NULL;
    }
    return b;
}

void radixrt_stack_buffers_free(StackBuffers *b) {
    if (b == NULL) return;
    free(b->normed);
    free(b->qkv);
    free(b->attn);
    free(b->projected);
    free(b->gate_up);
    free(b->activated);
    free(b->head_input);
    free(b->own_hidden);
    free(b->scratch);
    free(b);
}

/* Row `token` of the embedding as bf16. An 8-bit table is a tied LM head in quantized_matmul.c's
 * layout (tiles of 16 rows; per group of 32 inputs 8 vectors of (row, 4 inputs) bytes q + 128, then
 * 16 fp16 scales): each weight q * d in float (exact) rounded once, as a dense load rounds it. */
static void embedding_row(const StackModel *m, int64_t token, uint16_t *out) {
    const int64_t dim = m->dim;
    if (m->embedding_bits != 8) {
        memcpy(out, (const uint16_t *)m->embedding + token * dim, sizeof(uint16_t) * (size_t)dim);
        return;
    }
    const int64_t groups = dim / 32, row = token % 16, block_bytes = 8 * 64 + 16 * 2;
    const uint8_t *blocks = (const uint8_t *)m->embedding + token / 16 * groups * block_bytes;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = blocks + g * block_bytes;
        uint16_t half;
        memcpy(&half, block + 8 * 64 + 2 * row, sizeof half);
        const float d = fp16_to_float(half);
        for (int c = 0; c < 8; c++)
            for (int j = 0; j < 4; j++)
                out[32 * g + 4 * c + j] = float_to_bf16((float)((int)block[64 * c + 4 * row + j] - 128) * d);
    }
}

void radixrt_stack_step(const Team *team, const StackModel *m, const StackStep *step, StackBuffers *b) {
    const int64_t rows = step->rows, dim = m->dim;
    uint16_t *hidden = step->hidden != NULL ? step->hidden : b->own_hidden;
    char *own_scratch = b->scratch + b->scratch_per_thread * team->thread;
    {
        FOR_SHARE(team, rows, r)
            embedding_row(m, step->token_ids[r], hidden + r * dim);
    }
    if (team->thread == 0) radixrt_product_rebalance(m->balance, team->threads);
    team_barrier(team);
    const int with_head = step->num_logit_rows > 0;
    const Product head = {PRODUCT_HEAD, with_head ? m->head : NULL, m->head_bits, m->head_rows, dim};
    Product current[4] = {head};  /* the layer's products; the head's alone after the last layer */
    if (m->num_layers > 0) layer_products(m, m->layer_weights, current);
    Prefetch pending = share_of(team, m, current[0]);
    for (int i = 0; i < m->num_layers; i++) {
        const int64_t *weights = m->layer_weights + i * LAYER_WEIGHTS;
        Product next[4] = {head};
        if (i + 1 < m->num_layers) layer_products(m, weights + LAYER_WEIGHTS, next);
        layer(team, m, step, weights, current, next[0], (uint16_t *)m->k_pools[i], (uint16_t *)m->v_pools[i],
              &step->next_items[i], hidden, b, own_scratch, &pending);
        memcpy(current, next, sizeof current);
    }
    if (with_head) {
        {
            FOR_SHARE(team, step->num_logit_rows, i)
                radixrt_rms_norm_row(hidden + step->logit_rows[i] * dim, NULL, m->final_norm, b->head_input + i * dim,
                                     dim, m->eps);
        }
        team_wait(team, &pending);
        multiply(team, m, head, b->head_input, step->num_logit_rows, step->logits, NULL, own_scratch);
    }
}

/*
 * token_ids [rows] (rows of embedding: [vocab, dim] bf16, or with embedding_bits 8 a packed 8-bit
 * [vocab, dim] weight, see embedding_row) through every layer into hidden
 * [rows, dim] bf16. layer_weights: [num_layers, 6] addresses (input norm, qkv, o,
 * post-attention norm, gate_up, down; the projections packed 4-bit); k_pools, v_pools:
 * [num_layers] addresses of [num_slots, Hkv, D] pools. Row r's K/V go to slot out_slots[r]
 * before attention; attention reads the segments (kernels.h) over kv_indices. Row r rotates
 * with row positions[r] of cos and signed_sin, [table_rows, head_dim]. With head not NULL,
 * logits [num_logit_rows, head_rows] fp32 = rms_norm(hidden[logit_rows[i]], final_norm) @
 * head.T (head packed with head_bits bits); hidden is left after the last layer either way
 * (hidden NULL: a buffer of the call's own, when only the logits are wanted). balance: the
 * caller's ProductBalance (product_balance.c), learnt on across calls, or NULL.
 * Returns 0, -1 for a shape the kernels do not take, -2 without memory, -3 for a slot outside
 * the pools, -4 for a token id outside the embedding, -5 for a position outside the tables, -6 for a
 * logit row outside the step (nothing computed).
 */
int radixrt_int4_decode_stack_bf16(
    const int64_t *token_ids, const void *embedding, int embedding_bits, int64_t vocab, uint16_t *hidden, int64_t rows,
    int64_t dim,
    int num_layers, const int64_t *layer_weights, const int64_t *k_pools, const int64_t *v_pools, int64_t num_slots,
    float eps, int num_q_heads, int num_kv_heads, int head_dim, int64_t intermediate, float scale,
    const int64_t *positions, const uint16_t *cos, const uint16_t *signed_sin, int64_t table_rows,
    const int64_t *out_slots, const int64_t *kv_indices,
    int num_segments, const int64_t *seg_starts, const int64_t *seg_lens, const int64_t *seg_row_ptr,
    const int64_t *seg_rows,
    const uint16_t *final_norm, const uint8_t *head, int head_bits, int64_t head_rows,
    int64_t num_logit_rows, const int64_t *logit_rows, float *logits, ProductBalance *balance, int num_threads
) {
    const StackModel model = {
        embedding, vocab, dim, num_layers, layer_weights, k_pools, v_pools, num_slots, eps, scale, num_q_heads,
        num_kv_heads, head_dim, intermediate, cos, signed_sin, table_rows, final_norm, head, head_bits, head_rows,
        balance, embedding_bits,
    };
    if (radixrt_stack_model_check(&model)) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (out_slots[r] < 0 || out_slots[r] >= num_slots) return -3;
    for (int s = 0; s < num_segments; s++)
        for (int64_t j = 0; j < seg_lens[s]; j++)
            if (kv_indices[seg_starts[s] + j] < 0 || kv_indices[seg_starts[s] + j] >= num_slots) return -3;
    for (int64_t r = 0; r < rows; r++) {
        if (token_ids[r] < 0 || token_ids[r] >= vocab) return -4;
        if (positions[r] < 0 || positions[r] >= table_rows) return -5;
    }
    if (head == NULL) num_logit_rows = 0;
    for (int64_t i = 0; i < num_logit_rows; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= rows) return -6;
    Segments seg = {num_segments, seg_starts, seg_lens, seg_row_ptr, seg_rows, num_q_heads, num_kv_heads, head_dim, 0};
    StackBuffers *buffers = radixrt_stack_buffers_new(&model, rows, num_logit_rows, hidden == NULL, num_threads);
    AttentionWork *work = radixrt_attention_work_new(&seg, num_threads);
    atomic_long *next_items = calloc(num_layers, sizeof(atomic_long));  /* each layer's attention item counter */
    SpinBarrier barrier = {0, 0};
    int status = -2;
    if (buffers && work && next_items) {
        status = 0;
        const StackStep step = {rows, token_ids, positions, out_slots, kv_indices, work, next_items, hidden,
                                num_logit_rows, logit_rows, logits};
        #pragma omp parallel num_threads(num_threads)
        {
            Team team = {&barrier, omp_get_thread_num(), omp_get_num_threads()};
            radixrt_stack_step(&team, &model, &step, buffers);
        }
    }
    free(next_items);
    radixrt_attention_work_free(work);
    radixrt_stack_buffers_free(buffers);
    return status;
}
