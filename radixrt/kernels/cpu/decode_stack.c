/*
 * Every layer of a plain Llama model on 4-bit weights, for a step of a few
 * new tokens (a decode batch, a short extend), in one call and one OpenMP
 * parallel region.
 *
 * A batch-1 step of the bundled model is memory-bound: it must stream the
 * ~66 MB of 4-bit layer weights once. Done as three calls a layer (the two
 * of int4_layer.c around the attention backend) it read them at a fraction
 * of the machine's bandwidth: each op forked the threads again, and Python
 * ran between the calls. Here the threads are forked once for the whole
 * step and meet at barriers between the phases of each layer:
 *
 *   x = rms_norm(hidden)                              rows split over threads
 *   qkv = x @ w_qkv.T                                 weight tiles split
 *   RoPE on q and k; k, v into their pool slots      rows split
 *   attn = attention over the segments               (segment, head, chunk) items
 *   hidden += attn @ w_o.T; x = rms_norm(hidden)      tiles split; rows split
 *   [gate | up] = x @ w_gate_up.T                     tiles split
 *   hidden += (silu(gate) * up) @ w_down.T            rows split; tiles split; rows split
 *
 * The arithmetic and its bf16 roundings are those of int4_layer.c and
 * decode_attention.c, so a decode batch gets bit for bit what the per-layer
 * path computes (tests/test_decode_stack.py).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scalar.h"

enum { INPUT_NORM, QKV, O, POST_NORM, GATE_UP, DOWN, LAYER_WEIGHTS };

typedef struct {
    int64_t rows, dim, qkv_rows, attn_dim, intermediate;
    int num_q_heads, num_kv_heads, head_dim;
    float eps, scale;
    const uint16_t *cos, *signed_sin;
    const int64_t *out_slots, *kv_indices;
} Step;

typedef struct {
    uint16_t *normed, *qkv, *attn, *projected, *gate_up, *activated;
} Buffers;

/* Rows [first, last) of this thread's share of `rows`. */
#define FOR_SHARE(team, n, i) \
    int64_t i##_first, i##_last; \
    team_share(team, n, &i##_first, &i##_last); \
    for (int64_t i = i##_first; i < i##_last; i++)

static void layer(const Team *team, const Step *st, const void *const *weights, uint16_t *k_pool, uint16_t *v_pool,
                  AttentionWork *work, atomic_long *next_item, uint16_t *hidden, const Buffers *b, float *x_sums) {
    const int64_t rows = st->rows, dim = st->dim, qkv_rows = st->qkv_rows, inter = st->intermediate;
    const int64_t kv_elems = (int64_t)st->num_kv_heads * st->head_dim;
    {
        FOR_SHARE(team, rows, r)
            radixrt_rms_norm_row(hidden + r * dim, NULL, weights[INPUT_NORM], b->normed + r * dim, dim, st->eps);
    }
    team_barrier(team);
    radixrt_quantized_matmul_share(team, b->normed, dim, rows, weights[QKV], 4, qkv_rows, dim, NULL, b->qkv, x_sums);
    team_barrier(team);
    {
        FOR_SHARE(team, rows, r) {
            uint16_t *row = b->qkv + r * qkv_rows;
            radixrt_rope_row(row, st->num_q_heads + st->num_kv_heads, st->head_dim, st->cos + r * st->head_dim,
                             st->signed_sin + r * st->head_dim);
            const uint16_t *k = row + st->attn_dim, *v = k + kv_elems;
            memcpy(k_pool + st->out_slots[r] * kv_elems, k, sizeof(uint16_t) * (size_t)kv_elems);
            memcpy(v_pool + st->out_slots[r] * kv_elems, v, sizeof(uint16_t) * (size_t)kv_elems);
        }
    }
    team_barrier(team);
    radixrt_attention_run(team, work, next_item, b->qkv, qkv_rows, k_pool, v_pool, st->kv_indices, st->scale, b->attn,
                          NULL);
    radixrt_quantized_matmul_share(team, b->attn, st->attn_dim, rows, weights[O], 4, dim, st->attn_dim, NULL,
                                   b->projected, x_sums);
    team_barrier(team);
    {
        FOR_SHARE(team, rows, r)
            radixrt_rms_norm_row(hidden + r * dim, b->projected + r * dim, weights[POST_NORM], b->normed + r * dim,
                                 dim, st->eps);
    }
    team_barrier(team);
    radixrt_quantized_matmul_share(team, b->normed, dim, rows, weights[GATE_UP], 4, 2 * inter, dim, NULL, b->gate_up,
                                   x_sums);
    team_barrier(team);
    {
        FOR_SHARE(team, rows, r)
            radixrt_silu_times(b->gate_up + r * 2 * inter, b->gate_up + r * 2 * inter + inter,
                               b->activated + r * inter, inter);
    }
    team_barrier(team);
    radixrt_quantized_matmul_share(team, b->activated, inter, rows, weights[DOWN], 4, dim, inter, NULL, b->projected,
                                   x_sums);
    team_barrier(team);
    {
        FOR_SHARE(team, rows * dim, i)
            hidden[i] = float_to_bf16(bf16_to_float(hidden[i]) + bf16_to_float(b->projected[i]));
    }
    team_barrier(team);
}

/*
 * hidden [rows, dim] bf16, in place: through every layer. layer_weights: [num_layers, 6]
 * addresses (input norm, qkv, o, post-attention norm, gate_up, down; the projections packed
 * 4-bit); k_pools, v_pools: [num_layers] addresses of [num_slots, Hkv, D] pools. Row r's K/V
 * go to slot out_slots[r] before attention; attention reads the segments (kernels.h) over
 * kv_indices. cos, signed_sin: [rows, head_dim]. Returns 0, -1 for a shape the kernels do not
 * take, -2 without memory, -3 for a slot outside the pools (nothing computed).
 */
int radixrt_int4_decode_stack_bf16(
    uint16_t *hidden, int64_t rows, int64_t dim, int num_layers, const int64_t *layer_weights,
    const int64_t *k_pools, const int64_t *v_pools, int64_t num_slots,
    float eps, int num_q_heads, int num_kv_heads, int head_dim, int64_t intermediate, float scale,
    const uint16_t *cos, const uint16_t *signed_sin, const int64_t *out_slots, const int64_t *kv_indices,
    int num_segments, const int64_t *seg_starts, const int64_t *seg_lens, const int64_t *seg_row_ptr,
    const int64_t *seg_rows, int num_threads
) {
    if (num_q_heads % num_kv_heads || num_q_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % 2)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (out_slots[r] < 0 || out_slots[r] >= num_slots) return -3;
    for (int s = 0; s < num_segments; s++)
        for (int64_t j = 0; j < seg_lens[s]; j++)
            if (kv_indices[seg_starts[s] + j] < 0 || kv_indices[seg_starts[s] + j] >= num_slots) return -3;
    Segments seg = {num_segments, seg_starts, seg_lens, seg_row_ptr, seg_rows, num_q_heads, num_kv_heads, head_dim};
    Step st = {
        rows, dim, (int64_t)(num_q_heads + 2 * num_kv_heads) * head_dim, (int64_t)num_q_heads * head_dim,
        intermediate, num_q_heads, num_kv_heads, head_dim, eps, scale, cos, signed_sin, out_slots, kv_indices,
    };
    const int64_t widest = dim > st.attn_dim ? (dim > intermediate ? dim : intermediate)
                                             : (st.attn_dim > intermediate ? st.attn_dim : intermediate);
    const int64_t sums_per_thread = rows * (widest / 32);
    Buffers b = {
        malloc(sizeof(uint16_t) * rows * dim), malloc(sizeof(uint16_t) * rows * st.qkv_rows),
        malloc(sizeof(uint16_t) * rows * st.attn_dim), malloc(sizeof(uint16_t) * rows * dim),
        malloc(sizeof(uint16_t) * rows * 2 * intermediate), malloc(sizeof(uint16_t) * rows * intermediate),
    };
    float *x_sums = malloc(sizeof(float) * sums_per_thread * num_threads);
    AttentionWork *work = radixrt_attention_work_new(&seg);
    atomic_long *next_items = calloc(num_layers, sizeof(atomic_long));  /* each layer's attention item counter */
    SpinBarrier barrier = {0, 0};
    int status = -2;
    if (b.normed && b.qkv && b.attn && b.projected && b.gate_up && b.activated && x_sums && work && next_items) {
        status = 0;
        #pragma omp parallel num_threads(num_threads)
        {
            Team team = {&barrier, omp_get_thread_num(), omp_get_num_threads()};
            float *own_sums = x_sums + sums_per_thread * team.thread;
            for (int i = 0; i < num_layers; i++) {
                const void *weights[LAYER_WEIGHTS];
                for (int w = 0; w < LAYER_WEIGHTS; w++) weights[w] = (const void *)layer_weights[i * LAYER_WEIGHTS + w];
                layer(&team, &st, weights, (uint16_t *)k_pools[i], (uint16_t *)v_pools[i], work, &next_items[i],
                      hidden, &b, own_sums);
            }
        }
    }
    free(next_items);
    radixrt_attention_work_free(work);
    free(x_sums);
    free(b.normed);
    free(b.qkv);
    free(b.attn);
    free(b.projected);
    free(b.gate_up);
    free(b.activated);
    return status;
}
