/*
 * A whole step of a Llama-family model on packed quantized weights, for a few new tokens
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
 * Other families' layers (kernels.h, StackLayer) add biases after the qkv and o products,
 * an RMSNorm of each q and k head before RoPE, RoPE over the leading rotary_dim dims of a head,
 * per-layer rope tables, windows (a plan of segments each), softmax scales and score caps, and
 * Gemma's norms around each sublayer, GELU-tanh, embedding scale and final logit cap; each is
 * looked at once a phase, so a plain layer runs the loops it always ran.
 *
 * The arithmetic and its bf16 roundings are those of int4_layer.c,
 * decode_attention.c, rms_norm.c and the formats' kernels (packed_matrix.c), so
 * a step gets bit for bit what the per-layer path computes
 * (tests/test_decode_stack.py, tests/test_stack_families.py), but for Gemma's
 * norms, GELU-tanh and caps: rounded where torch rounds them, reduced in another
 * order or through libm's tanhf, so within bf16 noise of it. A weight is a PackedMatrix (kernels.h): its
 * format is data, and a fused projection may hold parts of several formats.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scalar.h"

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

/* A weight product of the step: its kind (for the balance) and weight (NULL: none). */
typedef struct {
    int kind;
    const PackedMatrix *weight;
} Product;

static int64_t product_tiles(Product p) { return radixrt_matrix_rows(p.weight) / QUANTIZED_TILE_ROWS; }

/* This thread's share of the product's weight, as bytes to request while waiting before it: the
 * share's bytes in the part where it starts, and in the next part when it runs into one. */
static Prefetch share_of(const Team *team, const StackModel *m, Product p) {
    if (p.weight == NULL) return (Prefetch){NULL, NULL, NULL, NULL};
    int64_t first, last;
    radixrt_product_tiles(m->balance, team, p.kind, product_tiles(p), &first, &last);
    const char *ranges[4];
    radixrt_matrix_tile_bytes(p.weight, first, last, ranges);
    return (Prefetch){ranges[0], ranges[1], ranges[2], ranges[3]};
}

/* Share `first`, then share `after` (kernels.h); a share that already spans two parts keeps its
 * second range instead (the requests are a hint: a part's bytes not asked for are read later). */
static Prefetch followed_by(Prefetch first, Prefetch after) {
    if (first.then == NULL) first.then = after.next, first.then_end = after.end;
    return first;
}

/* This thread's share of out = x @ w.T ([rows, num_rows]), timed for the balance. */
static void multiply(const Team *team, const StackModel *m, Product p, const uint16_t *x, int64_t rows, float *out,
                     uint16_t *out_bf16, void *scratch) {
    int64_t first, last;
    radixrt_product_tiles(m->balance, team, p.kind, product_tiles(p), &first, &last);
    const uint64_t start = radixrt_ticks();
    radixrt_matrix_multiply_tiles(p.weight, x, p.weight->num_cols, rows, out, out_bf16, scratch, first, last);
    radixrt_product_record(m->balance, team, p.kind, last - first, radixrt_ticks() - start);
}

/* The layer's products, in the order the step multiplies them. */
static void layer_products(const StackLayer *weights, Product products[4]) {
    products[0] = (Product){PRODUCT_QKV, &weights->qkv};
    products[1] = (Product){PRODUCT_O, &weights->o};
    products[2] = (Product){PRODUCT_GATE_UP, &weights->gate_up};
    products[3] = (Product){PRODUCT_DOWN, &weights->down};
}

