/* Vector math our kernels share (rowdot.c, rowquant.c, rowattn.c, rowlayer.c): the same instructions for every element, so an
 * element's result never depends on where it sits in a tensor or which thread computes it. */
#ifndef TETHER_VECMATH_H
#define TETHER_VECMATH_H
#include <immintrin.h>

/* exp(x), Cephes' polynomial (within 2 ulp of expf), inputs clamped to [-87, 88]: below -87 gives exp(-87), a
 * normal float, as the tiles clamp. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* The 8 lanes summed as ((0+4)+(2+6)) + ((1+5)+(3+7)): one tree, whatever the vector held. */
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                       /* 0+4, 1+5, 2+6, 3+7 */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));       /* (0+4)+(2+6), (1+5)+(3+7) */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* silu(x) = x / (1 + exp(-x)), element by element: fused here so that no ATen loop (whose scalar tails
 * follow the tensor's size and the threads' chunks) touches the gate's outputs. */
static inline __m256 silu8(__m256 x) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

#endif
