/*
 * New tokens' K and V rows copied into their pool slots, both in one call.
 *
 * A decode step stores one row per sequence per layer; torch's indexed
 * assignment costs a few microseconds of dispatch per call, twice a layer,
 * for a copy of a few hundred bytes. Each row is the token's heads,
 * contiguous. Returns -1, copying nothing, if a slot is outside the pool.
 */
#include <stdint.h>
#include <string.h>

int radixrt_store_kv_bf16(
    const uint16_t *k, int64_t k_row_stride, const uint16_t *v, int64_t v_row_stride, int64_t rows,
    int64_t row_elems, const int64_t *slots, int64_t num_slots, uint16_t *k_pool, uint16_t *v_pool
) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    for (int64_t r = 0; r < rows; r++) {
        memcpy(k_pool + slots[r] * row_elems, k + r * k_row_stride, sizeof(uint16_t) * (size_t)row_elems);
        memcpy(v_pool + slots[r] * row_elems, v + r * v_row_stride, sizeof(uint16_t) * (size_t)row_elems);
    }
    return 0;
}
