/* llama.cpp's Q4_1 x Q8_1 dot product in AVX2 (bench/compute_ceiling.py builds and times it): per block of 32, the
 * weights' 4-bit values (unsigned) times the activations' 8-bit values (signed) by maddubs, pairs summed by madd,
 * converted and scaled by both blocks' scales; `rows` activation rows share each weight block's unpacking.
 * What one core of this CPU does with integers, against rowdot's fp32 chains on the same shapes. */
#include <immintrin.h>
#include <stdint.h>

#define MAX_ROWS 16

/* returns -1 (nothing computed) for more than MAX_ROWS rows: one accumulator a row, on the stack */
int q4q8_dot(const uint8_t *wq, const float *wd, const int8_t *aq, const float *ad, int64_t blocks,
             int64_t outputs, int64_t rows, float *y) {
    if (rows < 1 || rows > MAX_ROWS)
        return -1;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    for (int64_t o = 0; o < outputs; o++) {
        __m256 acc[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++)
            acc[r] = _mm256_setzero_ps();
        const uint8_t *w = wq + o * blocks * 16;
        for (int64_t b = 0; b < blocks; b++) {
            __m128i p = _mm_loadu_si128((const __m128i *)(w + b * 16));
            __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low);
            float d = wd[o * blocks + b];
            for (int64_t r = 0; r < rows; r++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(aq + (r * blocks + b) * 32));
                __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * ad[r * blocks + b]), _mm256_cvtepi32_ps(s), acc[r]);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            float t[8];
            _mm256_storeu_ps(t, acc[r]);
            y[o * rows + r] = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
        }
    }
    return 0;
}
