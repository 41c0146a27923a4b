/* One drawn row's temperature and top-k, as sampler._kept_rows takes them in torch, in two passes over the row:
 * x = logit / T in float64 (a cast and an IEEE division: the doubles torch's `logits.double() / T` gives), and
 * with 0 < k < n every x below the x of the k-th largest logit set to -inf, the indices of the others listed in
 * ascending order. torch spent four passes (topk, the comparison, masked_fill, nonzero) and a fresh float64 row
 * on it: ~0.35 ms a top-k row of smollm2's 49,152 against ~0.10 here.
 *
 * The k-th largest logit is selected by its bits, as torch.topk orders the values: each float's sign-flipped bits
 * order like the float, a NaN counts as larger than every number (topk's order, so a NaN k-th largest keeps
 * every entry: nothing compares below NaN), and -0 sorts just below +0, which is harmless: both give the same
 * comparison against every x. The selection narrows 11, 11 and 10 bits at a time: a histogram over the row,
 * then over the entries in the chosen bucket only, which it gathers into `kept` first (free until the last pass).
 * Only comparisons, casts and the division: nothing rounds otherwise, so the row's values are torch's.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* without branches: a row's signs come in no order, and a mispredicted branch an entry cost more than the rest */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    /* negative floats reversed, below the positive */
    uint32_t key = u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
    return (u & 0x7fffffffu) > 0x7f800000u ? UINT32_MAX : key;   /* NaN: above every number, as torch.topk */
}

static inline float key_value(uint32_t key) {
    uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* the bucket of `hist` (counts by bucket, ascending) holding the `*need`-th largest entry; `*need` becomes its
 * rank within that bucket */
static int32_t bucket_of(const int64_t *hist, int32_t buckets, int64_t *need) {
    for (int32_t b = buckets - 1; b >= 0; b--) {
        if (hist[b] >= *need)
            return b;
        *need -= hist[b];
    }
    return 0;   /* not reached: the counts add up to at least need */
}

/* the bits of the k-th largest entry of logits[0..n), 0 < k <= n; scratch: n int64s */
static uint32_t kth_largest_key(const float *logits, int64_t n, int64_t k, int64_t *scratch) {
    static const int shift[3] = {21, 10, 0};
    static const int32_t buckets[3] = {2048, 2048, 1024};
    int64_t hist[2048];
    uint32_t *keys = (uint32_t *)scratch;   /* the chosen bucket's keys, gathered */
    int64_t need = k, m = 0;
    uint32_t prefix = 0;

    /* four histograms, summed after: a row's keys crowd into a few buckets (their exponents), and one count
     * incremented back to back waits on its own store each time */
    uint32_t part[4][2048];
    memset(part, 0, sizeof part);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++)
            part[j][order_key(logits[i + j]) >> shift[0]]++;
    for (; i < n; i++)
        part[0][order_key(logits[i]) >> shift[0]]++;
    for (int32_t h = 0; h < buckets[0]; h++)
        hist[h] = (int64_t)part[0][h] + part[1][h] + part[2][h] + part[3][h];
    uint32_t b = (uint32_t)bucket_of(hist, buckets[0], &need);
    prefix = b << shift[0];
    for (i = 0; i < n; i++) {
        uint32_t key = order_key(logits[i]);
        if ((key >> shift[0]) == b)
            keys[m++] = key;
    }
    for (int level = 1; level < 3; level++) {
        uint32_t mask = (uint32_t)buckets[level] - 1;
        memset(hist, 0, sizeof(int64_t) * (size_t)buckets[level]);
        for (i = 0; i < m; i++)
            hist[(keys[i] >> shift[level]) & mask]++;
        b = (uint32_t)bucket_of(hist, buckets[level], &need);
        prefix |= b << shift[level];
        int64_t kept = 0;
        for (i = 0; i < m; i++)
            if (((keys[i] >> shift[level]) & mask) == b)
                keys[kept++] = keys[i];
        m = kept;
    }
    return prefix;
}

/* x[0..n) = (double)logits[i] / t; with 0 < k < n, every x below the k-th largest logit's x set to -inf and the
 * indices of the others written to kept (ascending). Returns how many are kept: n (and kept untouched) when k is
 * 0 or at least n. */
int64_t temper_top_k(const float *logits, int64_t n, double t, int64_t k, double *x, int64_t *kept) {
    if (k <= 0 || k >= n) {
        for (int64_t i = 0; i < n; i++)
            x[i] = (double)logits[i] / t;
        return n;
    }
    uint32_t key = kth_largest_key(logits, n, k, kept);
    /* a NaN k-th largest: the floor NaN, below which nothing compares, as torch's x < NaN */
    double floor = key == UINT32_MAX ? (double)__builtin_nanf("") : (double)key_value(key) / t;
    /* four at a time: each lane's cast and division are the scalar ones (IEEE), the comparison ordered (a NaN x
     * is never below the floor, as torch's `<`) */
    const __m256d tv = _mm256_set1_pd(t), fv = _mm256_set1_pd(floor), low = _mm256_set1_pd(-__builtin_inf());
    int64_t m = 0, i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(logits + i)), tv);
        __m256d below = _mm256_cmp_pd(v, fv, _CMP_LT_OQ);
        _mm256_storeu_pd(x + i, _mm256_blendv_pd(v, low, below));
        unsigned keep = ~(unsigned)_mm256_movemask_pd(below) & 0xfu;
        while (keep) {
            kept[m++] = i + __builtin_ctz(keep);
            keep &= keep - 1;
        }
    }
    for (; i < n; i++) {
        double v = (double)logits[i] / t;
        if (v < floor) {
            x[i] = -__builtin_inf();
        } else {
            x[i] = v;
            kept[m++] = i;
        }
    }
    return m;
}
