/* Linears the way llama.cpp computes a GGUF file's Q4_1 and Q8_0 weights: a row's inputs rounded to 8 bits per
 * group of 32, multiplied with the file's own 4- or 8-bit groups in integers, the groups' integer sums combined in
 * float32.
 *
 * For each row and group g of 32 inputs:  dx = max|x| / 127,  qx = round-half-even(x * (1 / dx)) (0 where dx is 0),
 * sx = dx * sum(qx). For output j, with the file's group scale dw, minimum mw and 4-bit q (w = dw * q + mw):
 *   isum_g = sum_i q[i] * qx[i]                               an integer: exact in any order
 *   acc = 0;  for g = 0, 1, ...:  acc = acc + (dw_g * dx_g) * isum_g;  acc = acc + mw_g * sx_g
 * (Q8_0: w = dw * q, q int8, and no mw term), each product and sum rounded once, in that order (no FMA). A row's
 * bits depend only on its own inputs: batch-invariant by construction, and the same on AVX2 and AVX-512 VNNI (the
 * integer sums are exact either way, the float chain is the same operations lane by lane). Not rowdot's bits: the
 * inputs are rounded to 8 bits, so this is a numerics of its own ("q8" in tether/model/rowq8.py), never mixed with
 * float32's.
 *
 * Layout (rowq8_pack): a column block of 16 outputs, then its groups of 32 inputs, 320 bytes a group:
 *   d[16] fp16, m[16] fp16, then 4 chunks of 64 bytes: chunk t, bytes 4c..4c+3 hold column c's q[4t + b] in their
 *   low nibbles and q[16 + 4t + b] in their high ones (b = 0..3): the GGUF block's own bytes 4t..4t+3 of that
 *   column, so one AND / shift gives 16 columns x 4 inputs, a VNNI dot product's operand.
 * Q8_0, 576 bytes a group: d[16] fp16, 32 bytes of padding (each 64-byte load on one cache line), then 8 chunks
 *   of 64 bytes, bytes 4c..4c+3 of chunk t column c's q[4t + b] + 128 (unsigned: a VNNI operand; the integer sum
 *   takes 128 * sum(qx) back off, exactly).
 * Columns past N have d = m = 0 (outputs +0, as rowdot's padding).
 *
 * Built with the other kernels' flags (-mavx2 -mfma -mf16c -ffp-contract=off); the AVX-512 functions carry
 * their own target and run only where cpuid has AVX-512 VNNI (and kernels_isa has not turned AVX-512 off).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#define GROUP 32
#define Q4 WEIGHT_Q4_1_Q8
#define Q8 WEIGHT_Q8_0_Q8
#define RECORD(F) ((F) == Q4 ? 320 : 576)   /* bytes of one column block's group: whole cache lines */
#define MAX_ROWS 8      /* rows an AVX-512 tile (32 registers) */
#define MAX_ROWS2 4     /* rows an AVX2 tile (16 registers) */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

int64_t rowq8_bytes(int64_t n, int64_t k, int64_t format) {
    return (n + BLOCK - 1) / BLOCK * (k / GROUP) * RECORD(format);
}

/* A GGUF tensor's blocks (row-major [n][k / 32] blocks; Q4_1, 20 bytes: d, m fp16, then 16 bytes holding input i
 * in the low nibble of byte i and input i + 16 in its high one; Q8_0, 34 bytes: d fp16, 32 int8) in the layout
 * above. */
void rowq8_pack(const uint8_t *src, int64_t n, int64_t k, int64_t format, uint8_t *out) {
    int64_t groups = k / GROUP, rec = RECORD(format);
    memset(out, 0, (size_t)rowq8_bytes(n, k, format));
    for (int64_t j = 0; j < n; j++) {
        int64_t c = j % BLOCK;
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *r = out + ((j / BLOCK) * groups + g) * rec;
            if (format == Q4) {
                const uint8_t *b = src + (j * groups + g) * 20;
                memcpy(r + 2 * c, b, 2);
                memcpy(r + 32 + 2 * c, b + 2, 2);
                for (int t = 0; t < 4; t++)
                    memcpy(r + 64 + 64 * t + 4 * c, b + 4 + 4 * t, 4);
            } else {
                const uint8_t *b = src + (j * groups + g) * 34;
                memcpy(r + 2 * c, b, 2);
                for (int i = 0; i < GROUP; i++)
                    r[64 + 64 * (i / 4) + 4 * c + i % 4] = (uint8_t)(b[2 + i] ^ 0x80);
            }
        }
    }
}

/* A row's inputs, quantized: qx [k] int8, and per group dx (scale) and sx (dx * sum of qx). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *sum;   /* sum(qx) per group (Q8_0's unsigned operand takes 128 of them back) */
} qrows;

