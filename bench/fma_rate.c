/* The fp32 multiply-add rate this CPU sustains, measured: each thread runs 12 independent FMA chains on
 * registers, each from its own start (the compiler would merge equal chains into one), more chains than latency x
 * pipes on any x86 core (Zen 2's 5 x 2, Intel's 4 x 2), no memory. What bench/arithmetic_ceiling.py sets the model's
 * arithmetic against, so that a ceiling under a target shows whether the kernels or the cores fall short. Built
 * by it with cc -O2 -fopenmp; never part of the served kernels. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

/* run<W>(iters): 12 chains of `iters` FMAs each on W-bit vectors; every chain feeds the value returned, so none is
 * left out */
#define RUN(W, TARGET, T, SET1, FMA, ADD, FIRST)                                                   \
    __attribute__((target(TARGET))) static float run##W(int64_t iters) {                           \
        T m = SET1(0.999f), c = SET1(1e-3f);                                                       \
        T a0 = SET1(1.0f), a1 = SET1(1.1f), a2 = SET1(1.2f), a3 = SET1(1.3f), a4 = SET1(1.4f),     \
          a5 = SET1(1.5f), a6 = SET1(1.6f), a7 = SET1(1.7f), a8 = SET1(1.8f), a9 = SET1(1.9f),     \
          a10 = SET1(2.0f), a11 = SET1(2.1f);                                                      \
        for (int64_t i = 0; i < iters; i++) {                                                      \
            a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c); a3 = FMA(a3, m, c);        \
            a4 = FMA(a4, m, c); a5 = FMA(a5, m, c); a6 = FMA(a6, m, c); a7 = FMA(a7, m, c);        \
            a8 = FMA(a8, m, c); a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c);    \
        }                                                                                          \
        T s = ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),               \
                  ADD(ADD(a8, a9), ADD(a10, a11)));                                                \
        return FIRST(s);                                                                           \
    }
RUN(256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_cvtss_f32)
RUN(512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_reduce_add_ps)

volatile float fma_rate_sink;

/* GFLOP/s (an FMA: 2) of `threads` threads running `iters` steps of 12 FMAs each, 512-bit where `wide` */
double fma_rate(int threads, int wide, int64_t iters) {
    double t0 = 0.0, t1 = 0.0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp barrier
        #pragma omp master
        t0 = omp_get_wtime();
        float s = wide ? run512(iters) : run256(iters);
        #pragma omp atomic
        fma_rate_sink += s;
        #pragma omp barrier
        #pragma omp master
        t1 = omp_get_wtime();
    }
    return 2.0 * 12 * (wide ? 16 : 8) * (double)iters * threads / (t1 - t0) / 1e9;
}
