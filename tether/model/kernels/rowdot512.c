/* rowdot's tiles in AVX-512, where the CPU has it (kernels_isa): the same chains as rowdot.c's AVX2 tiles (each
 * output one FMA chain over k = 0, 1, ..., K-1 in order, from zero), so the same bits, with a column block's 16
 * outputs in one register and 32 registers for more rows a tile: a weight vector loaded once feeds up to 12
 * rows, and each row's x comes as a broadcast operand of the FMA.
 *
 * Built with the other kernels' flags; these functions carry their own target, and are only called where
 * cpuid says the CPU runs them.
 */
#include <immintrin.h>
#include <stdint.h>

#include "rows.h"

static int isa512 = -1;

int kernels_isa(int want) {
    if (isa512 < 0 || want >= 0) {
        __builtin_cpu_init();
        int has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
        isa512 = want == 0 ? 0 : has;
    }
    return isa512;
}

/* R <= 12 rows against one block */
#define R1(j) if (R > j) a##j = _mm512_fmadd_ps(_mm512_set1_ps(x[j * ldx + i]), w, a##j);
#define O1(j) if (R > j) store16(y + j * ldy, col, n, a##j, act);
static inline AVX512 __attribute__((always_inline)) void
tile1(const int R, const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy, int64_t col,
      int64_t n, int act) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    for (int64_t i = 0; i < k; i++) {
        __m512 w = _mm512_load_ps(wp + i * BLOCK);
        R1(0) R1(1) R1(2) R1(3) R1(4) R1(5) R1(6) R1(7) R1(8) R1(9) R1(10) R1(11)
    }
    O1(0) O1(1) O1(2) O1(3) O1(4) O1(5) O1(6) O1(7) O1(8) O1(9) O1(10) O1(11)
}

/* R <= 12 rows against two blocks side by side: 24 chains, each row's x broadcast once into a register for both
 * blocks (tile1 loads it a second time as each FMA's broadcast operand: 13 loads a k step for 12 FMAs, which kept
 * a 64-row prefill at half the FMA rate a core sustains) */
#define R2(j)                                                                                      \
    if (R > j) {                                                                                   \
        __m512 xv = _mm512_set1_ps(x[j * ldx + i]);                                                \
        a##j = _mm512_fmadd_ps(xv, w0, a##j);                                                      \
        b##j = _mm512_fmadd_ps(xv, w1, b##j);                                                      \
    }
#define O2(j) if (R > j) { store16(y + j * ldy, col, n, a##j, act); store16(y + j * ldy, col + BLOCK, n, b##j, act); }
static inline AVX512 __attribute__((always_inline)) void
tile2(const int R, const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy, int64_t col,
      int64_t n, int act) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0, b10 = a0,
           b11 = a0;
    const float *p1 = wp + k * BLOCK;
    for (int64_t i = 0; i < k; i++) {
        __m512 w0 = _mm512_load_ps(wp + i * BLOCK), w1 = _mm512_load_ps(p1 + i * BLOCK);
        R2(0) R2(1) R2(2) R2(3) R2(4) R2(5) R2(6) R2(7) R2(8) R2(9) R2(10) R2(11)
    }
    O2(0) O2(1) O2(2) O2(3) O2(4) O2(5) O2(6) O2(7) O2(8) O2(9) O2(10) O2(11)
}

/* a tile of `rows` rows, R a constant in each case (so that the unused rows compile away) */
#define TILE(tile, R) case R: tile(R, x, ldx, wp, k, y, ldy, col, n, act); break;
AVX512 static void one(int rows, const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy,
                       int64_t col, int64_t n, int act) {
    switch (rows) {
    TILE(tile1, 12) TILE(tile1, 11) TILE(tile1, 10) TILE(tile1, 9) TILE(tile1, 8) TILE(tile1, 7)
    TILE(tile1, 6) TILE(tile1, 5) TILE(tile1, 4) TILE(tile1, 3) TILE(tile1, 2) default: tile1(1, x, ldx, wp, k, y, ldy, col, n, act);
    }
}

AVX512 static void two(int rows, const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy,
                       int64_t col, int64_t n, int act) {
    switch (rows) {
    TILE(tile2, 12) TILE(tile2, 11) TILE(tile2, 10) TILE(tile2, 9) TILE(tile2, 8) TILE(tile2, 7)
    TILE(tile2, 6) TILE(tile2, 5) TILE(tile2, 4) TILE(tile2, 3) TILE(tile2, 2) default: tile2(1, x, ldx, wp, k, y, ldy, col, n, act);
    }
}

/* rows [0, m) (m <= 64: rowdot_span's chunk) against `nb` blocks whose weights start at wf and whose first
 * column is col0: two blocks at once in as few tiles of up to 12 rows as they need, of even sizes (24 chains at 12
 * rows; 12 at 6), an odd block's rows one block at a time */
AVX512 void rowdot512_span(const float *x, int64_t ldx, const float *wf, int64_t k, float *y, int64_t ldy, int64_t n,
                           int64_t m, int64_t col0, int64_t nb, int act) {
    int64_t j = 0, tiles = (m + 11) / 12;
    for (; j + 2 <= nb; j += 2)
        for (int64_t t = 0, r = 0; t < tiles; t++) {
            int rows = (int)((m - r + tiles - t - 1) / (tiles - t));
            two(rows, x + r * ldx, ldx, wf + j * k * BLOCK, k, y + r * ldy, ldy, col0 + j * BLOCK, n, act);
            r += rows;
        }
    for (; j < nb; j++)
        for (int64_t r = 0; r < m; r += 12)
            one(m - r < 12 ? (int)(m - r) : 12, x + r * ldx, ldx, wf + j * k * BLOCK, k, y + r * ldy, ldy,
                col0 + j * BLOCK, n, act);
}
