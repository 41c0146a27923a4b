/* Greedy decoding's token for a micro-batch's rows at once: each row's first maximum, as torch.argmax of one row
 * picks it (a NaN counts as larger than every number, so the first NaN where there is one), without gathering
 * the rows into a new tensor first (torch's indexing copies element by element). Only comparisons, no
 * arithmetic: nothing rounds. Two passes over the row: its largest value (and whether it holds a NaN) 8 lanes
 * at a time, then the first entry equal to it (+0 and -0 are equal, as they are to torch's comparison).
 */
#include <immintrin.h>
#include <stdint.h>

static int64_t first_nan(const float *r, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (r[j] != r[j])
            return j;
    return -1;
}

static int64_t first_maximum(const float *r, int64_t n) {
    int64_t j = 0, tail = n - n % 8;
    float best = r[0];
    if (tail > 0) {
        __m256 m = _mm256_loadu_ps(r), nan = _mm256_setzero_ps();
        for (j = 0; j < tail; j += 8) {
            __m256 v = _mm256_loadu_ps(r + j);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m = _mm256_max_ps(m, v);
        }
        if (_mm256_movemask_ps(nan))
            return first_nan(r, n);
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int i = 0; i < 8; i++)
            best = lanes[i] > best ? lanes[i] : best;
    }
    for (; j < n; j++) {
        if (r[j] != r[j])
            return first_nan(r, n);
        best = r[j] > best ? r[j] : best;
    }
    __m256 b = _mm256_set1_ps(best);
    for (j = 0; j < tail; j += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + j), b, _CMP_EQ_OQ));
        if (hit)
            return j + __builtin_ctz((unsigned)hit);
    }
    for (; j < n; j++)
        if (r[j] == best)
            return j;
    return 0;   /* not reached: the maximum is one of the entries */
}

/* out[i] = the first maximum of row rows[i] of x (n entries a row, row stride ld) */
void rows_argmax(const float *x, int64_t n, int64_t ld, const int64_t *rows, int64_t count, int64_t *out) {
    for (int64_t i = 0; i < count; i++)
        out[i] = n > 0 ? first_maximum(x + rows[i] * ld, n) : 0;
}
