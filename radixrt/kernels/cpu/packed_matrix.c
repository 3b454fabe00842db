/*
 * A weight matrix whose rows come in parts of different formats (kernels.h: PackedMatrix), as
 * the products of a step see it: one range of tiles, each tile multiplied by its part's kernel.
 *
 * A part's kernel (format_matmul.h) writes the output columns of the tiles it is given at row
 * stride num_rows, tile t at columns 16 t. Handing it the matrix's row count and a tile base
 * shifted back by the tiles of the parts before it makes part p's tile i the matrix's tile
 * (first tile of p) + i, written at the matrix's columns: the parts fill one output row
 * [m, rows of the matrix] side by side, and a column's result is the part kernel's own,
 * whatever range of tiles it is computed in.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "format_matmul.h"
#include "formats.h"
#include "kernels.h"

int64_t radixrt_matrix_rows(const PackedMatrix *w) {
    int64_t rows = 0;
    for (int p = 0; p < w->num_parts; p++) rows += w->parts[p].num_rows;
    return rows;
}

int radixrt_matrix_check(const PackedMatrix *w, int64_t num_rows, int64_t num_cols, int table) {
    if (w == NULL || w->num_parts < 1 || w->num_parts > MATRIX_MAX_PARTS || w->num_cols != num_cols) return -1;
    if (table && w->num_parts == 1 && w->parts[0].format == FORMAT_BF16)
        return w->parts[0].tiles != NULL && w->parts[0].num_rows == num_rows ? 0 : -1;
    for (int p = 0; p < w->num_parts; p++) {
        const MatrixPart *part = &w->parts[p];
        if (part->tiles == NULL || part->num_rows <= 0 || part->num_rows % QUANTIZED_TILE_ROWS ||
            radixrt_format_tile_bytes(part->format, num_cols) <= 0)
            return -1;
    }
    return radixrt_matrix_rows(w) == num_rows ? 0 : -1;
}

int64_t radixrt_matrix_scratch_bytes(const PackedMatrix *w, int64_t m) {
    int64_t most = 0;
    for (int p = 0; p < w->num_parts; p++) {
        const int64_t bytes = radixrt_format_matmul_scratch_bytes(w->parts[p].format, m, w->num_cols);
        most = bytes > most ? bytes : most;
    }
    return most;
}

/* Part p's tiles as the matrix's: the address tile 0 of the matrix would have in p's layout. */
static const uint8_t *shifted_base(const MatrixPart *part, int64_t part_first_tile, int64_t tile_bytes) {
    return (const uint8_t *)((uintptr_t)part->tiles - (uintptr_t)(part_first_tile * tile_bytes));
}

void radixrt_matrix_multiply_tiles(const PackedMatrix *w, const uint16_t *x, int64_t x_stride, int64_t m,
                                   float *out, uint16_t *out_bf16, void *scratch, int64_t first_tile,
                                   int64_t last_tile) {
    const int64_t num_rows = radixrt_matrix_rows(w);
    int64_t part_first = 0;
    for (int p = 0; p < w->num_parts && part_first < last_tile; p++) {
        const MatrixPart *part = &w->parts[p];
        const int64_t part_last = part_first + part->num_rows / QUANTIZED_TILE_ROWS;
        const int64_t first = first_tile > part_first ? first_tile : part_first;
        const int64_t last = last_tile < part_last ? last_tile : part_last;
        if (first < last) {
            const int64_t tile_bytes = radixrt_format_tile_bytes(part->format, w->num_cols);
            radixrt_format_matmul_tiles(part->format, x, x_stride, m, shifted_base(part, part_first, tile_bytes),
                                        num_rows, w->num_cols, out, out_bf16, scratch, first, last);
        }
        part_first = part_last;
    }
}