/* x += y, each sum rounded to bf16 (a bias, or a normed sublayer output joining the residual). */
static void add_row(uint16_t *x, const uint16_t *y, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

/* One q or k head normalized in place with its norm's weight ([head_dim]), as the model's norms do. */
static void head_norm(const StackModel *m, uint16_t *head, const uint16_t *weight) {
    if (m->gemma) radixrt_gemma_norm_row(head, weight, head, m->head_dim, m->eps);
    else radixrt_rms_norm_row(head, NULL, weight, head, m->head_dim, m->eps);
}

/*
 * One layer (its `products`, as layer_products lists them), ending with `pending` set to this
 * thread's share of `next` (the next layer's qkv, or the head), which it then requests while it
 * waits; at each barrier before a product the thread requests its share of that product, and
 * then of the one after it.
 */
static void layer(const Team *team, const StackModel *m, const StackStep *st, const StackLayer *weights,
                  const Product products[4], Product next, uint16_t *k_pool, uint16_t *v_pool,
                  atomic_long *next_item, uint16_t *hidden, const StackBuffers *b, void *scratch, Prefetch *pending) {
    const int64_t rows = st->rows, dim = m->dim, qkv_rows = qkv_width(m), attn_dim = attn_width(m);
    const int64_t inter = m->intermediate, kv_elems = (int64_t)m->num_kv_heads * m->head_dim;
    const int64_t head_dim = m->head_dim, rotary_dim = m->rotary_dim;
    const int gemma = m->gemma;
    const RopeTable *rope = &m->ropes[weights->rope];
    /* this thread's shares of the o, gate_up and down products and of `next` */
    const Prefetch shares[4] = {share_of(team, m, products[1]), share_of(team, m, products[2]),
                                share_of(team, m, products[3]), share_of(team, m, next)};
    {
        FOR_SHARE(team, rows, r) {
            if (gemma) radixrt_gemma_norm_row(hidden + r * dim, weights->input_norm, b->normed + r * dim, dim, m->eps);
            else radixrt_rms_norm_row(hidden + r * dim, NULL, weights->input_norm, b->normed + r * dim, dim, m->eps);
        }
    }
    team_wait(team, pending);
    multiply(team, m, products[0], b->normed, rows, NULL, b->qkv, scratch);
    *pending = followed_by(shares[0], shares[1]);
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows, r) {
            uint16_t *row = b->qkv + r * qkv_rows;
            if (weights->qkv_bias != NULL) add_row(row, weights->qkv_bias, qkv_rows);
            if (weights->q_norm != NULL) {
                uint16_t *k_heads = row + attn_dim;
                for (int h = 0; h < m->num_q_heads; h++) head_norm(m, row + h * head_dim, weights->q_norm);
                for (int h = 0; h < m->num_kv_heads; h++) head_norm(m, k_heads + h * head_dim, weights->k_norm);
            }
            const int64_t table_row = st->positions[r] * rotary_dim;
            radixrt_rope_row_partial(row, m->num_q_heads + m->num_kv_heads, head_dim, rotary_dim,
                                     rope->cos + table_row, rope->signed_sin + table_row);
            const uint16_t *k = row + attn_dim, *v = k + kv_elems;
            memcpy(k_pool + st->out_slots[r] * kv_elems, k, sizeof(uint16_t) * (size_t)kv_elems);
            memcpy(v_pool + st->out_slots[r] * kv_elems, v, sizeof(uint16_t) * (size_t)kv_elems);
        }
    }
    team_wait(team, pending);
    radixrt_attention_run(team, st->works[weights->plan], next_item, b->qkv, qkv_rows, k_pool, v_pool,
                          st->kv_indices, weights->scale, weights->softcap, b->attn, NULL, pending);
    multiply(team, m, products[1], b->attn, rows, NULL, b->projected, scratch);
    *pending = followed_by(shares[1], shares[2]);
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows, r) {
            uint16_t *projected = b->projected + r * dim, *h = hidden + r * dim, *normed = b->normed + r * dim;
            if (weights->o_bias != NULL) add_row(projected, weights->o_bias, dim);
            if (weights->pre_ff_norm != NULL) {  /* Gemma: hidden += norm(attn); x = norm(hidden) */
                radixrt_gemma_norm_row(projected, weights->post_norm, projected, dim, m->eps);
                add_row(h, projected, dim);
                radixrt_gemma_norm_row(h, weights->pre_ff_norm, normed, dim, m->eps);
            } else {
                radixrt_rms_norm_row(h, projected, weights->post_norm, normed, dim, m->eps);
            }
        }
    }
    team_wait(team, pending);
    multiply(team, m, products[2], b->normed, rows, NULL, b->gate_up, scratch);
    *pending = followed_by(shares[2], shares[3]);
    team_wait(team, pending);
    {
        FOR_SHARE(team, rows, r) {
            const uint16_t *gate = b->gate_up + r * 2 * inter;
            if (gemma) radixrt_gelu_tanh_times(gate, gate + inter, b->activated + r * inter, inter);
            else radixrt_silu_times(gate, gate + inter, b->activated + r * inter, inter);
        }
    }
    team_wait(team, pending);
    multiply(team, m, products[3], b->activated, rows, NULL, b->projected, scratch);
    *pending = shares[3];
    team_wait(team, pending);
    if (weights->post_ff_norm != NULL) {  /* Gemma: hidden += norm(mlp) */
        FOR_SHARE(team, rows, r) {
            uint16_t *projected = b->projected + r * dim;
            radixrt_gemma_norm_row(projected, weights->post_ff_norm, projected, dim, m->eps);
            add_row(hidden + r * dim, projected, dim);
        }
    } else {
        FOR_SHARE(team, rows * dim, i)
            hidden[i] = float_to_bf16(bf16_to_float(hidden[i]) + bf16_to_float(b->projected[i]));
    }
    team_wait(team, pending);
}

