/* rowdot on a GGUF file's quantized weights: y = x @ w.T where w's fp32 values are rebuilt in registers from the
 * file's Q4_1 or Q8_0 groups, exactly as the conversion rebuilt them (gguf-py's dequantize, in float32:
 * Q4_1 (d * q) + m, Q8_0 q * d, each product and sum rounded once), and every output is rowdot's chain over
 * k = 0, 1, ..., K-1 on those values. So a row's bits equal rowdot's on the converted fp32 weight (load-time
 * check: tether/model/rowquant.py) while a decode step reads ~5 bits a weight instead of 32. Q4_1's (d * q) + m
 * is one fused multiply-add here with the same result: d is an fp16 (11 significant bits) and q < 16 (4 bits),
 * so d * q is exact in float32 and the sum's one rounding is the only one either way.
 *
 * Layout: a column block of 16 output columns (rowdot's), then its groups of 32 inputs, k-major inside a group:
 *   Q4_1 group, 320 bytes: d[16] fp16, m[16] fp16, then 32 k-rows of 8 bytes (byte j: column 2j in its low
 *        nibble, column 2j + 1 in its high one)
 *   Q8_0 group, 544 bytes: d[16] fp16, then 32 k-rows of 16 int8
 * Columns past N have d = m = 0, so their weights are +0, as rowdot's zero padding.
 *
 * One row (a decode step alone) dequantizes in registers next to the FMAs (in AVX2, Q4_1 in even and odd columns:
 * row_q4_split), and so do up to 32 rows in AVX-512 (rowdot512's tiles, the weights rebuilt once a tile of up to 12
 * rows) and up to 8 rows in AVX2 (halves_tile); more rows dequantize two column blocks at a time into a
 * per-thread buffer and run rowdot's tiles over them.
 *
 * Built with -mavx2 -mfma -mf16c -ffp-contract=off, like rowdot.c.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#define GROUP 32

static int64_t record_bytes(int64_t format) {
    return format == WEIGHT_Q4_1 ? 64 + GROUP * 8 : 32 + GROUP * 16;
}

/* bytes of a packed [n][k] weight (k a multiple of 32) */
int64_t rowquant_bytes(int64_t n, int64_t k, int64_t format) {
    return (n + BLOCK - 1) / BLOCK * (k / GROUP) * record_bytes(format);
}

/* The GGUF tensor's blocks (row-major [n][k / 32] blocks: Q4_1 = d, m (fp16), 16 bytes holding element i in the
 * low nibble of byte i and element i + 16 in its high one; Q8_0 = d (fp16), 32 int8) in the layout above. */
void rowquant_pack(const uint8_t *src, int64_t n, int64_t k, int64_t format, uint8_t *out) {
    int64_t groups = k / GROUP, rec = record_bytes(format), src_block = format == WEIGHT_Q4_1 ? 20 : 34;
    memset(out, 0, (size_t)rowquant_bytes(n, k, format));
    for (int64_t j = 0; j < n; j++) {
        int64_t c = j % BLOCK;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = src + (j * groups + g) * src_block;
            uint8_t *r = out + ((j / BLOCK) * groups + g) * rec;
            memcpy(r + 2 * c, b, 2);
            if (format == WEIGHT_Q4_1) {
                memcpy(r + 32 + 2 * c, b + 2, 2);
                for (int i = 0; i < GROUP; i++) {
                    uint8_t q = i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
                    r[64 + i * 8 + c / 2] |= (uint8_t)(c % 2 ? q << 4 : q);
                }
            } else {
                for (int i = 0; i < GROUP; i++)
                    r[32 + i * 16 + c] = b[2 + i];
            }
        }
    }
}

/* k-row i of a group record as 16 fp32 weights (lo: columns 0-7, hi: 8-15); d, m: the group's scales */
static inline __attribute__((always_inline)) void
weights_at(const int64_t F, const uint8_t *rec, int i, __m256 d0, __m256 d1, __m256 m0, __m256 m1, __m256 *lo,
           __m256 *hi) {
    if (F == WEIGHT_Q4_1) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(rec + 64 + 8 * i)), mask = _mm_set1_epi8(15);
        __m128i v = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
        __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        *lo = _mm256_fmadd_ps(d0, q0, m0);   /* = (d * q) + m: d * q is exact (below) */
        *hi = _mm256_fmadd_ps(d1, q1, m1);
    } else {
        __m128i v = _mm_loadu_si128((const __m128i *)(rec + 32 + 16 * i));
        *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d0);
        *hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), d1);
    }
}

