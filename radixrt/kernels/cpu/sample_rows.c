/*
 * Per row rows[i] of float32 logits: a token drawn from softmax(x / T) by inverse CDF, after the
 * row's top-k, top-p and min-p filters, for the sampler. torch takes ~10 ops a row without
 * filters, and a top-p row whose nucleus outgrows its candidate window a full sort; here a row
 * takes a few vectorized passes (docs/kernels.md, "Sampling rows").
 *
 * Every filter is a threshold on the logit, computed on the whole row as the sampler defines it
 * (docs/sampling.md): top-k keeps the k largest logits, top-p the fewest largest whose
 * probability mass reaches p, min-p those of probability at least min_p times the largest's; a
 * logit tied with the threshold is kept. The threshold of top-k and top-p is found without a
 * sort: logits map to 32-bit keys in the same order (order_key), and three passes over the row
 * narrow the key where the count (top-k) or mass (top-p) of the larger logits reaches the goal,
 * 12, 12 and then 8 bits at a time, each pass a histogram of the tokens still in the running.
 * Top-k first tries a shortcut through the row's block maxima (top_k_key).
 *
 * Weights w_j = exp((x_j - max) / T), zero for a filtered-out token. A pass sums them per block
 * of SAMPLE_BLOCK tokens; the token is the first whose cumulative weight exceeds u * total: the
 * block found from the block sums, then the token within it by a running sum. Should that sum's
 * rounding miss the target, the block's last token of positive weight is taken. Each row's
 * arithmetic is its own, so its token does not depend on the batch.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "scalar.h"

/* Unsigned keys in the order of the floats (-inf lowest): a float's bits, sign-adjusted. */
static inline uint32_t order_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

/*
 * The largest key K such that the tokens with keys >= K reach `goal`: counted (weights NULL) or
 * weighed by weights[j]. 0 (keep every token) when the whole row falls short.
 */
static uint32_t crossing_key(const float *x, int64_t cols, const float *weights, double goal) {
    static const int shifts[3] = {20, 8, 0}, widths[3] = {12, 12, 8};
    double histogram[1 << 12];
    uint32_t prefix = 0;  /* the key's bits fixed so far, above shifts[level] + widths[level] */
    double above = 0.0;   /* count or mass of the tokens whose keys are above the prefix's range */
    for (int level = 0; level < 3; level++) {
        const int shift = shifts[level], buckets = 1 << widths[level];
        const int above_bits = shift + widths[level];
        memset(histogram, 0, sizeof(double) * (size_t)buckets);
        for (int64_t j = 0; j < cols; j++) {
            const uint32_t key = order_key(x[j]);
            if (level > 0 && (key >> above_bits) != (prefix >> above_bits)) continue;
            histogram[(key >> shift) & (uint32_t)(buckets - 1)] += weights ? weights[j] : 1.0;
        }
        int b = buckets - 1;
        while (b >= 0 && above + histogram[b] < goal) above += histogram[b--];
        if (b < 0) return 0;
        prefix |= (uint32_t)b << shift;
    }
    return prefix;
}

/* Reorders keys[0 .. n) so that keys[k - 1] is the k-th largest, larger ones before it
 * (quickselect; 1 <= k <= n). */
