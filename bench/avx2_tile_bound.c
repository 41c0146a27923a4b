/* What bounds rowquant.c's AVX2 tile of 8 rows (one half of a Q4_1 block a pass: 8 chains, each row's x broadcast
 * from memory beside every FMA, the weights rebuilt in registers): the same loop with one part taken away at a
 * time, on one thread, everything hot in the caches (smollm2's 576 -> 1536 gate's shape, 96 column blocks). Not the
 * served kernel (its records, scales and stores are simplified): a measurement of the loop's shape only.
 *
 *     cc -O2 -mavx2 -mfma bench/avx2_tile_bound.c -o /tmp/avx2_tile_bound && /tmp/avx2_tile_bound
 *
 * On the Xeon (2026-12-07), GFLOP/s against bench/fma_rate.c's 112 a thread, a quiet run's 3 repeats (a noisy one
 * read 63-79 for the tile, the order the same): the tile 78-81; without the weights' rebuild 78-79 (a float load a k
 * in its place); without the x broadcasts 91-92; without either 97; 6 rows x both halves (12 chains, 8 loads for 12
 * FMAs, two rebuilds a k) 82-83. So the 8 broadcasts a k for 8 FMAs cost the tile ~15%, the rebuild ~5%, and 8
 * chains (the fewest that cover an FMA's latency on two pipes) leave ~13% even with neither: sharing a broadcast
 * between two FMAs takes 16 accumulators at 8 rows, and AVX2 has 16 registers in all. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define GROUP 32
#define REC 320   /* a group record: 64 bytes of scales, then 32 k-rows of 16 nibbles */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* k-row i's half H of a record, rebuilt as rowquant.c's half_weights does (widen, mask, convert, FMA) */
static inline __m256 rebuilt(const uint8_t *rec, int i, int H, __m256 d, __m256 m) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 64 + 8 * i)));
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(H ? 0xf0 : 0x0f))), m);
}

/* kind 0: the tile; 1: weights loaded as floats (no rebuild); 2: x from registers (no broadcast loads); 3: both */
#define ROW(j, w, at) a##j = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j * ldx + (at)), w, a##j);
static inline __attribute__((always_inline)) void half8(const int kind, int H, const float *x, int64_t ldx,
                                                        const uint8_t *blk, int64_t k, __m256 *out) {
    /* each chain from its own start: the compiler would merge two chains of equal starts and inputs */
    __m256 a0 = _mm256_set1_ps(0.0f), a1 = _mm256_set1_ps(0.1f), a2 = _mm256_set1_ps(0.2f), a3 = _mm256_set1_ps(0.3f);
    __m256 a4 = _mm256_set1_ps(0.4f), a5 = _mm256_set1_ps(0.5f), a6 = _mm256_set1_ps(0.6f), a7 = _mm256_set1_ps(0.7f);
    __m256 xr[4];
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * REC;
        __m256 d = _mm256_loadu_ps((const float *)r + 8 * H), m = _mm256_loadu_ps((const float *)r + 16 + 8 * H);
        for (int j = 0; j < 4; j++)
            xr[j] = _mm256_broadcast_ss(x + j * ldx + g);
        for (int i = 0; i < GROUP; i++) {
            __m256 w = kind & 1 ? _mm256_loadu_ps((const float *)(r + 64 + 32 * (i & 7))) : rebuilt(r, i, H, d, m);
            int64_t at = g * GROUP + i;
            if (kind & 2) {   /* 8 chains on 4 register-held x values: no loads but the weights' */
                a0 = _mm256_fmadd_ps(xr[0], w, a0); a1 = _mm256_fmadd_ps(xr[1], w, a1);
                a2 = _mm256_fmadd_ps(xr[2], w, a2); a3 = _mm256_fmadd_ps(xr[3], w, a3);
                a4 = _mm256_fmadd_ps(xr[0], w, a4); a5 = _mm256_fmadd_ps(xr[1], w, a5);
                a6 = _mm256_fmadd_ps(xr[2], w, a6); a7 = _mm256_fmadd_ps(xr[3], w, a7);
            } else {
                ROW(0, w, at) ROW(1, w, at) ROW(2, w, at) ROW(3, w, at) ROW(4, w, at) ROW(5, w, at) ROW(6, w, at)
                ROW(7, w, at)
            }
        }
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}