static inline __attribute__((always_inline)) void
scales(const int64_t F, const uint8_t *rec, __m256 *d0, __m256 *d1, __m256 *m0, __m256 *m1) {
    *d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
    *d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
    if (F == WEIGHT_Q4_1) {
        *m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 32)));
        *m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 48)));
    } else {
        *m0 = *m1 = _mm256_setzero_ps();
    }
}

/* The `nb` record streams of a kernel reading blocks blk, blk + stride, ... side by side, at group g of
 * `groups` (records of `bytes`): each asks for its record PREFETCH_RECORDS ahead (rows.h), and past its block's end
 * for the first records of the block it reads next, the same stream of the next `nb` blocks (a thread's chunk walks
 * its blocks in order; at a chunk's end the guess may miss). The hardware prefetcher follows each stream, not far
 * enough ahead, and starts every new block cold. A cold step (17 layers after 8 ms idle, 2 threads, Xeon)
 * 4.18 -> 3.84 ms with the records ahead and 3.79 -> 3.51 with the next blocks too in AVX2, 3.83 -> 3.72 -> 3.40
 * in AVX-512; the cold head (30 MB of Q8_0) 3.80 -> 2.60 (AVX2) and 2.40 -> 2.15 (AVX-512, next blocks); hot ones
 * within 0-5% (docs/PERFORMANCE.md). The tiles of more rows and the buffer's rebuild stalled on the same misses: the
 * 210 linears of a step one after the other on 1 thread, 8 rows, 33.5 -> 29.8 ms in AVX2, 27.8 -> 22.1 in AVX-512
 * (32 rows 1.03x / 1.11x); the whole decode step with the head at 8 rows, 2 threads, 1.07x / 1.18x. */
static inline __attribute__((always_inline)) void
prefetch_streams(const uint8_t *blk, int nb, int64_t stride, int64_t g, int64_t groups, int64_t bytes) {
    int64_t ahead = g + PREFETCH_RECORDS, at = ahead * bytes + (ahead >= groups ? (nb - 1) * stride : 0);
    for (int j = 0; j < nb; j++)
        prefetch_lines(blk + j * stride + at, bytes);
}

/* a column block's K x 16 fp32 weights, in rowdot's layout */
static inline __attribute__((always_inline)) void
dequant_block(const int64_t F, const uint8_t *blk, int64_t k, float *out) {
    int64_t rec = record_bytes(F);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * rec;
        __m256 d0, d1, m0, m1, lo, hi;
        prefetch_streams(blk, 1, 0, g, k / GROUP, rec);
        scales(F, r, &d0, &d1, &m0, &m1);
        for (int i = 0; i < GROUP; i++) {
            weights_at(F, r, i, d0, d1, m0, m1, &lo, &hi);
            _mm256_store_ps(out + (g * GROUP + i) * BLOCK, lo);
            _mm256_store_ps(out + (g * GROUP + i) * BLOCK + 8, hi);
        }
    }
}

/* one row against `nb` (1 or 2) column blocks side by side: 2 chains a block, the dequantizing between them */
static inline __attribute__((always_inline)) void
row_blocks(const int64_t F, const int nb, const float *x, const uint8_t *blk, int64_t stride, int64_t k, float *y,
           int64_t col, int64_t n, int act) {
    int64_t rec = record_bytes(F);
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r0 = blk + g * rec, *r1 = r0 + stride;
        __m256 d0, d1, m0, m1, e0, e1, n0, n1, lo, hi;
        prefetch_streams(blk, nb, stride, g, k / GROUP, rec);
        scales(F, r0, &d0, &d1, &m0, &m1);
        if (nb > 1)
            scales(F, r1, &e0, &e1, &n0, &n1);
        for (int i = 0; i < GROUP; i++) {
            __m256 xv = _mm256_broadcast_ss(x + g * GROUP + i);
            weights_at(F, r0, i, d0, d1, m0, m1, &lo, &hi);
            a0 = _mm256_fmadd_ps(xv, lo, a0);
            b0 = _mm256_fmadd_ps(xv, hi, b0);
            if (nb > 1) {
                weights_at(F, r1, i, e0, e1, n0, n1, &lo, &hi);
                a1 = _mm256_fmadd_ps(xv, lo, a1);
                b1 = _mm256_fmadd_ps(xv, hi, b1);
            }
        }
    }
    store_cols(y, col, n, a0, b0, act);
    if (nb > 1)
        store_cols(y, col + BLOCK, n, a1, b1, act);
}

