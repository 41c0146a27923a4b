/* Attention one query row at a time, over the paged KV arena, in one fixed order: batch-invariant by
 * construction (tether/model/rowattn.py says where it serves).
 *
 * For query row r of head h (kv head h / group), at position p, reading keys 0..p of its request:
 *   s_j = dot(q, k_j) * scale        the dot over head_dim in 8 lanes, lane j accumulating d = j, j+8, ... in
 *                                    order (one FMA chain each), then the lanes summed in one fixed tree
 *   m   = max_j s_j                  exact in any order
 *   e_j = exp(s_j - m)               one vector polynomial for every element (vecmath.h's exp8)
 *   l   = sum_j e_j                  8 lanes of j = lane, lane+8, ... in order, then the same fixed tree
 *   o   = (sum_j e_j v_j) / l        one FMA chain per output element over j in order
 * Nothing depends on the other rows of the call, on which thread computes a row, or on how a request's prompt
 * was chunked (a key past p is never read), so prefill, chunked prefill and decode give a row the same bits.
 *
 * Built with -mavx2 -mfma -ffp-contract=off, like rowdot.c.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "rows.h"
#include "vecmath.h"

/* d % 8 == 0 (rowattn.py checks) */
static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* the first of the row's keys (or values) in block b of its request, for its kv head: the block's keys follow it,
 * d floats apart (the arena is [blocks][kv_heads][block][d]) */
#define BLOCK_AT(cache, b) ((cache) + ((table[b] * kv_heads + kvh) * block) * d)

/* A step reads each request's keys and values once a kv head (its other query heads find them cached), and finds
 * them cold: smollm2's KV is 46 KB a position over 30 layers, 46 MB for 8 rows at 126 positions, and the hardware
 * prefetcher starts again at every 4 KiB page of a block. So each loop asks for the key (or value) KEYS_AHEAD on,
 * in the request's next block past this one's end. A prefetch changes no value: the same bits. */
#define KEYS_AHEAD 8
static inline __attribute__((always_inline)) void
prefetch_keys(const float *cache, const int64_t *table, int64_t b, int64_t o, int64_t count, int64_t ctx,
              int64_t kvh, int64_t kv_heads, int64_t d, int64_t block) {
    int64_t at = o + KEYS_AHEAD;
    if (b * block + at >= ctx)
        return;
    const float *p = at < block ? BLOCK_AT(cache, b) + at * d : BLOCK_AT(cache, b + 1) + (at - block) * d;
    for (int64_t l = 0; l < count * d * (int64_t)sizeof(float); l += 64)
        _mm_prefetch((const char *)p + l, _MM_HINT_T0);
}

/* o += e_j v_j over the row's keys, one FMA chain per output element in key order, 64 elements at a time in named
 * registers (GCC kept an array of accumulators on the stack: a load and a store beside every FMA); in AVX-512
 * (where kernels_isa says) 16 elements an instruction, the same chains as 8 in AVX2. A row's 64 elements are
 * rows of its chains like any others, so a wider head takes several passes with the same bits. */
#define PV_ELEMENTS 64
static inline __attribute__((always_inline)) void
pv64(const float *vc, const int64_t *table, int64_t ctx, int64_t kvh, int64_t kv_heads, int64_t d, int64_t block,
     const float *s, float l, int64_t c0, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j0 = 0; j0 < ctx; j0 += block) {
        const float *vb = BLOCK_AT(vc, j0 / block) + c0;
        int64_t n = ctx - j0 < block ? ctx - j0 : block;
        for (int64_t o = 0; o < n; o++) {
            const float *v = vb + o * d;
            if (c0 == 0)
                prefetch_keys(vc, table, j0 / block, o, 1, ctx, kvh, kv_heads, d, block);
            __m256 e = _mm256_set1_ps(s[j0 + o]);
            a0 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 24), a3);
            a4 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 32), a4);
            a5 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 40), a5);
            a6 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 48), a6);
            a7 = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 56), a7);
        }
    }
    __m256 lv = _mm256_set1_ps(l);
    float *y = out + c0;
    _mm256_storeu_ps(y, _mm256_div_ps(a0, lv));
    _mm256_storeu_ps(y + 8, _mm256_div_ps(a1, lv));
    _mm256_storeu_ps(y + 16, _mm256_div_ps(a2, lv));
    _mm256_storeu_ps(y + 24, _mm256_div_ps(a3, lv));
    _mm256_storeu_ps(y + 32, _mm256_div_ps(a4, lv));
    _mm256_storeu_ps(y + 40, _mm256_div_ps(a5, lv));
    _mm256_storeu_ps(y + 48, _mm256_div_ps(a6, lv));
    _mm256_storeu_ps(y + 56, _mm256_div_ps(a7, lv));
}