/* one loop per kind, each compiled with its kind constant (no branch left in the loop) */
#define KIND(n)                                                                                    \
    __attribute__((noinline)) static void half8_##n(int H, const float *x, int64_t ldx, const uint8_t *blk, \
                                                    int64_t k, __m256 *out) {                      \
        half8(n, H, x, ldx, blk, k, out);                                                          \
    }
KIND(0)
KIND(1)
KIND(2)
KIND(3)
static void (*const halves[4])(int, const float *, int64_t, const uint8_t *, int64_t, __m256 *) = {
    half8_0, half8_1, half8_2, half8_3};

/* 6 rows against both halves of a block: 12 chains, each x broadcast once for two FMAs */
#define BOTH(j, u, v, at)                                                                          \
    {                                                                                              \
        __m256 xv = _mm256_broadcast_ss(x + j * ldx + (at));                                       \
        a##j = _mm256_fmadd_ps(xv, u, a##j);                                                       \
        b##j = _mm256_fmadd_ps(xv, v, b##j);                                                       \
    }
__attribute__((noinline)) static void both6(const float *x, int64_t ldx, const uint8_t *blk, int64_t k, __m256 *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    for (int64_t g = 0; g < k / GROUP; g++) {
        const uint8_t *r = blk + g * REC;
        __m256 d0 = _mm256_loadu_ps((const float *)r), m0 = _mm256_loadu_ps((const float *)r + 16);
        __m256 d1 = _mm256_loadu_ps((const float *)r + 8), m1 = _mm256_loadu_ps((const float *)r + 24);
        for (int i = 0; i < GROUP; i++) {
            __m256 u = rebuilt(r, i, 0, d0, m0), v = rebuilt(r, i, 1, d1, m1);
            int64_t at = g * GROUP + i;
            BOTH(0, u, v, at) BOTH(1, u, v, at) BOTH(2, u, v, at) BOTH(3, u, v, at) BOTH(4, u, v, at)
            BOTH(5, u, v, at)
        }
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5;
    out[6] = b0, out[7] = b1, out[8] = b2, out[9] = b3, out[10] = b4, out[11] = b5;
}

int main(void) {
    const int64_t K = 576, N = 1536, nb = N / 16, groups = K / GROUP, iters = 200;
    float *x = aligned_alloc(64, 8 * K * sizeof(float));
    uint8_t *w = aligned_alloc(64, nb * groups * REC);
    float *y = aligned_alloc(64, 8 * N * sizeof(float));
    for (int64_t i = 0; i < 8 * K; i++)
        x[i] = (float)(i % 7) * 0.01f;
    for (int64_t i = 0; i < nb * groups * REC; i++)
        w[i] = (uint8_t)(i * 37);
    for (int64_t b = 0; b < nb * groups; b++)
        for (int j = 0; j < 16; j++)
            ((float *)(w + b * REC))[j] = 0.01f;
    const char *names[] = {"8 rows, one half a pass (the tile)", "... without the weights' rebuild",
                           "... without the x broadcasts", "... without either", "6 rows, both halves a pass"};
    for (int rep = 0; rep < 3; rep++) {
        for (int kind = 0; kind < 5; kind++) {
            __m256 h[12];
            double t0 = now();
            for (int64_t t = 0; t < iters; t++)
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = w + b * groups * REC;
                    if (kind == 4) {
                        both6(x, K, blk, K, h);
                        for (int j = 0; j < 12; j++)
                            _mm256_storeu_ps(y + (j % 6) * N + b * 16 + 8 * (j / 6), h[j]);
                        continue;
                    }
                    for (int H = 0; H < 2; H++) {
                        halves[kind](H, x, K, blk, K, h);
                        for (int j = 0; j < 8; j++)
                            _mm256_storeu_ps(y + j * N + b * 16 + 8 * H, h[j]);
                    }
                }
            double s = (now() - t0) / iters, rows = kind == 4 ? 6 : 8;
            printf("%-40s %6.1f GFLOP/s\n", names[kind], 2.0 * rows * K * N / s * 1e-9);
        }
    }
    return 0;
}