/* One row against `nb` (1 or 2) Q4_1 column blocks in AVX2, with fewer shuffles than weights_at: a k-row's 8
 * bytes widened to 8 lanes at once (lane j: byte j, column 2j in its low nibble and 2j + 1 in its high one), the
 * even columns masked out of the low nibbles and the odd ones out of the high nibbles *in place* (q * 16), whose
 * scale is d / 16: d / 16 * (q * 16) = d * q, both products exact (d an fp16's 11 bits, q 4 bits; d / 16 stays
 * normal in float32), so the one rounding of + m gives weights_at's weight bit for bit. The accumulators hold the
 * even and the odd columns; the stores put them back in order. Three ALU operations fewer per 16 weights (the
 * shuffle port had bound the one-row kernel on AVX2). */
static inline __attribute__((always_inline)) __m256 evens(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
}
static inline __attribute__((always_inline)) __m256 odds(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

/* a group's scales as even- and odd-column vectors; the odd columns' d divided by 16 (exact) */
static inline __attribute__((always_inline)) void
split_scales(const uint8_t *rec, __m256 *de, __m256 *dob, __m256 *me, __m256 *mo) {
    __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
    __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
    __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 32)));
    __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 48)));
    *de = evens(d0, d1);
    *dob = _mm256_mul_ps(odds(d0, d1), _mm256_set1_ps(0.0625f));
    *me = evens(m0, m1);
    *mo = odds(m0, m1);
}

/* even (cols 0, 2, ... 14) and odd (1, 3, ... 15) accumulators back in column order */
static inline __attribute__((always_inline)) void
store_split(float *y, int64_t col, int64_t n, __m256 e, __m256 o, int act) {
    __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);   /* cols 0-3 | 8-11, 4-7 | 12-15 */
    store_cols(y, col, n, _mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31), act);
}

/* a group's scales for half H: Q4_1's even columns' d and m, or the odd ones' d / 16 and m; Q8_0's d of columns
 * 8H..8H+7 */
static inline __attribute__((always_inline)) void
half_scales(const int64_t F, const int H, const uint8_t *rec, __m256 *d, __m256 *m) {
    if (F == WEIGHT_Q4_1) {
        __m256 de, dob, me, mo;
        split_scales(rec, &de, &dob, &me, &mo);
        *d = H ? dob : de;
        *m = H ? mo : me;
    } else {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16 * H)));
        *m = _mm256_setzero_ps();
    }
}

/* k-row i's half H of a group record: Q4_1's even (H 0) or odd (H 1) columns' 8 weights (row_q4_split's, scaled
 * as it says); Q8_0's first or second eight, as weights_at */
static inline __attribute__((always_inline)) __m256
half_weights(const int64_t F, const int H, const uint8_t *rec, int i, __m256 d, __m256 m) {
    if (F == WEIGHT_Q4_1) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 64 + 8 * i)));
        return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(H ? 0xf0 : 0x0f))), m);
    }
    __m128i v = _mm_loadl_epi64((const __m128i *)(rec + 32 + 16 * i + 8 * H));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
}

/* a tile's two halves back in column order: Q4_1's even and odd columns interleaved, Q8_0's in turn */
static inline __attribute__((always_inline)) void
store_halves(const int64_t F, float *y, int64_t col, int64_t n, __m256 h0, __m256 h1, int act) {
    if (F == WEIGHT_Q4_1)
        store_split(y, col, n, h0, h1, act);
    else
        store_cols(y, col, n, h0, h1, act);
}

