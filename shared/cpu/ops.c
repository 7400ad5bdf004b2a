/* The CPU's per-layer ops besides the matmuls, each one call from Python: RMSNorm (with the
   residual add before it), the gated activations, RoPE with the KV write, and attention over the
   paged cache a query row at a time. float32 activations; the cache float32 or float16.

   Attention computes each query row on its own, over the keys it sees, the same way whatever
   the number of rows in its sequence's step: a verified draft's rows give the logits plain
   decoding gives, bit for bit (paged_attention_ref's promise). Over a float16 cache q and the
   probabilities are rounded to float16 as the reference rounds them (which computes prompt
   chunks of more rows): a prompt's tokens then see nearly the same values whichever path ran
   them (a prefix-cache hit, a restored context, another chunking). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float dot(const float* a, const float* b, int n) {
    int i = 0;
    float s = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc2);
    }
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    acc = _mm256_add_ps(acc, acc2);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    s = _mm_cvtss_f32(v);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ---- norms and activations ---- */

/* out = x * rsqrt(mean(x^2) + eps) * w, rows of d; with residual (not NULL): x + residual first,
   the sum stored to sum_out */
void skiff_add_rms_norm(const float* x, const float* residual, const float* w, float eps,
                        int rows, int d, float* out, float* sum_out) {
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (size_t)r * d;
        float* o = out + (size_t)r * d;
        const float* src = xr;
        if (residual != NULL) {
            float* s = sum_out + (size_t)r * d;
            const float* res = residual + (size_t)r * d;
            for (int i = 0; i < d; i++) s[i] = xr[i] + res[i];
            src = s;
        }
        float ss = dot(src, src, d);
        float scale = 1.0f / sqrtf(ss / (float)d + eps);
        for (int i = 0; i < d; i++) o[i] = src[i] * scale * w[i];
    }
}

/* out[r, i] = act(gate[r, i]) * up[r, i]; gelu: the tanh approximation, else SiLU. Row strides
   in elements (gate and up may be halves of one [rows, 2n] product). */
void skiff_gated_act(const float* gate, const float* up, long stride, int rows, int n, int gelu,
                     float* out) {
#pragma omp parallel for schedule(static) if ((long)rows * n > 65536)
    for (int r = 0; r < rows; r++) {
        const float* g = gate + (size_t)r * stride;
        const float* u = up + (size_t)r * stride;
        float* o = out + (size_t)r * n;
        for (int i = 0; i < n; i++) {
            float a = g[i];
            if (gelu) {
                float t = tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a));
                o[i] = 0.5f * a * (1.0f + t) * u[i];
            } else {
                o[i] = a / (1.0f + expf(-a)) * u[i];
            }
        }
    }
}

/* ---- RoPE and the KV write ---- */

static void rotate(float* x, int rope_dim, int neox, const float* c, const float* s) {
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        float a = x[ia], b = x[ib];
        x[ia] = a * c[i] - b * s[i];
        x[ib] = a * s[i] + b * c[i];
    }
}

/* q [t, hq, d] and k [t, hk, d] rotated in place at positions (inv_freq: rope_dim / 2 angles
   per position unit, factors and base applied; scale divides the position); then k and v
   [t, hk, d] written to the caches' rows slots[t] ([rows, hk, d], float32 or float16 by
   half_cache). k, v may be NULL (nothing written). */
void skiff_rope_kv(float* q, float* k, const float* v, const int64_t* positions, int t, int hq,
                   int hk, int d, int rope_dim, const float* inv_freq, float scale, int neox,
                   void* k_cache, void* v_cache, const int64_t* slots, int half_cache) {
#pragma omp parallel for schedule(static) if (t > 8)
    for (int i = 0; i < t; i++) {
        float c[512], s[512];
        float p = (float)positions[i] / scale;
        for (int j = 0; j < rope_dim / 2; j++) {
            float theta = p * inv_freq[j];
            c[j] = cosf(theta);
            s[j] = sinf(theta);
        }
        for (int h = 0; h < hq; h++) rotate(q + ((size_t)i * hq + h) * d, rope_dim, neox, c, s);
        if (k == NULL) continue;
        for (int h = 0; h < hk; h++) rotate(k + ((size_t)i * hk + h) * d, rope_dim, neox, c, s);
        if (k_cache == NULL) continue;
        size_t row = (size_t)slots[i] * hk * d, n = (size_t)hk * d;
        const float* kr = k + (size_t)i * n;
        const float* vr = v + (size_t)i * n;
        if (half_cache) {
            uint16_t* kc = (uint16_t*)k_cache + row;
            uint16_t* vc = (uint16_t*)v_cache + row;
            for (size_t j = 0; j < n; j++) {
                kc[j] = float_to_half(kr[j]);
                vc[j] = float_to_half(vr[j]);
            }
        } else {
            memcpy((float*)k_cache + row, kr, n * sizeof(float));
            memcpy((float*)v_cache + row, vr, n * sizeof(float));
        }
    }
}

