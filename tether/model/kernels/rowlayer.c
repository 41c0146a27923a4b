/* Decoder layers of a Llama-architecture slice, all of a step's layers in one call: RMSNorm, the q/k/v
 * projections, RoPE, the new keys and values stored in the paged arena, attention, the output projection and
 * residual, RMSNorm, the gated MLP and residual (tether/model/rowlayer.py says where it serves).
 *
 * Why one call: a step through torch's modules runs ~40 small ATen ops and 7 kernel calls a layer, each its
 * own dispatch and, on more than one thread, its own OpenMP fork and join; at one row that glue cost about as
 * much as the linears (smollm2 on an AMD EPYC without AVX-512, docs/PERFORMANCE.md). Here the threads enter
 * once per step and meet at a barrier between the phases of a layer.
 *
 * Batch-invariant by construction, like the kernels it calls: every element is computed by one fixed sequence
 * of operations, whatever the rows beside it and whichever thread runs it. The linears are rowdot's column
 * blocks (the threads take chunks of each weight's blocks), attention is rowattn's row (the threads take the
 * (row, head) pairs), and the rest is per row or per element:
 *   RMSNorm   r = 1 / sqrt(sum(x^2) / n + eps), the sum in 8 lanes (lane j: x[j]^2, x[j+8]^2, ... as one FMA
 *             chain) then rowattn's fixed tree; y = w * (x * r), Hugging Face's order
 *   RoPE      q[i] * cos[i] + (-q[i + d/2]) * sin[i] (first half), q[i] * cos[i] + q[i - d/2] * sin[i] (second):
 *             two products and a sum, as torch's q * cos + rotate_half(q) * sin rounds them
 *   residual  x + y;  MLP  silu(gate) * up
 *
 * Built with -mavx2 -mfma -mf16c -ffp-contract=off, like rowdot.c.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "rows.h"
#include "vecmath.h"

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, block;
    float eps, scale;
} layer_shape;

typedef struct {
    const float *ln1, *ln2;                              /* the two RMSNorm weights [hidden] */
    packed_weight wq, wk, wv, wo, wg, wu, wd;            /* projections: rowdot's or rowquant's blocks */
    const float *bq, *bk, *bv;                           /* q/k/v biases (Qwen2), or NULL */
} layer_weights;

/* floats of work space `rowlayers` needs for m rows */
int64_t rowlayer_work(const layer_shape *s, int64_t m) {
    int64_t qd = s->heads * s->head_dim, kd = s->kv_heads * s->head_dim;
    return m * (2 * s->hidden + 2 * qd + 2 * kd + 2 * s->inter);
}

/* hidden % 8 == 0 (rowlayer.py checks) */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *out) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

/* the final norm before the head (rowlayer.py) */
void rownorm(const float *x, const float *w, int64_t m, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < m; r++)
        rms_row(x + r * n, w, n, eps, out + r * n);
}

/* d <= 256 and even (rowattn's bound) */
static void rope(float *v, const float *cos, const float *sin, int64_t d) {
    float t[256];
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++)
        t[i] = v[i] * cos[i] + (-v[i + h]) * sin[i];
    for (int64_t i = h; i < d; i++)
        t[i] = v[i] * cos[i] + v[i - h] * sin[i];
    memcpy(v, t, (size_t)d * sizeof(float));
}

/* A projection's column blocks in chunks of its tiles' unit (chunk_unit), taken first come first served by the
 * team's threads: OpenMP's guided schedule, whose first chunks are about a fixed share long (a thread still streams
 * contiguous weights) and whose last are a unit each. On cores shared with the other services a thread can lose its
 * core mid-phase; with fixed shares the whole team then waited at the next barrier until it got it back (smollm2
 * served at 8 streams, Xeon, one cluster at a time: 1.05-1.14x the output tokens/s of fixed shares, 1 stream
 * 0.98-1.11x; in one process alone, even at 1-8 rows, 1.05x at 32). Which thread computes a block never changes
 * its bits. */
typedef struct {
    const float *x;
    int64_t k, n, m, unit, chunks;
    const packed_weight *w;
    const float *bias;
    float *y;
    int act;
} projection;

static projection part(const float *x, int64_t k, const packed_weight *w, const float *bias, float *y, int64_t n,
                       int64_t m, int act, int64_t team) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, unit = chunk_unit(w->format, m, blocks, team);
    projection p = {x, k, n, m, unit, (blocks + unit - 1) / unit, w, bias, y, act};
    return p;
}

/* gate and up in the same chunks (their product is taken chunk by chunk): the larger of their units */
static void same_chunks(projection *a, projection *b) {
    int64_t unit = a->unit > b->unit ? a->unit : b->unit, blocks = (a->n + BLOCK - 1) / BLOCK;
    a->unit = b->unit = unit;
    a->chunks = b->chunks = (blocks + unit - 1) / unit;
}

/* chunk c of p: its blocks (and bias), the columns [*c0, *c1) it wrote */
static void chunk(const projection *p, int64_t c, int64_t *c0, int64_t *c1) {
    int64_t blocks = (p->n + BLOCK - 1) / BLOCK, b0 = c * p->unit;
    int64_t b1 = b0 + p->unit < blocks ? b0 + p->unit : blocks;
    weight_blocks(p->x, p->k, p->w, p->k, p->y, p->n, p->n, p->m, b0, b1, p->act);
    *c0 = b0 * BLOCK;
    *c1 = b1 * BLOCK < p->n ? b1 * BLOCK : p->n;
    if (p->bias != NULL)
        for (int64_t r = 0; r < p->m; r++)
            for (int64_t c = *c0; c < *c1; c++)
                p->y[r * p->n + c] = p->y[r * p->n + c] + p->bias[c];
}