static inline __attribute__((always_inline)) void
row_q4_split(const int nb, const float *x, const uint8_t *blk, int64_t stride, int64_t k, float *y, int64_t col,
             int64_t n, int act) {
    const int64_t rec = record_bytes(WEIGHT_Q4_1);
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r0 = blk + g * rec, *r1 = r0 + stride;
        __m256 de0, do0, me0, mo0, de1 = a0, do1 = a0, me1 = a0, mo1 = a0;
        prefetch_streams(blk, nb, stride, g, k / GROUP, rec);
        split_scales(r0, &de0, &do0, &me0, &mo0);
        if (nb > 1)
            split_scales(r1, &de1, &do1, &me1, &mo1);
        for (int i = 0; i < GROUP; i++) {
            __m256 xv = _mm256_broadcast_ss(x + g * GROUP + i);
            a0 = _mm256_fmadd_ps(xv, half_weights(WEIGHT_Q4_1, 0, r0, i, de0, me0), a0);
            b0 = _mm256_fmadd_ps(xv, half_weights(WEIGHT_Q4_1, 1, r0, i, do0, mo0), b0);
            if (nb > 1) {
                a1 = _mm256_fmadd_ps(xv, half_weights(WEIGHT_Q4_1, 0, r1, i, de1, me1), a1);
                b1 = _mm256_fmadd_ps(xv, half_weights(WEIGHT_Q4_1, 1, r1, i, do1, mo1), b1);
            }
        }
    }
    store_split(y, col, n, a0, b0, act);
    if (nb > 1)
        store_split(y, col + BLOCK, n, a1, b1, act);
}

/* AVX2, 2 to 8 rows: the weights rebuilt in registers next to the FMAs, as the one-row kernels do, rather than into
 * the buffer first, where the rebuild (shuffles, conversions, stores) ran as a phase of its own before the tiles'
 * FMAs: ~120 us a call of the 576 -> 1536 gate whatever the rows (119 us + 17 us a row, 1 thread, hot), so 8 rows
 * ran at half the FMA rate a core sustains (bench/fma_rate.c). Here the shuffles overlap the FMAs. A block's 16
 * columns in two halves (Q4_1's even and odd columns, row_q4_split's masks; Q8_0's first and second eight): up to
 * 6 rows take both in one pass (2 chains a row), 7 and 8 one half a pass (8 chains; 16 accumulators would not fit
 * in AVX2's registers). The gate at 2 / 4 / 8 rows 26 / 42 / 56 -> 38 / 57 / 64 GFLOP/s; the whole model's layers
 * at 8 rows, 2 threads, 24.2 -> 21.2 ms; the head (Q8_0, with the prefetch) at 2 / 4 / 8 rows 1.34x / 1.25x /
 * 1.14x. The same weights (weights_at's; row_q4_split's, equal bit for bit) and every output rowdot's chain over k
 * in order. */
#define HALVES_BOTH 6       /* rows a tile takes both halves of a block for, in one pass (2 chains a row) */
#define HALVES_MAX_ROWS 8   /* a tile's rows at most: up to here AVX2 rebuilds in the tiles, then the buffer */
#define HR(j, w, i) if (R > j) a##j = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j * ldx + (i)), w, a##j);
#define HK(w, i) HR(0, w, i) HR(1, w, i) HR(2, w, i) HR(3, w, i) HR(4, w, i) HR(5, w, i) HR(6, w, i) HR(7, w, i)
#define HO(j) if (R > j) out[j] = a##j;
/* R <= 8 rows against half H of one block: out[j] row j's 8 sums */
static inline __attribute__((always_inline)) void
half_tile(const int64_t F, const int R, const int H, const float *x, int64_t ldx, const uint8_t *blk, int64_t k,
          __m256 *out) {
    const int64_t rec = record_bytes(F);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * rec;
        __m256 d, m;
        if (H == 0)   /* the second half reads the block again, from the cache */
            prefetch_streams(blk, 1, 0, g, k / GROUP, rec);
        half_scales(F, H, r, &d, &m);
        for (int i = 0; i < GROUP; i++) {
            __m256 w = half_weights(F, H, r, i, d, m);
            HK(w, g * GROUP + i)
        }
    }
    HO(0) HO(1) HO(2) HO(3) HO(4) HO(5) HO(6) HO(7)
}

#define BR(j, u, v, i)                                                                             \
    if (R > j) {                                                                                   \
        __m256 xv = _mm256_broadcast_ss(x + j * ldx + (i));                                        \
        a##j = _mm256_fmadd_ps(xv, u, a##j);                                                       \
        b##j = _mm256_fmadd_ps(xv, v, b##j);                                                       \
    }
