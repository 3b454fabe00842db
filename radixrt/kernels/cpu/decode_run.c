/*
 * A decode run: several decode steps of a steady batch in one call, each
 * sampling its tokens and feeding them to the next.
 *
 * Through the engine, a batch-1 token's time beyond the model's call goes to
 * scheduling, building the batch, sampling and bookkeeping, all slowed by
 * Python's working set coming back from memory after each step has streamed
 * the weights through the caches (docs/kernels.md, "Decode runs"). When
 * every request of the batch is decoding and nothing waiting could be admitted
 * meanwhile (`Scheduler.run_length`), the engine hands k steps to this call:
 *
 *   step s:  tokens (the caller's, then the ones step s - 1 sampled)
 *            -> radixrt_stack_step at positions p + s, K/V into the rows' next slots (each of the
 *               model's attention plans, a window or none, cut into its own segments)
 *            -> per row: penalties, row stats, its top tokens if asked, then its token
 *               (argmax, or drawn at uniforms[s])
 *            -> stop after this step when a row drew one of its stop tokens or the
 *               caller raised its interrupt flag
 *
 * Each step computes exactly what a one-step call with the same requests
 * computes: the same kernels, attention cut into the same pieces as
 * `aligned_attention_segments` (whole chunks of `chunk` keys, a chunk several
 * rows share listed once, then each row's tail), the sampler's own row
 * functions. So a run's tokens and log-probabilities are those of k single
 * steps, bit for bit (tests/test_decode_run.py).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Segments of one step, rebuilt as the rows' contexts grow. */
typedef struct {
    int64_t *starts, *lens, *row_ptr, *rows;
    int64_t *entry_start, *entry_len, *entry_row;  /* one round's (start, length, row) before grouping */
    char *grouped;
} SegmentPlan;

/*
 * Row r attends keys lo .. positions[r] of its slots (lo = 0, or positions[r] - window + 1 with a
 * window), which begin at slot_starts[r] in the slot list, cut at the multiples of `chunk`: piece
 * k is the row's keys in [k * chunk, (k + 1) * chunk), a whole chunk read from the owner's slots
 * while k < shared_chunks[r], else from the row's own. Round k lists every row's piece k; rows
 * with the same piece share one segment (`aligned_attention_segments`' pieces, in its order).
 */
static int plan_segments(SegmentPlan *plan, int64_t rows, const int64_t *positions, const int64_t *slot_starts,
                         const int64_t *owner, const int64_t *shared_chunks, int64_t chunk, int64_t window) {
    int64_t rounds = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pieces = (positions[r] + 1 + chunk - 1) / chunk;
        rounds = pieces > rounds ? pieces : rounds;
    }
    int count = 0;
    int64_t listed = 0;
    plan->row_ptr[0] = 0;
    for (int64_t k = 0; k < rounds; k++) {
        int64_t entries = 0;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t keys = positions[r] + 1, lo = window > 0 && keys > window ? keys - window : 0;
            const int64_t first = lo > k * chunk ? lo : k * chunk;
            const int64_t end = keys < (k + 1) * chunk ? keys : (k + 1) * chunk;
            if (first >= end) continue;
            int64_t start = slot_starts[r] + first;
            if (end - first == chunk && k < shared_chunks[r]) start = slot_starts[owner[r]] + first;
            plan->entry_start[entries] = start;
            plan->entry_len[entries] = end - first;
            plan->entry_row[entries] = r;
            plan->grouped[entries++] = 0;
        }
        for (int64_t e = 0; e < entries; e++) {
            if (plan->grouped[e]) continue;
            plan->starts[count] = plan->entry_start[e];
            plan->lens[count] = plan->entry_len[e];
            for (int64_t f = e; f < entries; f++) {
                if (plan->grouped[f] || plan->entry_start[f] != plan->entry_start[e] ||
                    plan->entry_len[f] != plan->entry_len[e])
                    continue;
                plan->grouped[f] = 1;
                plan->rows[listed++] = plan->entry_row[f];
            }
            plan->row_ptr[++count] = listed;
        }
    }
    return count;
}

static void plan_free(SegmentPlan *plan) {
    free(plan->starts);
    free(plan->lens);
    free(plan->row_ptr);
    free(plan->rows);
    free(plan->entry_start);
    free(plan->entry_len);
    free(plan->entry_row);
    free(plan->grouped);
}

static int plan_alloc(SegmentPlan *plan, int64_t max_pieces, int64_t rows) {
    *plan = (SegmentPlan){
        malloc(sizeof(int64_t) * max_pieces), malloc(sizeof(int64_t) * max_pieces),
        malloc(sizeof(int64_t) * (max_pieces + 1)), malloc(sizeof(int64_t) * max_pieces),
        malloc(sizeof(int64_t) * rows), malloc(sizeof(int64_t) * rows), malloc(sizeof(int64_t) * rows), malloc(rows),
    };
    return plan->starts && plan->lens && plan->row_ptr && plan->rows && plan->entry_start && plan->entry_len &&
           plan->entry_row && plan->grouped;
}