/* ---- attention over the paged cache, a query row at a time ---- */

static inline void load_row(const void* src, int half, int d, float* dst) {
    if (!half) {
        memcpy(dst, src, (size_t)d * sizeof(float));
        return;
    }
    const uint16_t* h = src;
    int i = 0;
#ifdef __F16C__
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
    for (; i < d; i++) dst[i] = half_to_float(h[i]);
}

#define ATT_ROWS 8 /* query rows of one sequence a task attends together */

#define INLINE static inline __attribute__((always_inline))

/* one query head's output over keys start .. keys of a sequence: scores (4 keys at a time,
   independent sums), softmax, then the values summed into D / 8 accumulators held in
   registers where D is a constant (64, 128: inlined below) */
INLINE void attend(const int D, const float* qh, const void* k_cache, const void* v_cache,
                   int half, const int32_t* table, int block_size, size_t head_at,
                   size_t key_step, int start, int keys, float scale, float* scores, float* buf,
                   float* o) {
    const int d = D;
    int nk = keys - start;
    float mx = -INFINITY;
    for (int t = start; t < keys;) {
        int blk = t / block_size, off = t % block_size;
        int stop = (blk + 1) * block_size < keys ? (blk + 1) * block_size : keys;
        size_t base = ((size_t)table[blk] * block_size + off) * key_step + head_at;
        for (; t < stop; t++, base += key_step) {
            const float* kr = (const float*)k_cache + base;
            if (half) {
                load_row((const uint16_t*)k_cache + base, 1, d, buf);
                kr = buf;
            }
            float sc = dot(qh, kr, d) * scale;
            scores[t - start] = sc;
            mx = sc > mx ? sc : mx;
        }
    }
    float sum = 0.0f;
    for (int t = 0; t < nk; t++) {
        scores[t] = expf(scores[t] - mx);
        sum += scores[t];
    }
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (half) { /* the probabilities rounded to float16, as the reference does */
        for (int t = 0; t < nk; t++) scores[t] = half_to_float(float_to_half(scores[t] / sum));
        inv = 1.0f;
    }
#ifdef __AVX2__
    if (d % 8 == 0 && d <= 128) {
        __m256 acc[16];
        for (int c = 0; c < d / 8; c++) acc[c] = _mm256_setzero_ps();
        for (int t = start; t < keys;) {
            int blk = t / block_size, off = t % block_size;
            int stop = (blk + 1) * block_size < keys ? (blk + 1) * block_size : keys;
            size_t base = ((size_t)table[blk] * block_size + off) * key_step + head_at;
            for (; t < stop; t++, base += key_step) {
                __m256 p = _mm256_set1_ps(scores[t - start]);
                if (half) {
                    const uint16_t* vr = (const uint16_t*)v_cache + base;
                    for (int c = 0; c < d / 8; c++)
                        acc[c] = _mm256_fmadd_ps(
                            p, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(vr + 8 * c))), acc[c]);
                } else {
                    const float* vr = (const float*)v_cache + base;
                    for (int c = 0; c < d / 8; c++)
                        acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
                }
            }
        }
        __m256 iv = _mm256_set1_ps(inv);
        for (int c = 0; c < d / 8; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], iv));
        return;
    }
#endif
    float* acc = buf + d;
    memset(acc, 0, sizeof(float) * d);
    for (int t = start; t < keys;) {
        int blk = t / block_size, off = t % block_size;
        int stop = (blk + 1) * block_size < keys ? (blk + 1) * block_size : keys;
        size_t base = ((size_t)table[blk] * block_size + off) * key_step + head_at;
        for (; t < stop; t++, base += key_step) {
            const float* vf = (const float*)v_cache + base;
            if (half) {
                load_row((const uint16_t*)v_cache + base, 1, d, buf);
                vf = buf;
            }
            float p = scores[t - start];
            for (int e = 0; e < d; e++) acc[e] += p * vf[e];
        }
    }
    for (int e = 0; e < d; e++) o[e] = acc[e] * inv;
}