#define BO(j) if (R > j) store_halves(F, y + j * ldy, col, n, a##j, b##j, act);
/* R <= 6 rows against both halves of one block */
static inline __attribute__((always_inline)) void
both_halves_tile(const int64_t F, const int R, const float *x, int64_t ldx, const uint8_t *blk, int64_t k, float *y,
                 int64_t ldy, int64_t col, int64_t n, int act) {
    const int64_t rec = record_bytes(F);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * rec;
        __m256 d0, m0, d1, m1;
        prefetch_streams(blk, 1, 0, g, k / GROUP, rec);
        half_scales(F, 0, r, &d0, &m0);
        half_scales(F, 1, r, &d1, &m1);
        for (int i = 0; i < GROUP; i++) {
            __m256 u = half_weights(F, 0, r, i, d0, m0), v = half_weights(F, 1, r, i, d1, m1);
            int64_t at = g * GROUP + i;
            BR(0, u, v, at) BR(1, u, v, at) BR(2, u, v, at) BR(3, u, v, at) BR(4, u, v, at) BR(5, u, v, at)
        }
    }
    BO(0) BO(1) BO(2) BO(3) BO(4) BO(5)
}

static inline __attribute__((always_inline)) void
halves_tile(const int64_t F, const int R, const float *x, int64_t ldx, const uint8_t *blk, int64_t k, float *y,
            int64_t ldy, int64_t col, int64_t n, int act) {
    if (R <= HALVES_BOTH) {
        both_halves_tile(F, R, x, ldx, blk, k, y, ldy, col, n, act);
        return;
    }
    __m256 h0[8], h1[8];
    half_tile(F, R, 0, x, ldx, blk, k, h0);
    half_tile(F, R, 1, x, ldx, blk, k, h1);
    for (int j = 0; j < R; j++)
        store_halves(F, y + j * ldy, col, n, h0[j], h1[j], act);
}

#define HTILE(R) case R: halves_tile(F, R, x, ldx, data + b * stride, k, y, ldy, b * BLOCK, n, act); break;
/* 2 to HALVES_MAX_ROWS rows against the column blocks [b0, b1), one tile a block */
static inline __attribute__((always_inline)) void
rows_halves(const int64_t F, const float *x, int64_t ldx, const uint8_t *data, int64_t stride, int64_t k, float *y,
            int64_t ldy, int64_t n, int64_t m, int64_t b0, int64_t b1, int act) {
    for (int64_t b = b0; b < b1; b++)
        switch (m) { HTILE(8) HTILE(7) HTILE(6) HTILE(5) HTILE(4) HTILE(3) default: HTILE(2) }
}

/* AVX-512: k-rows of a group record rebuilt as 16 fp32 weights in one register, by the operations weights_at
 * uses (so the same values) */
static inline AVX512 __attribute__((always_inline)) __m512 q4_weights(__m128i q, __m512 d, __m512 m) {
    return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), m);
}

static inline AVX512 __attribute__((always_inline)) __m512 q8_weights(const uint8_t *rec, int i, __m512 d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rec + 32 + 16 * i)))),
                         d);
}

/* k-rows i and i + 1 (i even) of a group record as 16 fp32 weights each */
static inline AVX512 __attribute__((always_inline)) void
weights_pair512(const int64_t F, const uint8_t *rec, int i, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    if (F == WEIGHT_Q4_1) {
        const __m128i mask = _mm_set1_epi8(15);
        __m128i v = _mm_loadu_si128((const __m128i *)(rec + 64 + 8 * i));
        __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        *w0 = q4_weights(_mm_unpacklo_epi8(lo, hi), d, m);
        *w1 = q4_weights(_mm_unpackhi_epi8(lo, hi), d, m);
    } else {
        *w0 = q8_weights(rec, i, d);
        *w1 = q8_weights(rec, i + 1, d);
    }
}

static inline AVX512 __attribute__((always_inline)) void
scales512(const int64_t F, const uint8_t *rec, __m512 *d, __m512 *m) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
    *m = F == WEIGHT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32))) : _mm512_setzero_ps();
}

