/* y = x @ w.T with every output a single fused-multiply-add chain over k = 0, 1, ..., K-1, in that order.
 *
 * Why: a BLAS picks its kernel path by the row count M (and threads), and the paths sum a row's products in
 * different orders, so a row's bits change with the rows beside it (tether/model/invariant.py). Here each
 * y[m][n] is the same chain whatever M is, however rows and columns are grouped into register tiles and
 * whichever thread computes it: batch-invariant by construction, with no padding. The tiles only decide how
 * many chains run side by side (enough independent FMAs to hide their latency, and each weight load shared by
 * up to 6 rows).
 *
 * Layout: the weight [N][K] is packed once (rowdot_pack) as [ceil(N/16)][K][16]: a block of 16 output columns,
 * k-major, so one k step of a block is two aligned 8-float vectors. Columns past N are zero and never stored.
 *
 * Built with -mavx2 -mfma -mf16c and -ffp-contract=off (no other multiply-add is fused, nothing reassociated).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "rows.h"
#include "vecmath.h"

void rowdot_pack(const float *w, int64_t n, int64_t k, float *out) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    memset(out, 0, (size_t)(blocks * k * BLOCK) * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        float *col = out + (j / BLOCK) * k * BLOCK + (j % BLOCK);
        const float *row = w + j * k;
        for (int64_t i = 0; i < k; i++)
            col[i * BLOCK] = row[i];
    }
}

/* Up to 6 rows against one block of 16 columns: 12 accumulators, in named registers (GCC keeps an array of
 * them in memory, and 12 stores a step made the tile store-bound); with Zen 2's 5-cycle FMA latency, 10 chains
 * keep both FMA pipes busy. R is a constant at every call, so the unused rows compile away. */
#define ROW(j)                                                                                     \
    if (R > j) {                                                                                   \
        __m256 xv = _mm256_broadcast_ss(x + j * ldx + i);                                          \
        a##j = _mm256_fmadd_ps(xv, w0, a##j);                                                      \
        b##j = _mm256_fmadd_ps(xv, w1, b##j);                                                      \
    }
#define OUT(j) if (R > j) store_cols(y + j * ldy, col, n, a##j, b##j, act);

static inline __attribute__((always_inline)) void
rows_tile(const int R, const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy,
          int64_t col, int64_t n, int act) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    for (int64_t i = 0; i < k; i++) {
        __m256 w0 = _mm256_load_ps(wp + i * BLOCK), w1 = _mm256_load_ps(wp + i * BLOCK + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
}

/* One row against 4 blocks (a decode step alone): 8 chains, 4 weight streams. Each stream asks for its line
 * AHEAD k-rows on (2 KiB), and near its block's end for the same stream's line of the next 4 blocks (a thread's
 * blocks follow in memory; a prefetch never faults): smollm2's 17 layers on fp32 blocks, one row, 2 threads,
 * interleaved (Xeon): 9.15 -> 8.38 ms hot, 9.63 -> 9.20 after 8 ms idle (8, 16 or 64 k-rows ahead: less). */
#define AHEAD 32
static void row_by_4_blocks(const float *x, const float *wp, int64_t k, float *y, int64_t col, int64_t n, int act) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const float *p0 = wp, *p1 = wp + k * BLOCK, *p2 = wp + 2 * k * BLOCK, *p3 = wp + 3 * k * BLOCK;
    for (int64_t i = 0; i < k; i++) {
        __m256 xv = _mm256_broadcast_ss(x + i);
        int64_t o = i * BLOCK, f = o + AHEAD * BLOCK + (i + AHEAD >= k ? 3 * k * BLOCK : 0);
        _mm_prefetch((const char *)(p0 + f), _MM_HINT_T0);
        _mm_prefetch((const char *)(p1 + f), _MM_HINT_T0);
        _mm_prefetch((const char *)(p2 + f), _MM_HINT_T0);
        _mm_prefetch((const char *)(p3 + f), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(xv, _mm256_load_ps(p0 + o), a0);
        b0 = _mm256_fmadd_ps(xv, _mm256_load_ps(p0 + o + 8), b0);
        a1 = _mm256_fmadd_ps(xv, _mm256_load_ps(p1 + o), a1);
        b1 = _mm256_fmadd_ps(xv, _mm256_load_ps(p1 + o + 8), b1);
        a2 = _mm256_fmadd_ps(xv, _mm256_load_ps(p2 + o), a2);
        b2 = _mm256_fmadd_ps(xv, _mm256_load_ps(p2 + o + 8), b2);
        a3 = _mm256_fmadd_ps(xv, _mm256_load_ps(p3 + o), a3);
        b3 = _mm256_fmadd_ps(xv, _mm256_load_ps(p3 + o + 8), b3);
    }
    store_cols(y, col, n, a0, b0, act);
    store_cols(y, col + BLOCK, n, a1, b1, act);
    store_cols(y, col + 2 * BLOCK, n, a2, b2, act);
    store_cols(y, col + 3 * BLOCK, n, a3, b3, act);
}

/* Two rows against 2 blocks: 8 chains where one block would give 4. */
static void rows2_by_2_blocks(const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy,
                              int64_t col, int64_t n, int act) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const float *p0 = wp, *p1 = wp + k * BLOCK;
    for (int64_t i = 0; i < k; i++) {
        __m256 x0 = _mm256_broadcast_ss(x + i), x1 = _mm256_broadcast_ss(x + ldx + i);
        int64_t o = i * BLOCK;
        __m256 u0 = _mm256_load_ps(p0 + o), v0 = _mm256_load_ps(p0 + o + 8);
        __m256 u1 = _mm256_load_ps(p1 + o), v1 = _mm256_load_ps(p1 + o + 8);
        a0 = _mm256_fmadd_ps(x0, u0, a0);
        b0 = _mm256_fmadd_ps(x0, v0, b0);
        a1 = _mm256_fmadd_ps(x0, u1, a1);
        b1 = _mm256_fmadd_ps(x0, v1, b1);
        a2 = _mm256_fmadd_ps(x1, u0, a2);
        b2 = _mm256_fmadd_ps(x1, v0, b2);
        a3 = _mm256_fmadd_ps(x1, u1, a3);
        b3 = _mm256_fmadd_ps(x1, v1, b3);
    }
    store_cols(y, col, n, a0, b0, act);
    store_cols(y, col + BLOCK, n, a1, b1, act);
    store_cols(y + ldy, col, n, a2, b2, act);
    store_cols(y + ldy, col + BLOCK, n, a3, b3, act);
}