int radixrt_stack_model_check(const StackModel *m) {
    const int hq = m->num_q_heads, hkv = m->num_kv_heads, d = m->head_dim;
    if (hkv < 1 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || d % 2) return -1;
    if (m->rotary_dim < 2 || m->rotary_dim > d || m->rotary_dim % 2 || m->num_ropes < 1 ||
        m->num_ropes > STACK_MAX_ROPES || m->num_plans < 1 || m->num_plans > STACK_MAX_PLANS)
        return -1;
    for (int i = 0; i < m->num_ropes; i++)
        if (m->ropes[i].cos == NULL || m->ropes[i].signed_sin == NULL) return -1;
    if (m->embedding == NULL || radixrt_matrix_check(m->embedding, radixrt_matrix_rows(m->embedding), m->dim, 1))
        return -1;
    if (m->head != NULL && radixrt_matrix_check(m->head, radixrt_matrix_rows(m->head), m->dim, 0)) return -1;
    const int64_t dim = m->dim, inter = m->intermediate;
    for (int i = 0; i < m->num_layers; i++) {
        const StackLayer *l = &m->layers[i];
        if (radixrt_matrix_check(&l->qkv, qkv_width(m), dim, 0) || radixrt_matrix_check(&l->o, dim, attn_width(m), 0) ||
            radixrt_matrix_check(&l->gate_up, 2 * inter, dim, 0) || radixrt_matrix_check(&l->down, dim, inter, 0))
            return -1;
        if (l->rope < 0 || l->rope >= m->num_ropes || l->plan < 0 || l->plan >= m->num_plans || l->scale <= 0.0f ||
            l->softcap < 0.0f || (l->q_norm == NULL) != (l->k_norm == NULL) ||
            (l->pre_ff_norm == NULL) != (l->post_ff_norm == NULL) || (l->pre_ff_norm != NULL && !m->gemma))
            return -1;
    }
    return 0;
}