/* rows r0.. of `x` (k inputs a row) */
static inline qrows rows_from(const qrows *x, int64_t r0, int64_t k) {
    int64_t groups = k / GROUP;
    return (qrows){x->q + r0 * k, x->d + r0 * groups, x->s + r0 * groups, x->sum + r0 * groups};
}

static int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* one row's group of 32 inputs; the same instructions on every machine (AVX2 float ops are IEEE, the
 * conversion rounds half to even under the default MXCSR) */
static void quantize_group(const float *x, int8_t *q, float *d, float *s, int32_t *sum_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], a = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float amax = _mm_cvtss_f32(h), dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
    __m256 idv = _mm256_set1_ps(id), lim = _mm256_set1_ps(127.0f);
    __m256i qi[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], idv), _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
        qi[i] = _mm256_cvtps_epi32(t);
        sum = _mm256_add_epi32(sum, qi[i]);
    }
    /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
    __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    int32_t total = hsum_i32(sum);
    *d = dx;
    *s = dx * (float)total;
    *sum_out = total;
}

static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, qrows *out) {
    int64_t groups = k / GROUP;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++)
            quantize_group(x + r * ldx + g * GROUP, out->q + r * k + g * GROUP, out->d + r * groups + g,
                           out->s + r * groups + g, out->sum + r * groups + g);
}

/* ------------------------------------------------------------------------------------------------ AVX2 */

/* a Q8_0 chunk's 8 columns x 4 inputs times x's 4 inputs xq, into acc (4 adjacent products into each int32 lane):
 * the stored q + 128 back to q, then |q| (<= 128) times qx with q's sign, at most 32,512 a pair of products, so
 * each pair is widened at once (Q4_1's tile sums its pairs in int16 first: tile2) */
static inline __attribute__((always_inline)) __m256i q8_dot2(__m256i acc, __m256i w, __m256i xq) {
    __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xq, q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline int32_t x4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* R rows (<= MAX_ROWS2) against one column block: 16 columns as two halves of 8 */
static inline __attribute__((always_inline)) void
tile2(const int64_t F, const int R, const qrows *x, int64_t k, const uint8_t *wb, float *y, int64_t ldy,
      int64_t col, int64_t n, int act) {
    int64_t groups = k / GROUP;
    const __m256i low = _mm256_set1_epi8(15);
    __m256 lo[MAX_ROWS2], hi[MAX_ROWS2];
    for (int r = 0; r < R; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = wb + g * RECORD(F), *qs = rec + 64;
        /* the record PREFETCH_RECORDS ahead (rows.h); a thread's blocks follow each other in memory, so the stream
         * runs on into the next block. After 8 ms idle (Xeon, interleaved): 17 layers 3.41 -> 3.18 ms in AVX2
         * (VNNI unchanged), the head 2.82 -> 2.42 / 2.44 -> 2.16 ms; hot steps unchanged */
        prefetch_lines(rec + PREFETCH_RECORDS * RECORD(F), RECORD(F));
        __m256i ilo[MAX_ROWS2], ihi[MAX_ROWS2];
        for (int r = 0; r < R; r++)
            ilo[r] = ihi[r] = _mm256_setzero_si256();
        if (F == Q4) {
            /* u8 nibbles (<= 15) x s8 inputs (|qx| <= 127): a pair of products at most 3,810, so the group's eight
             * pairs per int16 lane are summed before widening (30,480 < 32,767): the same integers as widening
             * each pair, ~30% fewer instructions */
            __m256i slo[MAX_ROWS2], shi[MAX_ROWS2];
            for (int r = 0; r < R; r++)
                slo[r] = shi[r] = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                __m256i v0 = _mm256_loadu_si256((const __m256i *)(qs + 64 * t));
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(qs + 64 * t + 32));
                /* empty asm: left alone, gcc computes all of a 4-row group's maddubs before their sums and spills
                 * each to the stack (8 rows: 10.6 -> 8.1 ms for the model's linears with it, 94194d0); this keeps
                 * each chunk and each row's sums in order. The Q8_0 branch below schedules well without. */
                __asm__ volatile("" : "+x"(v0), "+x"(v1));
                __m256i a0 = _mm256_and_si256(v0, low), b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
                __m256i a1 = _mm256_and_si256(v1, low), b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *q = x->q + r * k + g * GROUP;
                    __m256i sa = _mm256_set1_epi32(x4(q + 4 * t)), sb = _mm256_set1_epi32(x4(q + 16 + 4 * t));
                    slo[r] = _mm256_add_epi16(slo[r], _mm256_add_epi16(_mm256_maddubs_epi16(a0, sa),
                                                                       _mm256_maddubs_epi16(b0, sb)));
                    shi[r] = _mm256_add_epi16(shi[r], _mm256_add_epi16(_mm256_maddubs_epi16(a1, sa),
                                                                       _mm256_maddubs_epi16(b1, sb)));
                    __asm__ volatile("" : "+x"(slo[r]), "+x"(shi[r]));
                }
            }
            for (int r = 0; r < R; r++) {
                ilo[r] = _mm256_madd_epi16(slo[r], _mm256_set1_epi16(1));
                ihi[r] = _mm256_madd_epi16(shi[r], _mm256_set1_epi16(1));
            }
        } else {
            for (int t = 0; t < 8; t++) {
                __m256i v0 = _mm256_loadu_si256((const __m256i *)(qs + 64 * t));
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(qs + 64 * t + 32));
                for (int r = 0; r < R; r++) {
                    __m256i sa = _mm256_set1_epi32(x4(x->q + r * k + g * GROUP + 4 * t));
                    ilo[r] = q8_dot2(ilo[r], v0, sa);
                    ihi[r] = q8_dot2(ihi[r], v1, sa);
                }
            }
        }
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
        for (int r = 0; r < R; r++) {
            __m256 dx = _mm256_set1_ps(x->d[r * groups + g]);
            lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(_mm256_mul_ps(d0, dx), _mm256_cvtepi32_ps(ilo[r])));
            hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(_mm256_mul_ps(d1, dx), _mm256_cvtepi32_ps(ihi[r])));
        }
        if (F == Q4) {
            __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 32)));
            __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 48)));
            for (int r = 0; r < R; r++) {
                __m256 sx = _mm256_set1_ps(x->s[r * groups + g]);
                lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(m0, sx));
                hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(m1, sx));
            }
        }
    }
    for (int r = 0; r < R; r++)
        store_cols(y + r * ldy, col, n, lo[r], hi[r], act);
}