/* The same one-row kernel in AVX-512 (where the CPU has F, BW, DQ and VL: kernels_isa): a column block's 16
 * columns in one register, up to 4 blocks side by side, two k-rows' nibbles unpacked at once. Every weight is
 * rebuilt by the same operations and every chain runs over k in the same order, so the bits are the AVX2
 * kernel's (tests/tether/model/test_rowquant.py runs both). */

static inline AVX512 __attribute__((always_inline)) void
row_blocks512(const int64_t F, const int nb, const float *x, const uint8_t *blk, int64_t stride, int64_t k,
              float *y, int64_t col, int64_t n, int act) {
    int64_t rec = record_bytes(F);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r[4];
        __m512 d[4], m[4];
        prefetch_streams(blk, nb, stride, g, k / GROUP, rec);
        for (int j = 0; j < nb; j++) {
            r[j] = blk + j * stride + g * rec;
            scales512(F, r[j], &d[j], &m[j]);
        }
        for (int i = 0; i < GROUP; i += 2) {
            __m512 x0 = _mm512_set1_ps(x[g * GROUP + i]), x1 = _mm512_set1_ps(x[g * GROUP + i + 1]);
            for (int j = 0; j < nb; j++) {
                __m512 w0, w1;
                weights_pair512(F, r[j], i, d[j], m[j], &w0, &w1);
                acc[j] = _mm512_fmadd_ps(x0, w0, acc[j]);
                acc[j] = _mm512_fmadd_ps(x1, w1, acc[j]);
            }
        }
    }
    for (int j = 0; j < nb; j++)
        store16(y, col + j * BLOCK, n, acc[j], act);
}

/* column blocks [b0, b1) in fours, then one by one */
static inline AVX512 __attribute__((always_inline)) void
row_span512(const int64_t F, const float *x, const uint8_t *data, int64_t stride, int64_t k, float *y, int64_t n,
            int64_t b0, int64_t b1, int act) {
    int64_t b = b0;
    for (; b + 4 <= b1; b += 4)
        row_blocks512(F, 4, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
    for (; b < b1; b++)
        row_blocks512(F, 1, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
}

/* not inlined into the AVX2 code that calls it: each format's span compiled once, in AVX-512 */
AVX512 static void row512(const int64_t format, const float *x, const uint8_t *data, int64_t stride, int64_t k,
                          float *y, int64_t n, int64_t b0, int64_t b1, int act) {
    if (format == WEIGHT_Q4_1)
        row_span512(WEIGHT_Q4_1, x, data, stride, k, y, n, b0, b1, act);
    else
        row_span512(WEIGHT_Q8_0, x, data, stride, k, y, n, b0, b1, act);
}

/* More rows in AVX-512: rowdot512.c's tiles with the weights rebuilt in registers, once a tile (up to 12 rows),
 * rather than into a buffer first: its AVX2 rebuild, store and reload cost 1.25-1.7x the tile's own FMAs at 8
 * rows (a linear hot in cache). The same weights and each output the same chain over k in order: rowdot's bits. */
/* R <= 12 rows against one block */
#define QR1(j, w, i) if (R > j) a##j = _mm512_fmadd_ps(_mm512_set1_ps(x[j * ldx + (i)]), w, a##j);
#define QK1(w, i) QR1(0, w, i) QR1(1, w, i) QR1(2, w, i) QR1(3, w, i) QR1(4, w, i) QR1(5, w, i) \
                  QR1(6, w, i) QR1(7, w, i) QR1(8, w, i) QR1(9, w, i) QR1(10, w, i) QR1(11, w, i)
#define QO1(j) if (R > j) store16(y + j * ldy, col, n, a##j, act);
static inline AVX512 __attribute__((always_inline)) void
qtile1(const int64_t F, const int R, const float *x, int64_t ldx, const uint8_t *blk, int64_t k, float *y,
       int64_t ldy, int64_t col, int64_t n, int act) {
    int64_t rec = record_bytes(F);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * rec;
        __m512 d, m, w0, w1;
        prefetch_streams(blk, 1, 0, g, k / GROUP, rec);
        scales512(F, r, &d, &m);
        for (int i = 0; i < GROUP; i += 2) {
            int64_t at = g * GROUP + i;
            weights_pair512(F, r, i, d, m, &w0, &w1);
            QK1(w0, at) QK1(w1, at + 1)
        }
    }
    QO1(0) QO1(1) QO1(2) QO1(3) QO1(4) QO1(5) QO1(6) QO1(7) QO1(8) QO1(9) QO1(10) QO1(11)
}

/* R <= 6 rows against two blocks side by side */
#define QR2(j, u, v, i)                                                                            \
    if (R > j) {                                                                                   \
        __m512 xv = _mm512_set1_ps(x[j * ldx + (i)]);                                              \
        a##j = _mm512_fmadd_ps(xv, u, a##j);                                                       \
        b##j = _mm512_fmadd_ps(xv, v, b##j);                                                       \
    }
#define QK2(u, v, i) QR2(0, u, v, i) QR2(1, u, v, i) QR2(2, u, v, i) QR2(3, u, v, i) QR2(4, u, v, i) QR2(5, u, v, i)
#define QO2(j) if (R > j) { store16(y + j * ldy, col, n, a##j, act); store16(y + j * ldy, col + BLOCK, n, b##j, act); }
static inline AVX512 __attribute__((always_inline)) void
qtile2(const int64_t F, const int R, const float *x, int64_t ldx, const uint8_t *blk, int64_t stride, int64_t k,
       float *y, int64_t ldy, int64_t col, int64_t n, int act) {
    int64_t rec = record_bytes(F);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * rec, *s = r + stride;
        __m512 d, m, e, f, u0, u1, v0, v1;
        prefetch_streams(blk, 2, stride, g, k / GROUP, rec);
        scales512(F, r, &d, &m);
        scales512(F, s, &e, &f);
        for (int i = 0; i < GROUP; i += 2) {
            int64_t at = g * GROUP + i;
            weights_pair512(F, r, i, d, m, &u0, &u1);
            weights_pair512(F, s, i, e, f, &v0, &v1);
            QK2(u0, v0, at) QK2(u1, v1, at + 1)
        }
    }
    QO2(0) QO2(1) QO2(2) QO2(3) QO2(4) QO2(5)
}

