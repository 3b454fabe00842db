/*
 * Per row of float32 logits: the first index of the largest value, that value, and
 * the log-sum-exp (log of the softmax's normaliser), in two passes over the row.
 *
 * Sampling reads both for every row of every step (the greedy token, and the
 * log-probability of whatever token is chosen: for the greedy one, its value minus
 * the log-sum-exp, no gather needed). torch's argmax does not vectorize
 * its index reduction and its logsumexp is several ops; here a row is two
 * vectorized passes (docs/kernels.md, "Row statistics"). The exponential is
 * scalar.h's (relative error ~2e-7, summed in float32).
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "scalar.h"

#define BLOCK 1024

/* The largest of x[start .. end) (-inf for none), one vectorized pass. */
static inline float block_maximum(const float *x, int64_t start, int64_t end) {
    float block_max = -INFINITY;
    #pragma omp simd reduction(max:block_max)
    for (int64_t i = start; i < end; i++) block_max = x[i] > block_max ? x[i] : block_max;
    return block_max;
}

/* One row: its first argmax, largest value and log-sum-exp. Not inlined, so that every caller
 * (the batched entry below, a decode run) gets the same vectorized reductions, bit for bit. */
__attribute__((noinline)) void radixrt_row_stats_row(const float *x, int64_t cols, int64_t *argmax, float *maximum,
                                                     float *lse) {
    /* the maximum, and the first block that holds it; then its first index in that block */
    float m = -INFINITY;
    int64_t best = 0;
    for (int64_t start = 0; start < cols; start += BLOCK) {
        const float block_max = block_maximum(x, start, start + BLOCK < cols ? start + BLOCK : cols);
        if (block_max > m) {
            m = block_max;
            best = start;
        }
    }
    int64_t first = best;
    while (first < cols - 1 && x[first] != m) first++;  /* within one block (a row of NaNs: the last) */
    float total = 0.0f;
    #pragma omp simd reduction(+:total)
    for (int64_t i = 0; i < cols; i++) total += exp_approx(x[i] - m);
    *argmax = first;
    *maximum = m;
    *lse = m + logf(total);
}

void radixrt_row_stats(const float *logits, int64_t rows, int64_t cols, int64_t row_stride, int64_t *argmax,
                       float *maximum, float *lse, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++)
        radixrt_row_stats_row(logits + r * row_stride, cols, argmax + r, maximum + r, lse + r);
}

/*
 * One row's `count` largest values, largest first, equal values in token order, and among
 * values equal to the last one kept the lowest tokens: tokens[i] and values[i] = x - shift
 * (a log-probability with shift the row's log-sum-exp). What the sampler's top log-probabilities
 * report (`sampler.top_tokens`, the same rule in torch). A block whose largest value cannot
 * enter the list is skipped after one vectorized pass.
 */
void radixrt_top_row(const float *x, int64_t cols, int count, float shift, int64_t *tokens, float *values) {
    int kept = 0;
    for (int64_t start = 0; start < cols; start += BLOCK) {
        const int64_t end = start + BLOCK < cols ? start + BLOCK : cols;
        if (kept == count && !(block_maximum(x, start, end) > values[count - 1])) continue;
        for (int64_t i = start; i < end; i++) {
            if (kept == count && !(x[i] > values[count - 1])) continue;
            int at = kept < count ? kept++ : count - 1;  /* the last place, or the first free one */
            while (at > 0 && x[i] > values[at - 1]) {  /* strictly larger: equal values keep token order */
                values[at] = values[at - 1];
                tokens[at] = tokens[at - 1];
                at--;
            }
            values[at] = x[i];
            tokens[at] = i;
        }
    }
    for (int i = 0; i < kept; i++) values[i] -= shift;
}