/* every chunk of p, the team's threads taking them in turn (no barrier after: the caller places it) */
static void project(const projection *p) {
    int64_t c0, c1;
    #pragma omp for schedule(guided) nowait
    for (int64_t c = 0; c < p->chunks; c++)
        chunk(p, c, &c0, &c1);
}

/* the same, each chunk's columns then added to the residual x (x + y, per element, as torch adds them) */
static void project_residual(const projection *p, float *x) {
    int64_t c0, c1;
    #pragma omp for schedule(guided) nowait
    for (int64_t c = 0; c < p->chunks; c++) {
        chunk(p, c, &c0, &c1);
        for (int64_t r = 0; r < p->m; r++)
            for (int64_t j = c0; j < c1; j++)
                x[r * p->n + j] = x[r * p->n + j] + p->y[r * p->n + j];
    }
}

static void layer(const layer_shape *s, const layer_weights *w, float *kc, float *vc, float *x, int64_t m,
                  const float *cos, const float *sin, const int64_t *write_rows, const int64_t *pos,
                  const int64_t *first, const int64_t *tables, float *work, float *scores, int64_t t,
                  int64_t team) {
    int64_t H = s->hidden, d = s->head_dim, I = s->inter, heads = s->heads, kvh = s->kv_heads;
    int64_t qd = heads * d, kd = kvh * d, group = heads / kvh, c0, c1;
    float *h = work, *q = h + m * H, *k = q + m * qd, *v = k + m * kd, *a = v + m * kd, *o = a + m * qd;
    float *g = o + m * H, *u = g + m * I;

    for (int64_t r = t; r < m; r += team)
        rms_row(x + r * H, w->ln1, H, s->eps, h + r * H);
    #pragma omp barrier
    {   /* q, k and v one after the other, no barrier between: a thread done with q's chunks takes k's */
        projection pq = part(h, H, &w->wq, w->bq, q, qd, m, 0, team);
        projection pk = part(h, H, &w->wk, w->bk, k, kd, m, 0, team);
        projection pv = part(h, H, &w->wv, w->bv, v, kd, m, 0, team);
        project(&pq);
        project(&pk);
        project(&pv);
    }
    #pragma omp barrier
    for (int64_t r = t; r < m; r += team) {
        for (int64_t j = 0; j < heads; j++)
            rope(q + r * qd + j * d, cos + r * d, sin + r * d, d);
        for (int64_t j = 0; j < kvh; j++) {
            rope(k + r * kd + j * d, cos + r * d, sin + r * d, d);
            memcpy(kc + write_rows[r * kvh + j] * d, k + r * kd + j * d, (size_t)d * sizeof(float));
            memcpy(vc + write_rows[r * kvh + j] * d, v + r * kd + j * d, (size_t)d * sizeof(float));
        }
    }
    #pragma omp barrier   /* every new key stored before any row reads its request's keys */
    #pragma omp for schedule(guided) nowait
    for (int64_t i = 0; i < m * heads; i++) {
        int64_t r = i / heads;
        rowattn_row(q + i * d, kc, vc, tables + first[r], pos[r], (i % heads) / group, kvh, d, s->block,
                    s->scale, scores, a + i * d);
    }
    #pragma omp barrier
    {
        projection po = part(a, qd, &w->wo, NULL, o, H, m, 0, team);
        project_residual(&po, x);
    }
    #pragma omp barrier
    for (int64_t r = t; r < m; r += team)
        rms_row(x + r * H, w->ln2, H, s->eps, h + r * H);
    #pragma omp barrier
    {
        projection pg = part(h, H, &w->wg, NULL, g, I, m, 1, team), pu = part(h, H, &w->wu, NULL, u, I, m, 0, team);
        same_chunks(&pg, &pu);
        #pragma omp for schedule(guided) nowait
        for (int64_t c = 0; c < pg.chunks; c++) {
            int64_t e0, e1;
            chunk(&pg, c, &c0, &c1);
            chunk(&pu, c, &e0, &e1);
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = c0; j < c1; j++)
                    g[r * I + j] = g[r * I + j] * u[r * I + j];
        }
    }
    #pragma omp barrier
    {
        projection pd = part(g, I, &w->wd, NULL, o, H, m, 0, team);
        project_residual(&pd, x);
    }
    #pragma omp barrier   /* the next layer's norm reads whole rows */
}

/* x [m][hidden] (in place) through `layers` layers; kc[l], vc[l]: layer l's arena [blocks][kv_heads][block][d];
 * row r at position pos[r] (cos, sin: [m][d] its rotary values) stores its keys at the arena's flat rows
 * write_rows[r * kv_heads ...] and reads blocks tables[first[r]:]; work: rowlayer_work floats; scores:
 * `threads` rows of `stride` floats. On `threads` threads (torch's libgomp pool, as rowdot). */
void rowlayers(const layer_shape *s, const layer_weights *w, int64_t layers, float *const *kc, float *const *vc,
               float *x, int64_t m, const float *cos, const float *sin, const int64_t *write_rows,
               const int64_t *pos, const int64_t *first, const int64_t *tables, float *work, float *scores,
               int64_t stride, int threads) {
    if (threads <= 1) {
        for (int64_t l = 0; l < layers; l++)
            layer(s, w + l, kc[l], vc[l], x, m, cos, sin, write_rows, pos, first, tables, work, scores, 0, 1);
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t l = 0; l < layers; l++)
            layer(s, w + l, kc[l], vc[l], x, m, cos, sin, write_rows, pos, first, tables, work,
                  scores + t * stride, t, team);
    }
}
