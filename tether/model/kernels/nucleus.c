/* Top-p's kept entries of one row of probabilities, as tether/generation/sampler.py's `filtered_probs` finds
 * them: a stable descending sort of the whole row (equal values in index order), its cumulative sum in that
 * order (each addition rounded once, as torch's CPU cumsum adds), and every entry whose sum before it,
 * cum - p, is below top_p. Without sorting the whole row (`nucleus_kept` in sampler.py is the same in torch):
 *
 * 1. the row's mass per bucket of values (a non-negative float64's bits >> 48: exponent and 4 mantissa bits, 16
 *    buckets an octave, in value order), summed from the largest bucket down until it reaches top_p; the floor
 *    is one bucket below that one, for the float noise of these sums (only a guess);
 * 2. the entries at or above the floor are the first of the whole sort, in the same order: sorted (a stable
 *    radix sort of their bits, largest first), their cumulative sum is the whole sort's, bit for bit;
 * 3. if that sum reaches top_p every later entry is dropped (adding non-negative floats never lowers a sum),
 *    else the floor was too high: every positive entry is a candidate.
 *
 * Plain C doubles, each operation rounded once (-ffp-contract=off): the same floats as torch's cumsum and
 * subtraction. Zeros are never kept by the sort's cut (they come last) and never needed: a kept zero adds nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SHIFT 48
#define TOP (1024 << 4)     /* the key of 2.0: probabilities are below it */
#define BUCKETS 2048        /* the top 128 octaves (down to 2^-127); every smaller entry counts in bucket 0 */
#define LANES 4             /* histograms side by side: equal neighbouring keys do not wait on each other */

static inline uint64_t bits_of(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* a thread's buffers, grown as needed and kept */
static __thread double *mass;
static __thread uint64_t *keys, *keys2;
static __thread int64_t *pos, *pos2;
static __thread int64_t room;

static int grow(int64_t n) {
    if (mass == NULL)
        mass = malloc(LANES * BUCKETS * sizeof *mass);
    if (room < n) {
        free(keys), free(keys2), free(pos), free(pos2);
        keys = malloc((size_t)n * sizeof *keys), keys2 = malloc((size_t)n * sizeof *keys2);
        pos = malloc((size_t)n * sizeof *pos), pos2 = malloc((size_t)n * sizeof *pos2);
        room = keys && keys2 && pos && pos2 ? n : 0;
    }
    return mass != NULL && room >= n;
}

/* keys[0..c) ascending, stable (equal keys keep their order), pos carried along: LSD radix, 8 bits a pass,
 * a pass skipped where every key has the same digit */
static void radix_sort(int64_t c) {
    int64_t count[256];
    for (int shift = 0; shift < 64; shift += 8) {
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < c; i++)
            count[(keys[i] >> shift) & 255]++;
        if (count[(keys[0] >> shift) & 255] == c)
            continue;
        int64_t at = 0;
        for (int d = 0; d < 256; d++) {
            int64_t k = count[d];
            count[d] = at;
            at += k;
        }
        for (int64_t i = 0; i < c; i++) {
            int64_t j = count[(keys[i] >> shift) & 255]++;
            keys2[j] = keys[i], pos2[j] = pos[i];
        }
        uint64_t *tk = keys;
        keys = keys2, keys2 = tk;
        int64_t *tp = pos;
        pos = pos2, pos2 = tp;
    }
}

/* the candidates at or above `floor` (ascending index into out), sorted largest first into keys/pos; returns
 * the kept count written to out (ascending), or -1 when their sum stays below top_p */
static int64_t cut(const double *p, int64_t n, double top_p, uint64_t floor, int64_t *out) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t b = bits_of(p[i]);
        if (b >= floor && p[i] > 0) {
            out[c] = i;
            keys[c] = ~b;   /* ascending ~bits: largest value first */
            pos[c] = c;
            c++;
        }
    }
    if (c == 0)
        return floor <= 1 ? 0 : -1;
    radix_sort(c);
    /* keep flags by candidate position, reusing keys2 (the sort is done with it) */
    uint8_t *keep = (uint8_t *)keys2;
    memset(keep, 0, (size_t)c);
    double cum = 0.0;
    for (int64_t j = 0; j < c; j++) {
        double v = p[out[pos[j]]];
        cum = cum + v;
        keep[pos[j]] = (cum - v) < top_p;
    }
    if (cum < top_p && floor > 1)
        return -1;
    int64_t kept = 0;
    for (int64_t j = 0; j < c; j++)
        if (keep[j])
            out[kept++] = out[j];
    return kept;
}

/* probs[n] (>= 0), 0 < top_p < 1: the kept indices, ascending, into out (room for n); their count, or -1 where
 * the buffers could not be had (the caller falls back) */
int64_t nucleus_keep(const double *probs, int64_t n, double top_p, int64_t *out) {
    if (n <= 0 || !grow(n))
        return -1;
    memset(mass, 0, LANES * BUCKETS * sizeof *mass);
    for (int64_t i = 0; i < n; i++) {
        /* NaN, infinities and -0.0 (none from a softmax of finite logits) land in the end buckets, never past them */
        int64_t key = (int64_t)(bits_of(probs[i]) >> SHIFT) - (TOP - BUCKETS);
        key = key < 0 ? 0 : key >= BUCKETS ? BUCKETS - 1 : key;
        mass[(i % LANES) * BUCKETS + key] += probs[i];
    }
    double acc = 0.0;
    int64_t b = BUCKETS - 1;
    for (; b > 0; b--) {
        for (int l = 0; l < LANES; l++)
            acc += mass[l * BUCKETS + b];
        if (acc >= top_p)
            break;
    }
    /* 1: every positive entry (the smallest bits) */
    uint64_t floor = b > 1 ? (uint64_t)(b - 1 + TOP - BUCKETS) << SHIFT : 1;
    int64_t kept = cut(probs, n, top_p, floor, out);
    if (kept < 0)
        kept = cut(probs, n, top_p, 1, out);
    return kept;
}