/* The most scratch a thread's product of m rows needs, over the model's weights. */
static int64_t scratch_bytes(const StackModel *m, int64_t rows, int64_t logit_rows) {
    int64_t most = m->head != NULL ? radixrt_matrix_scratch_bytes(m->head, logit_rows) : 0;
    for (int i = 0; i < m->num_layers; i++) {
        const StackLayer *l = &m->layers[i];
        const PackedMatrix *weights[4] = {&l->qkv, &l->o, &l->gate_up, &l->down};
        for (int w = 0; w < 4; w++) {
            const int64_t bytes = radixrt_matrix_scratch_bytes(weights[w], rows);
            most = bytes > most ? bytes : most;
        }
    }
    return most;
}

StackBuffers *radixrt_stack_buffers_new(const StackModel *m, int64_t rows, int64_t logit_rows, int own_hidden,
                                        int threads) {
    const int64_t dim = m->dim, inter = m->intermediate, attn_dim = attn_width(m), qkv_rows = qkv_width(m);
    StackBuffers *b = calloc(1, sizeof(StackBuffers));
    if (b == NULL) return NULL;
    b->scratch_per_thread = (scratch_bytes(m, rows, logit_rows) + 63) / 64 * 64;
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

void radixrt_stack_step(const Team *team, const StackModel *m, const StackStep *step, StackBuffers *b) {
    const int64_t rows = step->rows, dim = m->dim;
    uint16_t *hidden = step->hidden != NULL ? step->hidden : b->own_hidden;
    char *own_scratch = b->scratch + b->scratch_per_thread * team->thread;
    {
        FOR_SHARE(team, rows, r) {
            uint16_t *row = hidden + r * dim;
            radixrt_matrix_row_bf16(m->embedding, step->token_ids[r], row);
            if (m->embedding_scale != 0) {
                const float scale = bf16_to_float(m->embedding_scale);
                #pragma omp simd
                for (int64_t i = 0; i < dim; i++) row[i] = float_to_bf16(bf16_to_float(row[i]) * scale);
            }
        }
    }
    if (team->thread == 0) radixrt_product_rebalance(m->balance, team->threads);
    team_barrier(team);
    const int with_head = step->num_logit_rows > 0;
    const Product head = {PRODUCT_HEAD, with_head ? m->head : NULL};
    Product current[4] = {head};  /* the layer's products; the head's alone after the last layer */
    if (m->num_layers > 0) layer_products(m->layers, current);
    Prefetch pending = share_of(team, m, current[0]);
    for (int i = 0; i < m->num_layers; i++) {
        const StackLayer *weights = &m->layers[i];
        Product next[4] = {head};
        if (i + 1 < m->num_layers) layer_products(weights + 1, next);
        layer(team, m, step, weights, current, next[0], (uint16_t *)m->k_pools[i], (uint16_t *)m->v_pools[i],
              &step->next_items[i], hidden, b, own_scratch, &pending);
        memcpy(current, next, sizeof current);
    }
    if (with_head) {
        {
            FOR_SHARE(team, step->num_logit_rows, i) {
                uint16_t *row = hidden + step->logit_rows[i] * dim, *out = b->head_input + i * dim;
                if (m->gemma) radixrt_gemma_norm_row(row, m->final_norm, out, dim, m->eps);
                else radixrt_rms_norm_row(row, NULL, m->final_norm, out, dim, m->eps);
            }
        }
        team_wait(team, &pending);
        int64_t first, last;
        radixrt_product_tiles(m->balance, team, PRODUCT_HEAD, product_tiles(head), &first, &last);
        multiply(team, m, head, b->head_input, step->num_logit_rows, step->logits, NULL, own_scratch);
        if (m->final_softcap > 0.0f) {  /* this thread's columns, as torch's tanh(logits / cap) * cap */
            const float cap = m->final_softcap;
            const int64_t head_rows = radixrt_matrix_rows(m->head);
            for (int64_t i = 0; i < step->num_logit_rows; i++) {
                float *logits = step->logits + i * head_rows;
                for (int64_t c = first * QUANTIZED_TILE_ROWS; c < last * QUANTIZED_TILE_ROWS; c++)
                    logits[c] = tanhf(logits[c] / cap) * cap;
            }
        }
    }
}

/*
 * token_ids [rows] (rows of model->embedding) through every layer of `model` (kernels.h:
 * StackModel, built once by the caller, its pools and tables current) into hidden [rows, dim]
 * bf16. Row r's K/V go to slot out_slots[r] before attention; a layer attends the segments of
 * plans[its plan] (kernels.h; model->num_plans of them) over kv_indices. Row r rotates with row
 * positions[r] of its layer's rope table. With num_logit_rows > 0 and a head, logits
 * [num_logit_rows, head rows] fp32 = rms_norm(hidden[logit_rows[i]], final_norm) @ head.T (soft-capped
 * where the model says); hidden is left after the last layer
 * either way (hidden NULL: a buffer of the call's own, when only the logits are wanted).
 * Returns 0, -1 for a shape the kernels do not take, -2 without memory, -3 for a slot outside
 * the pools, -4 for a token id outside the embedding, -5 for a position outside the tables, -6 for a
 * logit row outside the step (nothing computed).
 */
int radixrt_decode_stack_bf16(
    const StackModel *m, const int64_t *token_ids, int64_t rows, uint16_t *hidden, const int64_t *positions,
    const int64_t *out_slots, const int64_t *kv_indices, const SegmentList *plans, int64_t num_logit_rows,
    const int64_t *logit_rows, float *logits, int num_threads
) {
    const StackModel model = *m;
    const int64_t num_slots = model.num_slots;
    const int num_layers = model.num_layers;
    if (radixrt_stack_model_check(&model)) return -1;
    const int64_t vocab = radixrt_matrix_rows(model.embedding);
    for (int64_t r = 0; r < rows; r++)
        if (out_slots[r] < 0 || out_slots[r] >= num_slots) return -3;
    for (int p = 0; p < model.num_plans; p++) {
        const SegmentList *list = &plans[p];
        for (int s = 0; s < list->num_segments; s++)
            for (int64_t j = 0; j < list->lens[s]; j++)
                if (kv_indices[list->starts[s] + j] < 0 || kv_indices[list->starts[s] + j] >= num_slots) return -3;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (token_ids[r] < 0 || token_ids[r] >= vocab) return -4;
        for (int t = 0; t < model.num_ropes; t++)
            if (positions[r] < 0 || positions[r] >= model.ropes[t].rows) return -5;
    }
    if (model.head == NULL || logits == NULL) num_logit_rows = 0;
    for (int64_t i = 0; i < num_logit_rows; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= rows) return -6;
    StackBuffers *buffers = radixrt_stack_buffers_new(&model, rows, num_logit_rows, hidden == NULL, num_threads);
    StackStep step = {rows, token_ids, positions, out_slots, kv_indices, {NULL}, NULL, hidden, num_logit_rows,
                      logit_rows, logits};
    int planned = 1;
    for (int p = 0; p < model.num_plans; p++) {
        const SegmentList *list = &plans[p];
        Segments seg = {list->num_segments, list->starts, list->lens, list->row_ptr, list->rows, model.num_q_heads,
                        model.num_kv_heads, model.head_dim, 0};
        step.works[p] = radixrt_attention_work_new(&seg, num_threads);
        planned &= step.works[p] != NULL;
    }
    atomic_long *next_items = calloc(num_layers, sizeof(atomic_long));  /* each layer's attention item counter */
    step.next_items = next_items;
    SpinBarrier barrier = {0, 0};
    int status = -2;
    if (buffers && planned && next_items) {
        status = 0;
        #pragma omp parallel num_threads(num_threads)
        {
            Team team = {&barrier, omp_get_thread_num(), omp_get_num_threads()};
            radixrt_stack_step(&team, &model, &step, buffers);
        }
    }
    free(next_items);
    for (int p = 0; p < model.num_plans; p++) radixrt_attention_work_free(step.works[p]);
    radixrt_stack_buffers_free(buffers);
    return status;
}