static uint32_t kth_largest(uint32_t *keys, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const uint32_t pivot = keys[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (keys[i] > pivot) i++;
            while (keys[j] < pivot) j--;
            if (i <= j) {
                const uint32_t t = keys[i];
                keys[i++] = keys[j];
                keys[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    return keys[k - 1];
}

#define TOP_K_CANDIDATES 4096

/*
 * Top-k's key: the k-th largest logit's. The row's per-block maxima are tokens, so its k largest
 * block maxima are k tokens at least as large as the k-th largest of them, t: the answer is
 * among the tokens >= t, usually a few times k, selected directly. Should there be too many
 * (or k exceed the blocks), the histogram passes find it. `scratch`: a float per block.
 */
static uint32_t top_k_key(const float *x, int64_t cols, int64_t k, float *scratch) {
    const int64_t num_blocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    if (k > num_blocks) return crossing_key(x, cols, NULL, (double)k);
    uint32_t *block_keys = (uint32_t *)scratch;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t end = (b + 1) * SAMPLE_BLOCK < cols ? (b + 1) * SAMPLE_BLOCK : cols;
        float m = x[b * SAMPLE_BLOCK];
        #pragma omp simd reduction(max:m)
        for (int64_t j = b * SAMPLE_BLOCK; j < end; j++) m = x[j] > m ? x[j] : m;
        block_keys[b] = order_key(m);
    }
    const uint32_t floor_key = kth_largest(block_keys, num_blocks, k);
    uint32_t candidates[TOP_K_CANDIDATES];
    int64_t n = 0;
    for (int64_t j = 0; j < cols; j++) {
        const uint32_t key = order_key(x[j]);
        if (key >= floor_key) {
            if (n == TOP_K_CANDIDATES) return crossing_key(x, cols, NULL, (double)k);
            candidates[n++] = key;
        }
    }
    return kth_largest(candidates, n, k);
}

/* The key below which the row's filters drop a token (0: none drops any); `weights`: cols floats
 * of scratch, left holding the row's weights when top-p computed them (returned through
 * *weighed), `block_scratch`: a float per block (top-k). */
static uint32_t filter_key(const float *x, int64_t cols, float maximum, float temperature, int64_t top_k,
                           float top_p, float min_p, float *weights, int *weighed, float *block_scratch) {
    const float inverse = 1.0f / temperature;
    uint32_t lowest = 0;
    if (min_p > 0.0f) {  /* p >= min_p * p_max: x >= max + T log(min_p) */
        const uint32_t key = order_key(maximum + temperature * logf(min_p));
        lowest = key > lowest ? key : lowest;
    }
    if (top_k > 1 && top_k < cols) {
        const uint32_t key = top_k_key(x, cols, top_k, block_scratch);
        lowest = key > lowest ? key : lowest;
    }
    if (top_p < 1.0f) {  /* the weights once, vectorized: the histogram passes cannot be */
        double total = 0.0;
        for (int64_t start = 0; start < cols; start += SAMPLE_BLOCK) {
            const int64_t end = start + SAMPLE_BLOCK < cols ? start + SAMPLE_BLOCK : cols;
            float sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = start; j < end; j++) sum += weights[j] = exp_approx((x[j] - maximum) * inverse);
            total += sum;
        }
        const uint32_t key = crossing_key(x, cols, weights, (double)top_p * total);
        lowest = key > lowest ? key : lowest;
        *weighed = 1;
    }
    return lowest;
}

/* Token j's weight: the one filter_key stored (weights not NULL), else computed. */
static inline float weight_of(const float *x, const float *weights, int64_t j, float maximum, float inverse) {
    return weights != NULL ? weights[j] : exp_approx((x[j] - maximum) * inverse);
}

/* The weights of tokens start .. end - 1 with keys >= lowest, summed: each case its own loop, so
 * that each vectorizes (with the test for stored weights inside one loop, the compiler did not;
 * docs/kernels.md, "Sampling rows"). */
static inline float block_sum(const float *x, const float *weights, int64_t start, int64_t end, float maximum,
                              float inverse, uint32_t lowest) {
    float sum = 0.0f;
    if (weights != NULL && lowest == 0) {
        #pragma omp simd reduction(+:sum)
        for (int64_t j = start; j < end; j++) sum += weights[j];
    } else if (weights != NULL) {
        #pragma omp simd reduction(+:sum)
        for (int64_t j = start; j < end; j++) sum += order_key(x[j]) >= lowest ? weights[j] : 0.0f;
    } else if (lowest == 0) {  /* no filter: no keys to compare */
        #pragma omp simd reduction(+:sum)
        for (int64_t j = start; j < end; j++) sum += exp_approx((x[j] - maximum) * inverse);
    } else {
        #pragma omp simd reduction(+:sum)
        for (int64_t j = start; j < end; j++)
            sum += order_key(x[j]) >= lowest ? exp_approx((x[j] - maximum) * inverse) : 0.0f;
    }
    return sum;
}

static int64_t sample_row(const float *x, const float *weights, int64_t cols, float maximum, float temperature,
                          uint32_t lowest, double uniform, float *block_sums) {
    const float inverse = 1.0f / temperature;
    const int64_t num_blocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t end = (b + 1) * SAMPLE_BLOCK < cols ? (b + 1) * SAMPLE_BLOCK : cols;
        const float sum = block_sum(x, weights, b * SAMPLE_BLOCK, end, maximum, inverse, lowest);
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
        const float w = order_key(x[j]) >= lowest ? weight_of(x, weights, j, maximum, inverse) : 0.0f;
        if (w > 0.0f) last_positive = j;
        before += w;
        if (before > target) return j;
    }
    return last_positive >= 0 ? last_positive : cols - 1;  /* no finite logit: no meaningful token */
}

/*
 * One row's penalties, in place, as the sampler's torch ops apply them (`apply_penalties`), bit
 * for bit: a token seen in the prompt or the output (seen[j] > 0) has its logit divided by
 * `repetition` when positive, multiplied when not; then a token the output holds
 * output_counts[j] times loses frequency * count + presence, each operation rounded to float32
 * on its own (no fused multiply-add: torch multiplies, adds and subtracts in three ops). Every
 * token computed and selected, so that the loops vectorize.
 */
