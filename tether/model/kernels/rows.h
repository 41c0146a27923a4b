/* What our kernels call of each other (rowlayer.c runs a whole decoder layer on rowdot's and rowattn's
 * pieces): each computes an output element the same way whoever calls it, so composing them keeps a row's
 * bits independent of the micro-batch and the threads. */
#ifndef TETHER_ROWS_H
#define TETHER_ROWS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h"

#define BLOCK 16   /* output columns per packed weight block (rowdot.c's layout, and rowquant.c's) */

/* Functions in AVX-512 beside the AVX2 build: called only where kernels_isa() says the CPU runs them */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

/* a row's 16 outputs of one column block (silu of them where `act`) into y[col:], the columns before n */
static inline void store_cols(float *y, int64_t col, int64_t n, __m256 lo, __m256 hi, int act) {
    if (act) {
        lo = silu8(lo);
        hi = silu8(hi);
    }
    if (col + BLOCK <= n) {
        _mm256_storeu_ps(y + col, lo);
        _mm256_storeu_ps(y + col + 8, hi);
    } else {   /* the last, partial block of columns */
        float tmp[BLOCK];
        _mm256_storeu_ps(tmp, lo);
        _mm256_storeu_ps(tmp + 8, hi);
        memcpy(y + col, tmp, (size_t)(n - col) * sizeof(float));
    }
}

/* the same for a block's 16 outputs in one AVX-512 register */
static inline AVX512 __attribute__((always_inline)) void
store16(float *y, int64_t col, int64_t n, __m512 v, int act) {
    store_cols(y, col, n, _mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1), act);
}

/* A projection's weight as the kernels read it: rowdot's fp32 blocks, rowquant.c's blocks of a GGUF file's
 * Q4_1 / Q8_0 groups, whose fp32 values the kernel rebuilds exactly as the conversion did (tether/model/rowquant.py),
 * or rowq8.c's of the same groups, read against 8-bit inputs (*_Q8, tether/model/rowq8.py). */
enum { WEIGHT_F32 = 0, WEIGHT_Q4_1 = 1, WEIGHT_Q8_0 = 2, WEIGHT_Q4_1_Q8 = 3, WEIGHT_Q8_0_Q8 = 4 };
typedef struct {
    const void *data;
    int64_t format;
} packed_weight;

/* The kernels of the file's groups (rowquant.c, rowq8.c) read each group record once a call (a tile: once a pass),
 * and a step finds them cold (30 layers' weights outgrow the caches; served, the other stage's turn evicts them too):
 * each record stream asks for the record PREFETCH_RECORDS ahead of the one it reads (three, four or eight measured
 * the same as two; docs/PERFORMANCE.md "Served steps are cold").
 * A prefetch never faults, so one past the weight's end is harmless. */
#define PREFETCH_RECORDS 2
static inline __attribute__((always_inline)) void prefetch_lines(const void *p, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64)
        _mm_prefetch((const char *)p + l, _MM_HINT_T0);
}

/* rowdot.c: y = x @ w.T (silu of it where `act`) for the column blocks [b0, b1) of a packed weight (any b0; in
 * chunk_unit's units they run on the widest tiles). */
void rowdot_blocks(const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy, int64_t n,
                   int64_t m, int64_t b0, int64_t b1, int act);

/* rowdot.c: rows [0, m) against `nb` column blocks whose K x 16 fp32 weights start at wf (block j at
 * wf + j * K * 16) and whose first column is col0 */
void rowdot_span(const float *x, int64_t ldx, const float *wf, int64_t k, float *y, int64_t ldy, int64_t n,
                 int64_t m, int64_t col0, int64_t nb, int act);

/* rowdot512.c: rowdot_span's tiles in AVX-512 (m <= 64), and whether they run: kernels_isa(-1) reads it (probed
 * from cpuid once), kernels_isa(0) turns them off (AVX2 everywhere: a test compares), kernels_isa(1) on where
 * the CPU has AVX-512 F, BW, DQ and VL. Same bits either way. */
void rowdot512_span(const float *x, int64_t ldx, const float *wf, int64_t k, float *y, int64_t ldy, int64_t n,
                    int64_t m, int64_t col0, int64_t nb, int act);
int kernels_isa(int want);

/* rowquant.c: rowdot_blocks for a weight in any format, every output the same chain as rowdot's on the fp32
 * weight the blocks dequantize to */
void weight_blocks(const float *x, int64_t ldx, const packed_weight *w, int64_t k, float *y, int64_t ldy,
                   int64_t n, int64_t m, int64_t b0, int64_t b1, int act);

/* rowq8.c: the column blocks [b0, b1) of a Q4_1 or Q8_0 weight (WEIGHT_*_Q8) in rowq8's layout against x's rows
 * rounded to 8 bits per group (llama.cpp's arithmetic: another numerics than rowdot's, tether/model/rowq8.py) */
void q8_blocks(int64_t format, const float *x, int64_t ldx, const uint8_t *data, int64_t k, float *y, int64_t ldy,
               int64_t n, int64_t m, int64_t b0, int64_t b1, int act);

/* The column blocks a chunk of threaded work takes for m rows (rowdot's threads, rowlayer's phases) out of a
 * weight's `blocks` shared by `team` threads: the units the tiles take them in, so that no chunk splits a tile:
 * fours for one row of rowdot's and rowquant's formats (their one-row tile takes four blocks side by side), pairs
 * for 2-6 rows (two blocks a tile), single blocks from 7 rows. The smallest unit evens the threads' work: in fours,
 * smollm2's 36-block q and 12-block k and v split 20 / 16 and 8 / 4 on 2 threads. rowq8's formats take one chunk a
 * thread (a fixed share): its every call rounds the rows to 8 bits first, so smaller chunks would round them again. */
static inline int64_t chunk_unit(int64_t format, int64_t m, int64_t blocks, int64_t team) {
    if (format == WEIGHT_Q4_1_Q8 || format == WEIGHT_Q8_0_Q8)
        return team > 1 ? (blocks + team - 1) / team : blocks > 0 ? blocks : 1;
    return m > 6 ? 1 : m > 1 ? 2 : 4;
}

/* rowattn.c: one query row of one head attended to its request's keys 0..pos; `s`: scores scratch of at least
 * pos + 1 floats rounded up to 8. */
void rowattn_row(const float *q, const float *kc, const float *vc, const int64_t *table, int64_t pos,
                 int64_t kvh, int64_t kv_heads, int64_t d, int64_t block, float scale, float *s, float *out);

#endif