/* --------------------------------------------------------------------------------------- AVX-512 VNNI */

/* R rows (<= MAX_ROWS) against one column block. With four rows or fewer each integer sum is split in two
 * accumulators (added at the group's end, exactly): a dot product waits ~5 cycles on its accumulator, so one
 * row's 8 a group in one chain would wait on latency. */
static inline VNNI __attribute__((always_inline)) void
tile512(const int64_t F, const int R, const qrows *x, int64_t k, const uint8_t *wb, float *y, int64_t ldy,
        int64_t col, int64_t n, int act) {
    int64_t groups = k / GROUP;
    const int split = R <= 4;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = wb + g * RECORD(F), *qs = rec + 64;
        prefetch_lines(rec + PREFETCH_RECORDS * RECORD(F), RECORD(F));   /* as tile2 */
        __m512i is[MAX_ROWS], is2[4];
        for (int r = 0; r < R; r++)
            is[r] = _mm512_setzero_si512();
        for (int r = 0; split && r < R; r++)
            is2[r] = _mm512_setzero_si512();
        if (F == Q4) {
            for (int t = 0; t < 4; t++) {
                __m512i v = _mm512_loadu_si512(qs + 64 * t);
                __m512i a = _mm512_and_si512(v, low), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *q = x->q + r * k + g * GROUP;
                    is[r] = _mm512_dpbusd_epi32(is[r], a, _mm512_set1_epi32(x4(q + 4 * t)));
                    if (split)
                        is2[r] = _mm512_dpbusd_epi32(is2[r], h, _mm512_set1_epi32(x4(q + 16 + 4 * t)));
                    else
                        is[r] = _mm512_dpbusd_epi32(is[r], h, _mm512_set1_epi32(x4(q + 16 + 4 * t)));
                }
            }
        } else {
            for (int t = 0; t < 8; t++) {
                __m512i v = _mm512_loadu_si512(qs + 64 * t);
                for (int r = 0; r < R; r++) {
                    __m512i xq = _mm512_set1_epi32(x4(x->q + r * k + g * GROUP + 4 * t));
                    if (split && (t & 1))
                        is2[r] = _mm512_dpbusd_epi32(is2[r], v, xq);
                    else
                        is[r] = _mm512_dpbusd_epi32(is[r], v, xq);
                }
            }
            for (int r = 0; r < R; r++)   /* (q + 128) . qx - 128 * sum(qx) = q . qx */
                is[r] = _mm512_sub_epi32(is[r], _mm512_set1_epi32(128 * x->sum[r * groups + g]));
        }
        for (int r = 0; split && r < R; r++)
            is[r] = _mm512_add_epi32(is[r], is2[r]);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
        for (int r = 0; r < R; r++) {
            __m512 dx = _mm512_set1_ps(x->d[r * groups + g]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(is[r])));
        }
        if (F == Q4) {
            __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32)));
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(x->s[r * groups + g])));
        }
    }
    for (int r = 0; r < R; r++)
        store16(y + r * ldy, col, n, acc[r], act);
}

#define CASE512(R) case R: tile512(F, R, &xr, k, wb, yr, ldy, col, n, act); break;

