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
 * One row (a decode step alone) dequantizes in registers next to the FMAs; more rows dequantize two column
 * blocks at a time into a per-thread buffer and run rowdot's tiles over them.
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

/* a column block's K x 16 fp32 weights, in rowdot's layout */
static inline __attribute__((always_inline)) void
dequant_block(const int64_t F, const uint8_t *blk, int64_t k, float *out) {
    int64_t rec = record_bytes(F);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * rec;
        __m256 d0, d1, m0, m1, lo, hi;
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

/* The same one-row kernel in AVX-512 (where the CPU has F, BW, DQ and VL: kernels_isa): a column block's 16
 * columns in one register, up to 4 blocks side by side, two k-rows' nibbles unpacked at once. Every weight is
 * rebuilt by the same operations and every chain runs over k in the same order, so the bits are the AVX2
 * kernel's (tests/tether/model/test_rowquant.py runs both). */

#define W4(r) _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(r)), m[j])
#define W8(i) _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128( \
                  (const __m128i *)(r[j] + 32 + 16 * (i))))), d[j])

static inline AVX512 __attribute__((always_inline)) void
row_blocks512(const int64_t F, const int nb, const float *x, const uint8_t *blk, int64_t stride, int64_t k,
              float *y, int64_t col, int64_t n, int act) {
    int64_t rec = record_bytes(F);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m128i mask = _mm_set1_epi8(15);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r[4];
        __m512 d[4], m[4];
        for (int j = 0; j < nb; j++) {
            r[j] = blk + j * stride + g * rec;
            d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r[j]));
            m[j] = F == WEIGHT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r[j] + 32)))
                                    : _mm512_setzero_ps();
        }
        for (int i = 0; i < GROUP; i += 2) {
            __m512 x0 = _mm512_set1_ps(x[g * GROUP + i]), x1 = _mm512_set1_ps(x[g * GROUP + i + 1]);
            for (int j = 0; j < nb; j++) {
                if (F == WEIGHT_Q4_1) {
                    __m128i v = _mm_loadu_si128((const __m128i *)(r[j] + 64 + 8 * i));   /* k-rows i, i + 1 */
                    __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
                    acc[j] = _mm512_fmadd_ps(x0, W4(_mm_unpacklo_epi8(lo, hi)), acc[j]);
                    acc[j] = _mm512_fmadd_ps(x1, W4(_mm_unpackhi_epi8(lo, hi)), acc[j]);
                } else {
                    acc[j] = _mm512_fmadd_ps(x0, W8(i), acc[j]);
                    acc[j] = _mm512_fmadd_ps(x1, W8(i + 1), acc[j]);
                }
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
    if (m == 1) {
        int64_t b = b0;
        for (; b + 2 <= b1; b += 2)
            row_blocks(F, 2, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
        if (b < b1)
            row_blocks(F, 1, x, data + b * stride, stride, k, y, b * BLOCK, n, act);
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
