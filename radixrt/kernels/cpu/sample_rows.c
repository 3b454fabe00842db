/*
 * Per row rows[i] of float32 logits: a token drawn from softmax(x / T) by inverse CDF, for the
 * sampler's rows without top-k, top-p or min-p (self-consistency samples, say). torch takes ~10
 * ops a row for this (scale, max, exp, cumulative sum, search), ~120 us a row over a 49k
 * vocabulary on one thread of the project's 2-core machine; here it is one pass and a short one.
 *
 * Weights w_j = exp((x_j - max) / T) (max: the row's largest logit, from radixrt_row_stats).
 * The first pass sums them per block of SAMPLE_BLOCK tokens; the token is the first whose
 * cumulative weight exceeds u * total: the block found from the block sums, then the token
 * within it by a running sum. Should that sum's rounding miss the target, the block's last
 * token of positive weight is taken. Each row's arithmetic is its own, so its token does not
 * depend on the batch.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "scalar.h"

#define SAMPLE_BLOCK 64

static int64_t sample_row(const float *x, int64_t cols, float maximum, float temperature, double uniform,
                          float *block_sums) {
    const float inverse = 1.0f / temperature;
    const int64_t num_blocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t end = (b + 1) * SAMPLE_BLOCK < cols ? (b + 1) * SAMPLE_BLOCK : cols;
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = b * SAMPLE_BLOCK; j < end; j++) sum += exp_approx((x[j] - maximum) * inverse);
        block_sums[b] = sum;
        total += sum;
    }
    const double target = uniform * total;
    double before = 0.0;
    int64_t b = 0;
    while (b < num_blocks - 1 && before + block_sums[b] <= target) before += block_sums[b++];
    const int64_t end = (b + 1) * SAMPLE_BLOCK < cols ? (b + 1) * SAMPLE_BLOCK : cols;
    int64_t last_positive = -1;
    for (int64_t j = b * SAMPLE_BLOCK; j < end; j++) {
        const float w = exp_approx((x[j] - maximum) * inverse);
        if (w > 0.0f) last_positive = j;
        before += w;
        if (before > target) return j;
    }
    return last_positive >= 0 ? last_positive : cols - 1;  /* no finite logit: no meaningful token */
}

/* tokens[i] for row rows[i], with maxima[i], temperatures[i] (> 0) and uniforms[i] in (0, 1).
 * Returns 0, or -1 without memory. */
int radixrt_sample_temperature(const float *logits, int64_t num_rows, const int64_t *rows, int64_t cols,
                               int64_t row_stride, const float *maxima, const float *temperatures,
                               const double *uniforms, int64_t *tokens, int num_threads) {
    const int64_t num_blocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    float *block_sums = malloc(sizeof(float) * (size_t)(num_blocks * num_threads));
    if (block_sums == NULL) return -1;
    #pragma omp parallel for num_threads(num_threads) if (num_rows >= 2)
    for (int64_t i = 0; i < num_rows; i++)
        tokens[i] = sample_row(logits + rows[i] * row_stride, cols, maxima[i], temperatures[i], uniforms[i],
                               block_sums + num_blocks * omp_get_thread_num());
    free(block_sums);
    return 0;
}