static AVX512 void pv64_512(const float *vc, const int64_t *table, int64_t ctx, int64_t kvh, int64_t kv_heads,
                            int64_t d, int64_t block, const float *s, float l, int64_t c0, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j0 = 0; j0 < ctx; j0 += block) {
        const float *vb = BLOCK_AT(vc, j0 / block) + c0;
        int64_t n = ctx - j0 < block ? ctx - j0 : block;
        for (int64_t o = 0; o < n; o++) {
            const float *v = vb + o * d;
            if (c0 == 0)
                prefetch_keys(vc, table, j0 / block, o, 1, ctx, kvh, kv_heads, d, block);
            __m512 e = _mm512_set1_ps(s[j0 + o]);
            a0 = _mm512_fmadd_ps(e, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(e, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(e, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(e, _mm512_loadu_ps(v + 48), a3);
        }
    }
    __m512 lv = _mm512_set1_ps(l);
    float *y = out + c0;
    _mm512_storeu_ps(y, _mm512_div_ps(a0, lv));
    _mm512_storeu_ps(y + 16, _mm512_div_ps(a1, lv));
    _mm512_storeu_ps(y + 32, _mm512_div_ps(a2, lv));
    _mm512_storeu_ps(y + 48, _mm512_div_ps(a3, lv));
}

/* the same for any d % 8 == 0 (up to 256 wide: rowattn.py checks d), its accumulators wherever GCC keeps them */
static void pv_any(const float *vc, const int64_t *table, int64_t ctx, int64_t kvh, int64_t kv_heads, int64_t d,
                   int64_t block, const float *s, float l, float *out) {
    __m256 acc[32];
    for (int64_t i = 0; i < d / 8; i++)
        acc[i] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < ctx; j0 += block) {
        const float *vb = BLOCK_AT(vc, j0 / block);
        int64_t n = ctx - j0 < block ? ctx - j0 : block;
        for (int64_t o = 0; o < n; o++) {
            const float *v = vb + o * d;
            prefetch_keys(vc, table, j0 / block, o, 1, ctx, kvh, kv_heads, d, block);
            __m256 e = _mm256_set1_ps(s[j0 + o]);
            for (int64_t i = 0; i < d / 8; i++)
                acc[i] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
    }
    __m256 lv8 = _mm256_set1_ps(l);
    for (int64_t i = 0; i < d / 8; i++)
        _mm256_storeu_ps(out + 8 * i, _mm256_div_ps(acc[i], lv8));
}

void rowattn_row(const float *q, const float *kc, const float *vc, const int64_t *table, int64_t pos,
                    int64_t kvh, int64_t kv_heads, int64_t d, int64_t block, float scale, float *s, float *out) {
    int64_t ctx = pos + 1;
    float m = -INFINITY;
    /* block by block (no division per key); inside a block eight (then four) keys' chains side by side, each the
     * same chain as alone */
    for (int64_t j0 = 0; j0 < ctx; j0 += block) {
        const float *kb = BLOCK_AT(kc, j0 / block);
        int64_t n = ctx - j0 < block ? ctx - j0 : block, o = 0;
        for (; o + 8 <= n; o += 8) {   /* 8 chains: enough to keep both FMA pipes busy through their latency */
            const float *k0 = kb + o * d;
            prefetch_keys(kc, table, j0 / block, o, 8, ctx, kvh, kv_heads, d, block);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d + i), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * d + i), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * d + i), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 4 * d + i), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 5 * d + i), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 6 * d + i), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 7 * d + i), a7);
            }
            float *so = s + j0 + o;
            so[0] = hsum(a0) * scale;
            so[1] = hsum(a1) * scale;
            so[2] = hsum(a2) * scale;
            so[3] = hsum(a3) * scale;
            so[4] = hsum(a4) * scale;
            so[5] = hsum(a5) * scale;
            so[6] = hsum(a6) * scale;
            so[7] = hsum(a7) * scale;
        }
        for (; o + 4 <= n; o += 4) {
            const float *k0 = kb + o * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
            prefetch_keys(kc, table, j0 / block, o, 4, ctx, kvh, kv_heads, d, block);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
            }
            s[j0 + o] = hsum(a0) * scale;
            s[j0 + o + 1] = hsum(a1) * scale;
            s[j0 + o + 2] = hsum(a2) * scale;
            s[j0 + o + 3] = hsum(a3) * scale;
        }
        for (; o < n; o++)
            s[j0 + o] = dot(q, kb + o * d, d) * scale;
    }
    for (int64_t j = 0; j < ctx; j++)
        m = s[j] > m ? s[j] : m;
    int64_t padded = (ctx + 7) / 8 * 8, full = ctx / 8 * 8;
    for (int64_t j = ctx; j < padded; j++)
        s[j] = m;                                   /* computed, never used */
    __m256 mv = _mm256_set1_ps(m), lv = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        if (j < full)
            lv = _mm256_add_ps(lv, e);
    }
    float l = hsum(lv);
    for (int64_t j = full; j < ctx; j++)            /* the last, partial vector, in order */
        l += s[j];
    if (d % PV_ELEMENTS == 0) {
        int wide = kernels_isa(-1);
        for (int64_t c0 = 0; c0 < d; c0 += PV_ELEMENTS) {
            if (wide)
                pv64_512(vc, table, ctx, kvh, kv_heads, d, block, s, l, c0, out);
            else
                pv64(vc, table, ctx, kvh, kv_heads, d, block, s, l, c0, out);
        }
        return;
    }
    pv_any(vc, table, ctx, kvh, kv_heads, d, block, s, l, out);
}

/* q, out: [rows][heads][d]; kc, vc: one layer's arena [blocks][kv_heads][block][d]; row r at position pos[r]
 * reads the blocks tables[first[r]], tables[first[r] + 1], ... (its request's, in position order); scratch:
 * `threads` rows of `stride` floats. */
void rowattn(const float *q, const float *kc, const float *vc, const int64_t *pos, const int64_t *first,
             const int64_t *tables, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t block,
             float scale, float *scratch, int64_t stride, float *out, int threads) {
    int64_t group = heads / kv_heads, tasks = rows * heads;
    #pragma omp parallel num_threads(threads > 1 && tasks > 1 ? threads : 1)
    {
        float *s = scratch + omp_get_thread_num() * stride;   /* a row's scores: stride >= its context, padded to 8 */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t r = t / heads, h = t % heads;
            rowattn_row(q + t * d, kc, vc, tables + first[r], pos[r], h / group, kv_heads, d, block, scale, s,
                    out + t * d);
        }
    }
}