void radixrt_matrix_tile_bytes(const PackedMatrix *w, int64_t first_tile, int64_t last_tile, const char *ranges[4]) {
    int found = 0;
    ranges[0] = ranges[1] = ranges[2] = ranges[3] = NULL;
    int64_t part_first = 0;
    for (int p = 0; p < w->num_parts && found < 2 && part_first < last_tile; p++) {
        const MatrixPart *part = &w->parts[p];
        const int64_t part_last = part_first + part->num_rows / QUANTIZED_TILE_ROWS;
        const int64_t first = first_tile > part_first ? first_tile : part_first;
        const int64_t last = last_tile < part_last ? last_tile : part_last;
        if (first < last) {
            const int64_t tile_bytes = radixrt_format_tile_bytes(part->format, w->num_cols);
            ranges[2 * found] = (const char *)part->tiles + (first - part_first) * tile_bytes;
            ranges[2 * found + 1] = (const char *)part->tiles + (last - part_first) * tile_bytes;
            found++;
        }
        part_first = part_last;
    }
}

void radixrt_matrix_row_bf16(const PackedMatrix *w, int64_t row, uint16_t *out) {
    for (int p = 0; p < w->num_parts; p++) {
        const MatrixPart *part = &w->parts[p];
        if (row < part->num_rows) {
            if (part->format == FORMAT_BF16)
                memcpy(out, (const uint16_t *)part->tiles + row * w->num_cols, sizeof(uint16_t) * (size_t)w->num_cols);
            else
                radixrt_format_dequantize_tiles_bf16(part->format, part->tiles, w->num_cols, row, row + 1, out);
            return;
        }
        row -= part->num_rows;
    }
}

/*
 * out[r] = x[r] @ w.T for r < m (fp32 out, or bf16 out_bf16 when that is not NULL), the matrix's
 * tiles split equally over num_threads. Returns 0, -1 without memory, -2 for a matrix
 * radixrt_matrix_check refuses.
 */
int radixrt_matrix_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const PackedMatrix *w, float *out,
                               uint16_t *out_bf16, int num_threads) {
    const int64_t num_rows = radixrt_matrix_rows(w);
    if (radixrt_matrix_check(w, num_rows, w->num_cols, 0)) return -2;
    const int64_t scratch_bytes = radixrt_matrix_scratch_bytes(w, m);
    char *scratch = malloc((size_t)(scratch_bytes * num_threads));
    if (scratch == NULL) return -1;
    #pragma omp parallel num_threads(num_threads)
    {
        const Team team = {NULL, omp_get_thread_num(), omp_get_num_threads()};  /* no barrier: the region's end */
        int64_t first, last;
        team_share(&team, num_rows / QUANTIZED_TILE_ROWS, &first, &last);
        radixrt_matrix_multiply_tiles(w, x, x_stride, m, out, out_bf16, scratch + scratch_bytes * team.thread, first,
                                      last);
    }
    free(scratch);
    return 0;
}

/* Rows ids[i] of the matrix as bf16 (out [n, num_cols]); -1 for an id outside it (nothing written). */
int radixrt_matrix_gather_bf16(const PackedMatrix *w, const int64_t *ids, int64_t n, uint16_t *out) {
    const int64_t num_rows = radixrt_matrix_rows(w);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows) return -1;
    for (int64_t i = 0; i < n; i++) radixrt_matrix_row_bf16(w, ids[i], out + i * w->num_cols);
    return 0;
}

/* The whole matrix as bf16 (out [rows, num_cols]), its tiles split over num_threads: for a step
 * of many rows, which multiplies faster densely. Returns 0, -2 for a matrix radixrt_matrix_check
 * refuses (nothing written). */
int radixrt_matrix_dequantize_bf16(const PackedMatrix *w, uint16_t *out, int num_threads) {
    const int64_t num_rows = radixrt_matrix_rows(w), num_tiles = num_rows / QUANTIZED_TILE_ROWS;
    if (radixrt_matrix_check(w, num_rows, w->num_cols, 0)) return -2;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tiles; t++) {
        int64_t tile = t;
        int p = 0;
        while (tile >= w->parts[p].num_rows / QUANTIZED_TILE_ROWS) tile -= w->parts[p++].num_rows / QUANTIZED_TILE_ROWS;
        radixrt_format_dequantize_tiles_bf16(w->parts[p].format, w->parts[p].tiles, w->num_cols,
                                             tile * QUANTIZED_TILE_ROWS, (tile + 1) * QUANTIZED_TILE_ROWS,
                                             out + t * QUANTIZED_TILE_ROWS * w->num_cols);
    }
    return 0;
}