#define QTILE(tile, R) case R: tile(F, R, x, ldx, blk, k, y, ldy, col, n, act); break;
#define QTILE2(R) case R: qtile2(F, R, x, ldx, blk, stride, k, y, ldy, col, n, act); break;
/* `rows` rows (2 to 12) against the column blocks [b0, b1): up to 6 rows two blocks at a time, as rowdot512_span;
 * each output is its own chain whichever tile computes it */
static inline AVX512 __attribute__((always_inline)) void
rows_span512(const int64_t F, const float *x, int64_t ldx, const uint8_t *data, int64_t stride, int64_t k, float *y,
             int64_t ldy, int64_t n, int64_t rows, int64_t b0, int64_t b1, int act) {
    int64_t b = b0;
    if (rows <= 6)
        for (; b + 2 <= b1; b += 2) {
            const uint8_t *blk = data + b * stride;
            int64_t col = b * BLOCK;
            switch (rows) { QTILE2(6) QTILE2(5) QTILE2(4) QTILE2(3) default: QTILE2(2) }
        }
    for (; b < b1; b++) {
        const uint8_t *blk = data + b * stride;
        int64_t col = b * BLOCK;
        switch (rows) {
        QTILE(qtile1, 12) QTILE(qtile1, 11) QTILE(qtile1, 10) QTILE(qtile1, 9) QTILE(qtile1, 8) QTILE(qtile1, 7)
        QTILE(qtile1, 6) QTILE(qtile1, 5) QTILE(qtile1, 4) QTILE(qtile1, 3) default: QTILE(qtile1, 2)
        }
    }
}

#define FUSED_ROWS 12       /* a tile's rows: one tile1 (two tile2s) */
#define FUSED_MAX_ROWS 32   /* up to here in tiles that rebuild their weights, then the buffer (which rebuilds each
                             * weight once a call): a whole-model step measured even at 32-64 rows either way */

AVX512 static void rows512(const int64_t format, const float *x, int64_t ldx, const uint8_t *data, int64_t stride,
                           int64_t k, float *y, int64_t ldy, int64_t n, int64_t rows, int64_t b0, int64_t b1,
                           int act) {
    if (format == WEIGHT_Q4_1)
        rows_span512(WEIGHT_Q4_1, x, ldx, data, stride, k, y, ldy, n, rows, b0, b1, act);
    else
        rows_span512(WEIGHT_Q8_0, x, ldx, data, stride, k, y, ldy, n, rows, b0, b1, act);
}

