/*
 * How the threads of a team divide a step's weight products between them.
 *
 * An equal share of every product assumes equal cores, and a VM's vCPUs need not be: where one
 * streams its half more slowly (the slowness follows the vCPU, not the thread), the faster
 * thread waits at every product's barrier (docs/kernels.md, "Product balance"). So each thread
 * times its share of each kind of product (the five of a layer and the head, whose speeds
 * differ: 4-bit and 8-bit codes, long and short rows), and between steps thread 0 moves each
 * kind's shares halfway towards the measured speeds, so that the threads finish together. Which
 * thread computes a tile never changes its result (radixrt_quantized_matmul_tiles), so the
 * learnt split changes speed only.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#define BALANCE_THREADS 64  /* teams larger than this share equally */

struct ProductBalance {
    int32_t threads;  /* the team size the shares are for; 0 (zeroed): none learnt yet */
    float shares[PRODUCT_KINDS][BALANCE_THREADS];
    struct {  /* each thread's own cache lines: what it recorded since the last rebalance */
        _Alignas(64) uint64_t ticks[PRODUCT_KINDS];
        int64_t tiles[PRODUCT_KINDS];
    } recorded[BALANCE_THREADS];
};

int64_t radixrt_product_balance_bytes(void) { return (int64_t)sizeof(ProductBalance); }
int radixrt_product_balance_threads(void) { return BALANCE_THREADS; }

/* shares [PRODUCT_KINDS, BALANCE_THREADS]: the learnt shares; returns the team size they are for (0: none) */
int radixrt_product_balance_shares(const ProductBalance *b, float *shares) {
    memcpy(shares, b->shares, sizeof b->shares);
    return b->threads;
}

/* Fix the shares of a team of `threads` (shares [PRODUCT_KINDS, threads], each row positive, summing to 1). */
void radixrt_product_balance_set(ProductBalance *b, int threads, const float *shares) {
    b->threads = threads;
    for (int k = 0; k < PRODUCT_KINDS; k++)
        for (int t = 0; t < threads; t++) b->shares[k][t] = shares[k * threads + t];
    memset(b->recorded, 0, sizeof b->recorded);
}

static int learnt_for(const ProductBalance *b, int threads) {
    return b != NULL && threads > 1 && threads <= BALANCE_THREADS && b->threads == threads;
}

void radixrt_product_tiles(const ProductBalance *b, const Team *team, int kind, int64_t num_tiles, int64_t *first,
                           int64_t *last) {
    if (!learnt_for(b, team->threads)) {
        team_share(team, num_tiles, first, last);
        return;
    }
    /* every thread adds the same shares in the same order: one thread's last is the next's first */
    const float *shares = b->shares[kind];
    float before = 0.0f;
    for (int t = 0; t < team->thread; t++) before += shares[t];
    const float through = before + shares[team->thread];
    *first = (int64_t)(before * (float)num_tiles + 0.5f);
    *last = team->thread == team->threads - 1 ? num_tiles : (int64_t)(through * (float)num_tiles + 0.5f);
    if (*first > num_tiles) *first = num_tiles;
    if (*last > num_tiles) *last = num_tiles;
    if (*last < *first) *last = *first;
}

void radixrt_product_record(ProductBalance *b, const Team *team, int kind, int64_t tiles, uint64_t ticks) {
    if (!learnt_for(b, team->threads)) return;
    b->recorded[team->thread].ticks[kind] += ticks;
    b->recorded[team->thread].tiles[kind] += tiles;
}

void radixrt_product_rebalance(ProductBalance *b, int threads) {
    if (b == NULL || threads < 2 || threads > BALANCE_THREADS) return;
    if (b->threads != threads) {  /* a new team size: equal shares to start from */
        b->threads = threads;
        for (int k = 0; k < PRODUCT_KINDS; k++)
            for (int t = 0; t < threads; t++) b->shares[k][t] = 1.0f / (float)threads;
        memset(b->recorded, 0, sizeof b->recorded);
        return;
    }
    for (int k = 0; k < PRODUCT_KINDS; k++) {
        double speed[BALANCE_THREADS], mean = 0.0;
        int measured = 1;
        for (int t = 0; t < threads; t++) {
            measured &= b->recorded[t].ticks[k] > 0 && b->recorded[t].tiles[k] > 0;
            speed[t] = measured ? (double)b->recorded[t].tiles[k] / (double)b->recorded[t].ticks[k] : 0.0;
            mean += speed[t] / threads;
            b->recorded[t].ticks[k] = 0;
            b->recorded[t].tiles[k] = 0;
        }
        if (!measured) continue;  /* a kind this step did not run, or a thread given no tiles */
        /* each speed kept within [1/2, 2] of the mean, so that a thread slowed for a moment
         * (descheduled) keeps at least a quarter of an equal share and is measured again */
        double total = 0.0;
        for (int t = 0; t < threads; t++) {
            speed[t] = speed[t] < 0.5 * mean ? 0.5 * mean : speed[t] > 2.0 * mean ? 2.0 * mean : speed[t];
            total += speed[t];
        }
        for (int t = 0; t < threads; t++) b->shares[k][t] = (float)(0.5 * b->shares[k][t] + 0.5 * speed[t] / total);
    }
}

#if defined(__x86_64__)
#include <x86intrin.h>
uint64_t radixrt_ticks(void) { return __rdtsc(); }
#else
uint64_t radixrt_ticks(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}
#endif