/*
 * The model as in radixrt_decode_stack_bf16 (the head required); the batch: `rows`
 * sequences, row r's last token first_tokens[r] at first_positions[r] (its keys before the run
 * fill positions 0 .. first_positions[r] - 1), its slots slots[slot_starts[r] ..] for positions
 * 0 .. first_positions[r] + num_steps - 1, its whole chunks k < shared_chunks[r] read from row
 * owner[r]'s slots (a prefix they share, `chunk` keys a chunk). Sampling: temperatures[r] 0 is
 * greedy (the first argmax), else a draw at uniforms[s * rows + r] after top_k[r], top_p[r],
 * min_p[r] (radixrt_sample_rows), after its penalties when `seen` is not NULL (repetition[r],
 * frequency[r], presence[r], radixrt_penalize_row; seen and output_counts [rows, head_rows]: how
 * often each token is in the row's prompt and output, and in its output, counted on as the run
 * draws tokens); row r stops the run at a token among stop_ids[stop_ptr[r] ..
 * stop_ptr[r + 1]), and any step stops it while *interrupt (when not NULL) is nonzero: the caller
 * has something to do between steps (a new request). Output constraints: where `allowed` is not
 * NULL, a row r with masked[r] != 0 picks among the tokens allowed[r * allowed_words ..] allows
 * (radixrt_mask_row, before its penalties), and after every step but the last, while every row
 * has sampled and before any computes again, thread 0 calls advance(s), which writes the rows'
 * masks for step s + 1 from the tokens of step s and returns nonzero to end the run there. tokens, logprobs: [num_steps, rows], step
 * s's token of row r and its log-probability at temperature 1; with top_count > 0, top_tokens and
 * top_logprobs [num_steps, rows, top_count]: each step's most likely tokens of each row and their
 * log-probabilities (radixrt_top_row, after the penalties).
 * Returns the steps run (1 .. num_steps: after the first stop token), or before computing
 * anything -1 for a shape the kernels do not take, -2 without memory, -3 for a slot outside the
 * pools, -4 for a token id outside the embedding, -5 for a position outside the tables.
 */