static void tile(int rows, const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy,
                 int64_t col, int64_t n, int act) {
    switch (rows) {
    case 6: rows_tile(6, x, ldx, wp, k, y, ldy, col, n, act); break;
    case 5: rows_tile(5, x, ldx, wp, k, y, ldy, col, n, act); break;
    case 4: rows_tile(4, x, ldx, wp, k, y, ldy, col, n, act); break;
    case 3: rows_tile(3, x, ldx, wp, k, y, ldy, col, n, act); break;
    case 2: rows_tile(2, x, ldx, wp, k, y, ldy, col, n, act); break;
    default: rows_tile(1, x, ldx, wp, k, y, ldy, col, n, act); break;
    }
}

/* rows [0, m) against `nb` blocks whose weights start at wf (block j at wf + j * K * 16) and whose first column
 * is col0: blocks outermost, so that a block's weights (K * 64 bytes) stay in cache while every row passes over
 * them, and are read from memory once per call */
static void rows_over_blocks(const float *x, int64_t ldx, const float *wf, int64_t k, float *y, int64_t ldy,
                             int64_t n, int64_t m, int64_t col0, int64_t nb, int act) {
    int64_t j = 0;
    if (m == 1)   /* one or two rows: blocks side by side, for enough independent chains */
        for (; j + 4 <= nb; j += 4)
            row_by_4_blocks(x, wf + j * k * BLOCK, k, y, col0 + j * BLOCK, n, act);
    if (m == 2)
        for (; j + 2 <= nb; j += 2)
            rows2_by_2_blocks(x, ldx, wf + j * k * BLOCK, k, y, ldy, col0 + j * BLOCK, n, act);
    /* the rows in as few tiles of up to 6 as they need, of even sizes: a tile of r rows takes max(r, L / 2) cycles
     * a k step (2r chains, FMA latency L = 4-5 cycles on 2 pipes), so 8 rows as 4 + 4 take 8 where 6 + 2 took 10 */
    int64_t tiles = (m + 5) / 6;
    for (; j < nb; j++)
        for (int64_t t = 0, r = 0; t < tiles; t++) {
            int rows = (int)((m - r + tiles - t - 1) / (tiles - t));
            tile(rows, x + r * ldx, ldx, wf + j * k * BLOCK, k, y + r * ldy, ldy, col0 + j * BLOCK, n, act);
            r += rows;
        }
}

void rowdot_span(const float *x, int64_t ldx, const float *wf, int64_t k, float *y, int64_t ldy, int64_t n,
                 int64_t m, int64_t col0, int64_t nb, int act) {
    /* rows in chunks of 64, so that a chunk's x (64 * K floats) stays in cache across the blocks */
    int wide = m > 1 && kernels_isa(-1);   /* from 2 rows the AVX-512 tiles (one row is memory-bound) */
    for (int64_t r = 0; r < m; r += 64) {
        int64_t rows = m - r < 64 ? m - r : 64;
        if (wide)
            rowdot512_span(x + r * ldx, ldx, wf, k, y + r * ldy, ldy, n, rows, col0, nb, act);
        else
            rows_over_blocks(x + r * ldx, ldx, wf, k, y + r * ldy, ldy, n, rows, col0, nb, act);
    }
}

void rowdot_blocks(const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy,
                   int64_t n, int64_t m, int64_t b0, int64_t b1, int act) {
    rowdot_span(x, ldx, wp + b0 * k * BLOCK, k, y, ldy, n, m, b0 * BLOCK, b1 - b0, act);
}

/* y[m][n] (row stride ldy) = x[m][k] (row stride ldx) @ w.T (silu of it where `act`), w packed in `format`
 * (rowdot_pack's fp32 blocks, rowquant.c's or rowq8.c's), on `threads` threads:
 * they take the column blocks in chunks of the tiles' unit (chunk_unit), first come first served (OpenMP's guided
 * schedule, as rowlayer.c's phases), and every block is computed the same way whoever computes it. OpenMP here is
 * torch's own libgomp (the same soname, already loaded when this library is), so the threads are the pool torch's
 * ops use on the calling thread. */
void rowdot(const float *x, int64_t ldx, const void *data, int64_t format, int64_t k, float *y, int64_t ldy,
            int64_t n, int64_t m, int threads, int act) {
    packed_weight w = {data, format};
    int64_t blocks = (n + BLOCK - 1) / BLOCK, unit = chunk_unit(format, m, blocks, threads);
    int64_t chunks = (blocks + unit - 1) / unit;
    if (threads <= 1 || blocks < 8) {
        weight_blocks(x, ldx, &w, k, y, ldy, n, m, 0, blocks, act);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t b0 = c * unit, b1 = b0 + unit < blocks ? b0 + unit : blocks;
        weight_blocks(x, ldx, &w, k, y, ldy, n, m, b0, b1, act);
    }
}