#define BUFFERED 2   /* column blocks dequantized at a time for more than one row: the AVX-512 tiles' pair */

/* this thread's buffer for BUFFERED dequantized column blocks (grown, never shrunk: K x 16 floats each) */
static float *block_buffer(int64_t k) {
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (k > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)(BUFFERED * k * BLOCK) * sizeof(float));
        cap = buf != NULL ? k : 0;
    }
    return buf;
}

static inline __attribute__((always_inline)) void
quant_blocks(const int64_t F, const float *x, int64_t ldx, const uint8_t *data, int64_t k, float *y, int64_t ldy,
             int64_t n, int64_t m, int64_t b0, int64_t b1, int act) {
    int64_t stride = (k / GROUP) * record_bytes(F);
    if (m == 1 && kernels_isa(-1)) {
        row512(F, x, data, stride, k, y, n, b0, b1, act);
        return;
    }
    if (m == 1 && F == WEIGHT_Q4_1) {
        int64_t b = b0;
        for (; b + 2 <= b1; b += 2)
            row_q4_split(2, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
        if (b < b1)
            row_q4_split(1, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
        return;
    }
    if (m == 1) {
        int64_t b = b0;
        for (; b + 2 <= b1; b += 2)
            row_blocks(F, 2, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
        if (b < b1)
            row_blocks(F, 1, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
        return;
    }
    if (m <= FUSED_MAX_ROWS && kernels_isa(-1)) {
        for (int64_t r = 0; r < m; r += FUSED_ROWS) {
            int64_t rows = m - r < FUSED_ROWS ? m - r : FUSED_ROWS;
            if (rows == 1)
                row512(F, x + r * ldx, data, stride, k, y + r * ldy, n, b0, b1, act);
            else
                rows512(F, x + r * ldx, ldx, data, stride, k, y + r * ldy, ldy, n, rows, b0, b1, act);
        }
        return;
    }
    if (m <= HALVES_MAX_ROWS) {
        rows_halves(F, x, ldx, data, stride, k, y, ldy, n, m, b0, b1, act);
        return;
    }
    float *buf = block_buffer(k);
    if (buf == NULL)
        abort();   /* out of memory for K x 16 floats: nothing sensible to return from a kernel */
    for (int64_t b = b0; b < b1; b += BUFFERED) {
        int64_t nb = b1 - b < BUFFERED ? b1 - b : BUFFERED;
        for (int64_t j = 0; j < nb; j++)
            dequant_block(F, data + (b + j) * stride, k, buf + j * k * BLOCK);
        rowdot_span(x, ldx, buf, k, y, ldy, n, m, b * BLOCK, nb, act);
    }
}

void weight_blocks(const float *x, int64_t ldx, const packed_weight *w, int64_t k, float *y, int64_t ldy,
                   int64_t n, int64_t m, int64_t b0, int64_t b1, int act) {
    switch (w->format) {
    case WEIGHT_Q4_1: quant_blocks(WEIGHT_Q4_1, x, ldx, w->data, k, y, ldy, n, m, b0, b1, act); break;
    case WEIGHT_Q8_0: quant_blocks(WEIGHT_Q8_0, x, ldx, w->data, k, y, ldy, n, m, b0, b1, act); break;
    case WEIGHT_Q4_1_Q8:
    case WEIGHT_Q8_0_Q8: q8_blocks(w->format, x, ldx, w->data, k, y, ldy, n, m, b0, b1, act); break;
    default: rowdot_blocks(x, ldx, w->data, k, y, ldy, n, m, b0, b1, act); break;
    }
}

/* the packed weight's fp32 values in rowdot's layout [ceil(n / 16)][k][16]: what the load-time check compares
 * with the converted weight rowdot_pack'ed */
void rowquant_dequant(const uint8_t *data, int64_t n, int64_t k, int64_t format, float *out) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, stride = (k / GROUP) * record_bytes(format);
    for (int64_t b = 0; b < blocks; b++) {
        if (format == WEIGHT_Q4_1)
            dequant_block(WEIGHT_Q4_1, data + b * stride, k, out + b * k * BLOCK);
        else
            dequant_block(WEIGHT_Q8_0, data + b * stride, k, out + b * k * BLOCK);
    }
}