int radixrt_decode_run_bf16(
    const StackModel *m, int64_t rows, const int64_t *first_tokens, const int64_t *first_positions, const int64_t *slots,
    const int64_t *slot_starts, const int64_t *owner, const int64_t *shared_chunks, int64_t chunk,
    const float *temperatures, const int64_t *top_k, const float *top_p, const float *min_p, const double *uniforms,
    const float *repetition, const float *frequency, const float *presence, int32_t *seen, int32_t *output_counts,
    const int64_t *stop_ptr, const int64_t *stop_ids, const atomic_int *interrupt, int num_steps, int64_t *tokens,
    float *logprobs, int top_count, int64_t *top_tokens, float *top_logprobs, const int32_t *allowed,
    int64_t allowed_words, const uint8_t *masked, int (*advance)(int step), int num_threads
) {
    const StackModel model = *m;
    const int num_layers = model.num_layers, num_q_heads = model.num_q_heads, num_kv_heads = model.num_kv_heads;
    const int head_dim = model.head_dim;
    const int64_t num_slots = model.num_slots;
    int64_t table_rows = INT64_MAX;
    for (int t = 0; t < model.num_ropes && t < STACK_MAX_ROPES; t++)
        table_rows = model.ropes[t].rows < table_rows ? model.ropes[t].rows : table_rows;
    const int64_t vocab = model.embedding == NULL ? 0 : radixrt_matrix_rows(model.embedding);
    const int64_t head_rows = model.head == NULL ? 0 : radixrt_matrix_rows(model.head);
    if (radixrt_stack_model_check(&model) || model.head == NULL || head_rows > vocab || rows < 1 || num_steps < 1 ||
        chunk < 1 || top_count < 0 || top_count > head_rows ||
        (allowed != NULL && (masked == NULL || allowed_words * 32 < head_rows)))
        return -1;
    int64_t last_position = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (first_tokens[r] < 0 || first_tokens[r] >= vocab) return -4;
        const int64_t last = first_positions[r] + num_steps - 1;
        if (first_positions[r] < 0 || last >= table_rows) return -5;
        if (owner[r] < 0 || owner[r] >= rows || shared_chunks[r] < 0 || shared_chunks[r] * chunk > first_positions[r] ||
            shared_chunks[r] * chunk > first_positions[owner[r]])
            return -1;  /* a shared chunk outside what both rows had cached */
        for (int64_t j = 0; j <= last; j++)
            if (slots[slot_starts[r] + j] < 0 || slots[slot_starts[r] + j] >= num_slots) return -3;
        last_position = last > last_position ? last : last_position;
    }
    const int64_t max_pieces = rows * ((last_position + 1 + chunk - 1) / chunk);
    const int64_t num_blocks = (head_rows + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    SegmentPlan plans[STACK_MAX_PLANS];
    int planned = 1;
    for (int p = 0; p < model.num_plans; p++) planned &= plan_alloc(&plans[p], max_pieces, rows);
    int64_t *current = malloc(sizeof(int64_t) * rows * 3);  /* this step's tokens, positions, out slots */
    float *logits = malloc(sizeof(float) * rows * head_rows);
    float *sample_scratch = malloc(sizeof(float) * (head_rows + num_blocks) * num_threads);
    atomic_long *next_items = calloc(num_layers, sizeof(atomic_long));
    StackBuffers *buffers = radixrt_stack_buffers_new(&model, rows, rows, 1, num_threads);
    int64_t *logit_rows = malloc(sizeof(int64_t) * rows);
    int done = -2;
    if (planned && current && logits && sample_scratch && next_items && buffers && logit_rows) {
        int64_t *step_tokens = current, *positions = current + rows, *out_slots = current + 2 * rows;
        for (int64_t r = 0; r < rows; r++) {
            step_tokens[r] = first_tokens[r];
            logit_rows[r] = r;
        }
        StackStep step = {rows, step_tokens, positions, out_slots, slots, {NULL}, next_items, NULL, rows, logit_rows,
                          logits};
        int step_planned = 1;
        SpinBarrier barrier = {0, 0};
        atomic_int stopped = 0;
        done = 0;
        #pragma omp parallel num_threads(num_threads)
        {
            Team team = {&barrier, omp_get_thread_num(), omp_get_num_threads()};
            float *weights = sample_scratch + (head_rows + num_blocks) * team.thread;
            float *block_sums = weights + head_rows;
            for (int s = 0; s < num_steps; s++) {
                if (team.thread == 0) {
                    for (int64_t r = 0; r < rows; r++) {
                        positions[r] = first_positions[r] + s;
                        out_slots[r] = slots[slot_starts[r] + positions[r]];
                    }
                    step_planned = 1;
                    for (int p = 0; p < model.num_plans; p++) {
                        SegmentPlan *plan = &plans[p];
                        const int count = plan_segments(plan, rows, positions, slot_starts, owner, shared_chunks,
                                                        chunk, model.windows[p]);
                        Segments seg = {count, plan->starts, plan->lens, plan->row_ptr, plan->rows, num_q_heads,
                                        num_kv_heads, head_dim, 0};
                        radixrt_attention_work_free(step.works[p]);
                        step.works[p] = radixrt_attention_work_new(&seg, team.threads);
                        step_planned &= step.works[p] != NULL;
                    }
                    for (int i = 0; i < num_layers; i++) atomic_store(&next_items[i], 0);
                }
                team_barrier(&team);
                if (!step_planned) break;  /* every thread sees it: no memory for this step */
                radixrt_stack_step(&team, &model, &step, buffers);
                team_barrier(&team);
                int64_t first, last;
                team_share(&team, rows, &first, &last);
                for (int64_t r = first; r < last; r++) {
                    float *x = logits + r * head_rows;
                    int32_t *row_seen = seen == NULL ? NULL : seen + r * head_rows;
                    int32_t *row_counts = output_counts == NULL ? NULL : output_counts + r * head_rows;
                    if (allowed != NULL && masked[r]) radixrt_mask_row(x, head_rows, allowed + r * allowed_words);
                    if (row_seen != NULL)
                        radixrt_penalize_row(x, head_rows, row_seen, row_counts, repetition[r], frequency[r],
                                             presence[r]);
                    int64_t token;
                    float maximum, lse;
                    radixrt_row_stats_row(x, head_rows, &token, &maximum, &lse);
                    if (top_count > 0) {
                        const int64_t at = (s * rows + r) * top_count;
                        radixrt_top_row(x, head_rows, top_count, lse, top_tokens + at, top_logprobs + at);
                    }
                    if (temperatures[r] > 0.0f)
                        token = radixrt_sample_row(x, head_rows, maximum, temperatures[r], top_k[r], top_p[r],
                                                   min_p[r], uniforms[s * rows + r], weights, block_sums);
                    tokens[s * rows + r] = token;
                    logprobs[s * rows + r] = x[token] - lse;
                    step_tokens[r] = token;
                    if (row_seen != NULL) {
                        row_seen[token]++;
                        row_counts[token]++;
                    }
                    for (int64_t j = stop_ptr[r]; j < stop_ptr[r + 1]; j++)
                        if (stop_ids[j] == token) atomic_store(&stopped, 1);
                }
                /* one thread reads the caller's flag, so that every thread stops after the same step */
                if (team.thread == 0 && interrupt != NULL && atomic_load_explicit(interrupt, memory_order_relaxed))
                    atomic_store(&stopped, 1);
                team_barrier(&team);
                if (team.thread == 0) {
                    done = s + 1;
                    if (advance != NULL && s + 1 < num_steps && !atomic_load(&stopped) && advance(s))
                        atomic_store(&stopped, 1);
                }
                if (advance != NULL) team_barrier(&team);  /* the next masks and the verdict, for every thread */
                if (atomic_load(&stopped)) break;
            }
        }
        for (int p = 0; p < model.num_plans; p++) radixrt_attention_work_free(step.works[p]);
        if (done == 0) done = -2;
    }
    for (int p = 0; p < model.num_plans; p++) plan_free(&plans[p]);
    free(current);
    free(logits);
    free(sample_scratch);
    free(next_items);
    radixrt_stack_buffers_free(buffers);
    free(logit_rows);
    return done;
}