/* out rows j0 .. j1 of sequence b's step (its rows start at `row0` of q and out; nq of them,
   the last nq of its n_keys keys) for query heads h0 .. h1, all of KV head g: one (row, head)
   after another, each by attend() alone (so the result does not depend on the rows and heads
   beside it), the later ones finding the keys and values in cache. */
static void attend_block(const float* q, const void* k_cache, const void* v_cache, int half,
                         const int32_t* table, int block_size, int hq, int hk, int d, int g,
                         int h0, int h1, int nq, int n_keys, int row0, int j0, int j1,
                         float scale, int window, float* out) {
    float* buf = malloc(sizeof(float) * ((size_t)n_keys + 3 * (size_t)d + 1));
    float *work = buf + n_keys + 1, *qr = work + 2 * d;
    size_t head_at = (size_t)g * d, key_step = (size_t)hk * d;
    for (int j = j0; j < j1; j++) {
        int keys = n_keys - nq + 1 + j, start = window && keys > window ? keys - window : 0;
        for (int h = h0; h < h1; h++) {
            const float* qh = q + ((size_t)(row0 + j) * hq + h) * d;
            if (half) { /* q rounded to float16, as the reference does */
                for (int e = 0; e < d; e++) qr[e] = half_to_float(float_to_half(qh[e]));
                qh = qr;
            }
            float* o = out + ((size_t)(row0 + j) * hq + h) * d;
            if (d == 64)
                attend(64, qh, k_cache, v_cache, half, table, block_size, head_at, key_step,
                       start, keys, scale, buf, work, o);
            else if (d == 128)
                attend(128, qh, k_cache, v_cache, half, table, block_size, head_at, key_step,
                       start, keys, scale, buf, work, o);
            else
                attend(d, qh, k_cache, v_cache, half, table, block_size, head_at, key_step,
                       start, keys, scale, buf, work, o);
        }
    }
    free(buf);
}

/* out [T, hq, d]: every row of the step; q [T, hq, d] rotated. Sequence b's queries are rows
   qstart[b] .. qstart[b + 1], the last of its seq_lens[b] keys; block_tables [B, width].
   Tasks: a sequence's blocks of ATT_ROWS rows by KV head, by query head too where that alone
   would leave threads idle (a decode step of few sequences). */
void skiff_attention(const float* q, const void* k_cache, const void* v_cache, int half_cache,
                     const int32_t* block_tables, int width, const int32_t* qstart,
                     const int32_t* seq_lens, int n_seqs, int hq, int hk, int d, int block_size,
                     float scale, int window, float* out) {
    int group = hq / hk, blocks = 0;
    for (int b = 0; b < n_seqs; b++) blocks += (qstart[b + 1] - qstart[b] + ATT_ROWS - 1) / ATT_ROWS;
    int split = (long)blocks * hk < 2L * omp_get_max_threads() ? group : 1; /* head parts */
    int* seq_of = malloc(sizeof(int) * (blocks > 0 ? blocks : 1));
    int* block_of = malloc(sizeof(int) * (blocks > 0 ? blocks : 1));
    for (int b = 0, k = 0; b < n_seqs; b++)
        for (int j = 0; j < qstart[b + 1] - qstart[b]; j += ATT_ROWS, k++) {
            seq_of[k] = b;
            block_of[k] = j;
        }
    long tasks = (long)blocks * hk * split;
#pragma omp parallel for schedule(dynamic, 1)
    for (long task = 0; task < tasks; task++) {
        int k = (int)(task / ((long)hk * split)), rest = (int)(task % ((long)hk * split));
        int g = rest / split, part = rest % split, b = seq_of[k], j0 = block_of[k];
        int nq = qstart[b + 1] - qstart[b], j1 = j0 + ATT_ROWS < nq ? j0 + ATT_ROWS : nq;
        int per = group / split, h0 = g * group + part * per;
        attend_block(q, k_cache, v_cache, half_cache, block_tables + (size_t)b * width,
                     block_size, hq, hk, d, g, h0, h0 + per, nq, seq_lens[b], qstart[b], j0, j1,
                     scale, window, out);
    }
    free(seq_of);
    free(block_of);
}