__attribute__((noinline, optimize("fp-contract=off"))) void radixrt_penalize_row(
    float *x, int64_t cols, const int32_t *seen, const int32_t *output_counts, float repetition, float frequency,
    float presence
) {
    if (repetition != 1.0f) {
        #pragma omp simd
        for (int64_t j = 0; j < cols; j++) {
            const float penalised = x[j] > 0.0f ? x[j] / repetition : x[j] * repetition;
            x[j] = seen[j] > 0 ? penalised : x[j];
        }
    }
    if (frequency != 0.0f || presence != 0.0f) {
        #pragma omp simd
        for (int64_t j = 0; j < cols; j++) {
            const float scaled = frequency * (float)output_counts[j];
            const float penalty = scaled + presence;
            x[j] = output_counts[j] > 0 ? x[j] - penalty : x[j];
        }
    }
}

/* One row's token (see radixrt_sample_rows). `weights`: cols floats of scratch, needed only
 * with top_p < 1; `block_scratch`: a float per block of SAMPLE_BLOCK tokens. Not inlined, so
 * that every caller (the batched entry below, a decode run) samples with the same arithmetic. */
__attribute__((noinline)) int64_t radixrt_sample_row(const float *x, int64_t cols, float maximum, float temperature,
                                                     int64_t top_k, float top_p, float min_p, double uniform,
                                                     float *weights, float *block_scratch) {
    int weighed = 0;
    const uint32_t lowest =
        filter_key(x, cols, maximum, temperature, top_k, top_p, min_p, weights, &weighed, block_scratch);
    return sample_row(x, weighed ? weights : NULL, cols, maximum, temperature, lowest, uniform, block_scratch);
}

/* tokens[rows[i]] for row rows[i], with maxima[rows[i]] (the row's largest logit), temperatures[i]
 * (> 0), filters top_k[i] (none: <= 1 or >= cols), top_p[i] (none: >= 1), min_p[i] (none: 0), and
 * uniforms[i] in (0, 1); the other entries of tokens are left as they are. Returns 0, or -1
 * without memory. */
int radixrt_sample_rows(const float *logits, int64_t num_rows, const int64_t *rows, int64_t cols,
                        int64_t row_stride, const float *maxima, const float *temperatures, const int64_t *top_k,
                        const float *top_p, const float *min_p, const double *uniforms, int64_t *tokens,
                        int num_threads) {
    const int64_t num_blocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    int any_top_p = 0;
    for (int64_t i = 0; i < num_rows; i++) any_top_p |= top_p[i] < 1.0f;
    float *block_sums = malloc(sizeof(float) * (size_t)(num_blocks * num_threads));
    float *weights = any_top_p ? malloc(sizeof(float) * (size_t)(cols * num_threads)) : NULL;
    if (block_sums == NULL || (any_top_p && weights == NULL)) {
        free(block_sums);
        free(weights);
        return -1;
    }
    #pragma omp parallel for num_threads(num_threads) if (num_rows >= 2)
    for (int64_t i = 0; i < num_rows; i++) {
        const float *x = logits + rows[i] * row_stride;
        const int thread = omp_get_thread_num();
        float *block_scratch = block_sums + num_blocks * thread;  /* free until sample_row */
        float *row_weights = weights == NULL ? NULL : weights + cols * thread;
        tokens[rows[i]] = radixrt_sample_row(x, cols, maxima[rows[i]], temperatures[i], top_k[i], top_p[i],
                                             min_p[i], uniforms[i], row_weights, block_scratch);
    }
    free(block_sums);
    free(weights);
    return 0;
}

/* The tokens `allowed` does not allow (a bit per token: token t is bit t % 32 of word t / 32, set
 * when allowed) become -inf in one float32 row, so that no later pass can pick them and the row's
 * log-sum-exp is over the allowed tokens alone. */
void radixrt_mask_row(float *x, int64_t cols, const int32_t *allowed) {
    for (int64_t start = 0; start < cols; start += 32) {
        const uint32_t bits = (uint32_t)allowed[start / 32];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t count = cols - start < 32 ? cols - start : 32;
        for (int64_t j = 0; j < count; j++)
            if (!(bits >> j & 1u)) x[start + j] = -INFINITY;
    }
}

/* radixrt_mask_row for row rows[i] of `logits` with allowed[i * words ..], each row alone. */
void radixrt_mask_rows(float *logits, int64_t num_rows, const int64_t *rows, int64_t cols, int64_t row_stride,
                       const int32_t *allowed, int64_t words) {
    for (int64_t i = 0; i < num_rows; i++) radixrt_mask_row(logits + rows[i] * row_stride, cols, allowed + i * words);
}