/* rows [0, m) against blocks [b0, b1), one block at a time, up to 8 rows a tile: the weights streamed in order.
 * (One row on four blocks side by side, four streams of records, took 1.3x AVX2's time on the whole model's
 * linears read from memory, one block 0.92x: bf16 EPYC, 2026-12-06.) */
static inline VNNI __attribute__((always_inline)) void
span512(const int64_t F, const qrows *x, int64_t m, int64_t k, const uint8_t *data, float *y, int64_t ldy,
        int64_t n, int64_t b0, int64_t b1, int act) {
    int64_t stride = (k / GROUP) * RECORD(F);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *wb = data + b * stride;
        int64_t col = b * BLOCK;
        for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
            qrows xr = rows_from(x, r0, k);
            float *yr = y + r0 * ldy;
            switch (m - r0 < MAX_ROWS ? (int)(m - r0) : MAX_ROWS) {
            CASE512(8) CASE512(7) CASE512(6) CASE512(5) CASE512(4) CASE512(3) CASE512(2)
            default: tile512(F, 1, &xr, k, wb, yr, ldy, col, n, act);
            }
        }
    }
}

/* each format's span compiled once, in AVX-512 */
VNNI static void span512_q4(const qrows *x, int64_t m, int64_t k, const uint8_t *data, float *y, int64_t ldy,
                            int64_t n, int64_t b0, int64_t b1, int act) {
    span512(Q4, x, m, k, data, y, ldy, n, b0, b1, act);
}

VNNI static void span512_q8(const qrows *x, int64_t m, int64_t k, const uint8_t *data, float *y, int64_t ldy,
                            int64_t n, int64_t b0, int64_t b1, int act) {
    span512(Q8, x, m, k, data, y, ldy, n, b0, b1, act);
}

#define CASE2(R) case R: tile2(F, R, &xr, k, wb, yr, ldy, col, n, act); break;

static inline __attribute__((always_inline)) void
span2(const int64_t F, const qrows *x, int64_t m, int64_t k, const uint8_t *data, float *y, int64_t ldy, int64_t n,
      int64_t b0, int64_t b1, int act) {
    int64_t stride = (k / GROUP) * RECORD(F);
    for (int64_t b = b0; b < b1; b++)
        for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS2) {
            qrows xr = rows_from(x, r0, k);
            const uint8_t *wb = data + b * stride;
            float *yr = y + r0 * ldy;
            int64_t col = b * BLOCK;
            switch (m - r0 < MAX_ROWS2 ? (int)(m - r0) : MAX_ROWS2) {
            CASE2(4) CASE2(3) CASE2(2) default: tile2(F, 1, &xr, k, wb, yr, ldy, col, n, act);
            }
        }
}

static int vnni = -1;

/* whether the VNNI path runs: the CPU has it and kernels_isa has AVX-512 on (kernels_isa(0) turns it off, for
 * the tests that compare both paths) */
static int use_vnni(void) {
    if (vnni < 0) {
        __builtin_cpu_init();
        vnni = __builtin_cpu_supports("avx512vnni");
    }
    return vnni && kernels_isa(-1);
}

int rowq8_isa(void) {
    return use_vnni();
}

/* a thread's quantized rows, grown as needed and kept (a step's calls reuse it) */
static __thread int8_t *tq;
static __thread float *tf;
static __thread int64_t tq_bytes, tf_floats;

void q8_blocks(int64_t format, const float *x, int64_t ldx, const uint8_t *data, int64_t k, float *y, int64_t ldy,
               int64_t n, int64_t m, int64_t b0, int64_t b1, int act) {
    int64_t groups = k / GROUP;
    if (tq_bytes < m * k) {
        free(tq);
        tq = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
        tq_bytes = tq ? m * k : 0;
    }
    if (tf_floats < 3 * m * groups) {   /* d, s and sum (int32, float-sized) per group */
        free(tf);
        tf = malloc((size_t)(3 * m * groups) * sizeof(float));
        tf_floats = tf ? 3 * m * groups : 0;
    }
    if (tq == NULL || tf == NULL)
        abort();   /* out of memory for a few KiB: nothing sensible to return from a kernel */
    qrows q = {tq, tf, tf + m * groups, (int32_t *)(tf + 2 * m * groups)};
    quantize_rows(x, ldx, m, k, &q);
    if (use_vnni()) {
        if (format == Q4)
            span512_q4(&q, m, k, data, y, ldy, n, b0, b1, act);
        else
            span512_q8(&q, m, k, data, y, ldy, n, b0, b1, act);
    } else if (format == Q4) {
        span2(Q4, &q, m, k, data, y, ldy, n, b0, b1, act);
    } else {
        span2(Q8, &q, m, k, data, y, ldy, n, b0, b1, act);
    }
}
