/* Quantized matmuls on the CPU over GGUF's own blocks (no repack, no float copy).

   y[m, n] = sum_k x[m, k] * w[n, k], with w the GGUF rows of one type and x float32. The
   activations are rounded to int8 per group of 32 (one float scale a group, and the codes'
   sums per 16 for the weights' offsets), as llama.cpp's vec_dot does; the weights' codes meet
   them as unsigned bytes (or signed, for Q8_0) in integer dot products, and each group's sum
   is scaled in float32:

       dot(group) = wscale * xscale * sum(code * xq) + woffset * xscale * sum(xq)

   with wscale / woffset per 32 (legacy types, Q4_K, Q5_K) or per 16 (Q6_K). AVX2 where the
   compiler targets it, else plain C that the compiler vectorizes as it can; the threads are
   OpenMP's (torch's own runtime, which the process has loaded first: same soname).

   The K-quants' activations are rounded per 256 instead (llama.cpp's q8_K): a super-block's
   eight groups then sum in integers with their 6-bit (Q6_K: 8-bit) scales, and only the block
   meets floats (row_dot_kt).

   Types: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14 (ggml's ids). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#define INLINE static inline __attribute__((always_inline))

#define QK 32
#define TILE_M 4

static inline float fp16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* ---- one group of 32 weights: unsigned codes (or signed for Q8_0), scales, offsets ---- */

typedef struct {
    uint8_t q[QK];      /* codes, the order of the 32 elements */
    float scale[2];     /* per half (16 elements); equal halves for 32-element groups */
    float offset[2];    /* w = scale * q + offset */
} group_t;

static void k4_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static int block_bytes(int type) {
    switch (type) {
        case 2: return 18;
        case 3: return 20;
        case 6: return 22;
        case 7: return 24;
        case 8: return 34;
        case 12: return 144;
        case 13: return 176;
        case 14: return 210;
    }
    return 0;
}

static int block_elems(int type) { return type >= 12 ? 256 : 32; }

/* group g (of 32 elements) of a row: the portable form, which the AVX2 paths agree with */
static void unpack_group(int type, const uint8_t* row, int g, group_t* o) {
    int per = block_elems(type) / QK, b = g / per, j = g % per;
    const uint8_t* blk = row + (size_t)b * block_bytes(type);
    float d = fp16(blk), m = 0.0f;
    switch (type) {
        case 2: case 3: case 6: case 7: {
            int qs_at = type == 2 ? 2 : type == 3 ? 4 : type == 6 ? 6 : 8;
            uint32_t qh = 0;
            if (type == 6 || type == 7) memcpy(&qh, blk + (type == 6 ? 2 : 4), 4);
            for (int l = 0; l < 16; l++) {
                o->q[l] = blk[qs_at + l] & 0xf;
                o->q[l + 16] = blk[qs_at + l] >> 4;
                if (type == 6 || type == 7) {
                    o->q[l] |= ((qh >> l) & 1) << 4;
                    o->q[l + 16] |= ((qh >> (l + 16)) & 1) << 4;
                }
            }
            if (type == 3 || type == 7) m = fp16(blk + 2);
            else m = -d * (type == 2 ? 8.0f : 16.0f);
            o->scale[0] = o->scale[1] = d;
            o->offset[0] = o->offset[1] = m;
            return;
        }
        case 8:
            memcpy(o->q, blk + 2, QK); /* signed */
            o->scale[0] = o->scale[1] = d;
            o->offset[0] = o->offset[1] = 0.0f;
            return;
        case 12: case 13: {
            uint8_t sc, mn;
            k4_scale_min(blk + 4, j, &sc, &mn);
            const uint8_t* qs = blk + (type == 12 ? 16 : 48) + 32 * (j / 2);
            int shift = 4 * (j % 2);
            for (int l = 0; l < QK; l++) {
                o->q[l] = (qs[l] >> shift) & 0xf;
                if (type == 13) o->q[l] |= ((blk[16 + l] >> j) & 1) << 4;
            }
            o->scale[0] = o->scale[1] = d * (float)sc;
            o->offset[0] = o->offset[1] = -(fp16(blk + 2) * (float)mn);
            return;
        }
        case 14: {
            const uint8_t* ql = blk + 64 * (j / 4);
            const uint8_t* qh = blk + 128 + 32 * (j / 4);
            const int8_t* sc = (const int8_t*)(blk + 192) + 8 * (j / 4);
            int k = j % 4;
            float dd = fp16(blk + 208);
            for (int l = 0; l < QK; l++) {
                uint8_t lo = k % 2 ? ql[l + 32] : ql[l];
                lo = k >= 2 ? lo >> 4 : lo & 0xf;
                o->q[l] = lo | (((qh[l] >> (2 * k)) & 3) << 4);
            }
            for (int h = 0; h < 2; h++) {
                o->scale[h] = dd * (float)sc[2 * k + h];
                o->offset[h] = -32.0f * o->scale[h];
            }
            return;
        }
    }
}

/* ---- activations: int8 codes per 32, a float scale a group, the codes' sums per 16 ---- */

/* x [M, K] rounded to int8 per `block` elements (32, or 256 for the K-quants' weights, as
   llama.cpp's q8_K), one float scale a block (xd [M, K / block]) and the codes' sums per 16
   (xs [M, K / 16]) */
void skiff_quantize_rows(const float* x, int m, int k, int block, int8_t* xq, float* xd,
                         int32_t* xs) {
    for (int r = 0; r < m; r++) {
        for (int g = 0; g < k / block; g++) {
            const float* v = x + (size_t)r * k + g * block;
            int8_t* q = xq + (size_t)r * k + g * block;
            int32_t* sums = xs + (size_t)r * (k / 16) + g * (block / 16);
            float amax = 0.0f;
            for (int l = 0; l < block; l++) amax = fmaxf(amax, fabsf(v[l]));
            float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            for (int h = 0; h < block / 16; h++) sums[h] = 0;
            for (int l = 0; l < block; l++) {
                int c = (int)nearbyintf(v[l] * id);
                q[l] = (int8_t)c;
                sums[l / 16] += c;
            }
            xd[(size_t)r * (k / block) + g] = d;
        }
    }
}

static int act_block(int type) { return type >= 12 ? 256 : QK; }

typedef struct {
    const int8_t* q;   /* [M, K] */
    const float* d;    /* [M, K / block]: 32, or 256 for the K-quants (act_block) */
    const int32_t* s;  /* [M, K / 16] */
    int k;
} acts_t;

/* a K-quant super-block's integer scales: Q4_K / Q5_K's 6-bit scale and min per 32 (sc[j],
   mn[j]), Q6_K's signed scale per 16 (sc[h]); and its d (and dmin) */
static void k_scales(int type, const uint8_t* blk, int sc[16], int mn[8], float* d, float* dmin) {
    if (type == 14) {
        for (int h = 0; h < 16; h++) sc[h] = ((const int8_t*)(blk + 192))[h];
        *d = fp16(blk + 208);
        *dmin = 0.0f;
        return;
    }
    for (int j = 0; j < 8; j++) {
        uint8_t a, b;
        k4_scale_min(blk + 4, j, &a, &b);
        sc[j] = a;
        mn[j] = b;
    }
    *d = fp16(blk);
    *dmin = fp16(blk + 2);
}

/* a K-quant row against activations rounded per 256: a super-block's groups summed in
   integers with their scales, one float multiply-add a block (as llama.cpp's vec_dot_q*_K):
   d * xd * sum(scale * code * xq) - dmin * xd * sum(min * xsum) (Q4_K, Q5_K), or
   d * xd * sum(scale * (code - 32) * xq) (Q6_K) */
static void row_dot_kref(int type, const uint8_t* row, const acts_t* a, int m0, int mc,
                         float* out) {
    int blocks = a->k / 256, bytes = block_bytes(type);
    group_t G;
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t* blk = row + (size_t)b * bytes;
        int sc[16], mn[8];
        float d, dmin;
        k_scales(type, blk, sc, mn, &d, &dmin);
        for (int i = 0; i < mc; i++) {
            size_t r = (size_t)(m0 + i);
            const int8_t* xq = a->q + r * a->k + (size_t)b * 256;
            const int32_t* xs = a->s + r * (a->k / 16) + (size_t)b * 16;
            long isum = 0, osum = 0;
            for (int j = 0; j < 8; j++) {
                unpack_group(type, row, b * 8 + j, &G);
                for (int l = 0; l < QK; l++) {
                    int scale = type == 14 ? sc[2 * j + l / 16] : sc[j];
                    isum += (long)scale * G.q[l] * xq[j * QK + l];
                }
                if (type == 14) osum += (long)sc[2 * j] * xs[2 * j] + (long)sc[2 * j + 1] * xs[2 * j + 1];
                else osum += (long)mn[j] * (xs[2 * j] + xs[2 * j + 1]);
            }
            float xd = a->d[r * blocks + b];
            if (type == 14) out[i] += d * xd * (float)(isum - 32 * osum);
            else out[i] += d * xd * (float)isum - dmin * xd * (float)osum;
        }
    }
}

/* portable: one weight row against up to TILE_M activation rows */
static void row_dot_ref(int type, const uint8_t* row, const acts_t* a, int m0, int mc, float* out) {
    if (type >= 12) {
        row_dot_kref(type, row, a, m0, mc, out);
        return;
    }
    int groups = a->k / QK;
    group_t G;
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int g = 0; g < groups; g++) {
        unpack_group(type, row, g, &G);
        for (int i = 0; i < mc; i++) {
            size_t r = (size_t)(m0 + i);
            const int8_t* xq = a->q + r * a->k + g * QK;
            int32_t s[2] = {0, 0};
            for (int l = 0; l < QK; l++)
                s[l >> 4] += (type == 8 ? (int)(int8_t)G.q[l] : (int)G.q[l]) * xq[l];
            float xd = a->d[r * groups + g];
            const int32_t* xs = a->s + (r * groups + g) * 2;
            out[i] += xd * (G.scale[0] * (float)s[0] + G.scale[1] * (float)s[1] +
                            G.offset[0] * (float)xs[0] + G.offset[1] * (float)xs[1]);
        }
    }
}

#ifdef __AVX2__
static inline __m256i dot_u8s8(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

static inline __m256i nibbles16(const uint8_t* p) { /* 16 bytes -> 32 codes: lo, then hi */
    __m128i v = _mm_loadu_si128((const __m128i*)p);
    __m256i b = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(b, _mm256_set1_epi8(0xf));
}

static inline __m256i bits32(uint32_t qh) { /* bit l of qh -> 0x10 in byte l */
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                    _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                      0x0101010101010101LL, 0));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* a legacy block's scale and offset, formed as unpack_group forms them */
INLINE void block_scale(const int type, const uint8_t* blk, float* sc, float* of) {
    float d = fp16(blk);
    *sc = d;
    *of = type == 2 ? -8.0f * d : type == 6 ? -16.0f * d : type == 8 ? 0.0f : fp16(blk + 2);
}

/* group j of a block: its 32 codes as a vector (unsigned; Q8_0's signed) */
INLINE __m256i block_codes(const int type, const uint8_t* blk, int j) {
    switch (type) {
        case 2: return nibbles16(blk + 2);
        case 3: return nibbles16(blk + 4);
        case 6: case 7: {
            uint32_t qh;
            memcpy(&qh, blk + (type == 6 ? 2 : 4), 4);
            return _mm256_or_si256(nibbles16(blk + (type == 6 ? 6 : 8)), bits32(qh));
        }
        case 8: return _mm256_loadu_si256((const __m256i*)(blk + 2));
        case 12: case 13: {
            __m256i q = _mm256_loadu_si256((const __m256i*)(blk + (type == 12 ? 16 : 48) + 32 * (j / 2)));
            q = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (j % 2)), _mm256_set1_epi8(0xf));
            if (type == 13) {
                __m256i h = _mm256_loadu_si256((const __m256i*)(blk + 16));
                h = _mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1));
                q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
            }
            return q;
        }
        default: { /* 14: Q6_K */
            int k = j % 4;
            __m256i lo = _mm256_loadu_si256((const __m256i*)(blk + 64 * (j / 4) + 32 * (k % 2)));
            lo = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (k / 2)), _mm256_set1_epi8(0xf));
            __m256i hi = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * (j / 4)));
            hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), _mm256_set1_epi8(3));
            return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        }
    }
}

/* one weight row against mc (1 .. TILE_M) activation rows; type and mc constants where
   inlined (row_dot_avx2 below), so the switch and the loops fold away */
INLINE void row_dot_t(const int type, const int mc, const uint8_t* row, const acts_t* a, int m0,
                      float* out) {
    const int groups = a->k / QK;
    __m256 acc[TILE_M];
    float off[TILE_M];
    const int8_t* xq[TILE_M];
    const float* xd[TILE_M];
    const int32_t* xs[TILE_M];
    for (int i = 0; i < mc; i++) {
        acc[i] = _mm256_setzero_ps();
        off[i] = 0.0f;
        xq[i] = a->q + (size_t)(m0 + i) * a->k;
        xd[i] = a->d + (size_t)(m0 + i) * groups;
        xs[i] = a->s + (size_t)(m0 + i) * groups * 2;
    }
    for (int g = 0; g < groups; g++) { /* a legacy block is one group */
        const uint8_t* blk = row + (size_t)g * block_bytes(type);
        float sc, of;
        block_scale(type, blk, &sc, &of);
        __m256i w = block_codes(type, blk, 0);
        __m256i wabs = type == 8 ? _mm256_sign_epi8(w, w) : w;
        __m256 scale = _mm256_set1_ps(sc);
        for (int i = 0; i < mc; i++) {
            __m256i x = _mm256_loadu_si256((const __m256i*)(xq[i] + g * QK));
            if (type == 8) x = _mm256_sign_epi8(x, w);
            __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wabs, x));
            float d = xd[i][g];
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(d)), p, acc[i]);
            if (type != 8) off[i] += d * of * (float)(xs[i][2 * g] + xs[i][2 * g + 1]);
        }
    }
    for (int i = 0; i < mc; i++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        out[i] = _mm_cvtss_f32(v) + off[i];
    }
}

/* row_dot_kref on AVX2: each group's maddubs pairs multiplied by its scale (madd_epi16) and
   summed in int32 over the super-block; type and mc constants where inlined */
INLINE void row_dot_kt(const int type, const int mc, const uint8_t* row, const acts_t* a, int m0,
                       float* out) {
    const int blocks = a->k / 256, bytes = block_bytes(type);
    __m256 acc[TILE_M];
    float off[TILE_M];
    for (int i = 0; i < mc; i++) {
        acc[i] = _mm256_setzero_ps();
        off[i] = 0.0f;
    }
    for (int b = 0; b < blocks; b++) {
        const uint8_t* blk = row + (size_t)b * bytes;
        int sc[16], mn[8];
        float d, dmin;
        k_scales(type, blk, sc, mn, &d, &dmin);
        __m256i isum[TILE_M];
        for (int i = 0; i < mc; i++) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i w = block_codes(type, blk, j);
            __m256i sv = type == 14 ? _mm256_set_m128i(_mm_set1_epi16((short)sc[2 * j + 1]),
                                                       _mm_set1_epi16((short)sc[2 * j]))
                                    : _mm256_set1_epi16((short)sc[j]);
            for (int i = 0; i < mc; i++) {
                const int8_t* xq = a->q + (size_t)(m0 + i) * a->k + (size_t)b * 256 + j * QK;
                __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i*)xq));
                isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p, sv));
            }
        }
        for (int i = 0; i < mc; i++) {
            size_t r = (size_t)(m0 + i);
            const int32_t* xs = a->s + r * (a->k / 16) + (size_t)b * 16;
            float xd = a->d[r * blocks + b];
            long osum = 0;
            for (int j = 0; j < 8; j++) {
                if (type == 14) osum += (long)sc[2 * j] * xs[2 * j] + (long)sc[2 * j + 1] * xs[2 * j + 1];
                else osum += (long)mn[j] * (xs[2 * j] + xs[2 * j + 1]);
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * xd), acc[i]);
            if (type == 14) off[i] += d * xd * (float)(-32 * osum);
            else off[i] -= dmin * xd * (float)osum;
        }
    }
    for (int i = 0; i < mc; i++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        out[i] = _mm_cvtss_f32(v) + off[i];
    }
}

#define ROW_DOT_K(T)                                                                         \
    static void row_dot_##T(int mc, const uint8_t* row, const acts_t* a, int m0, float* out) { \
        switch (mc) {                                                                        \
            case 1: row_dot_kt(T, 1, row, a, m0, out); return;                               \
            case 2: row_dot_kt(T, 2, row, a, m0, out); return;                               \
            case 3: row_dot_kt(T, 3, row, a, m0, out); return;                               \
            default: row_dot_kt(T, 4, row, a, m0, out); return;                              \
        }                                                                                    \
    }
ROW_DOT_K(12)
ROW_DOT_K(13)
ROW_DOT_K(14)

#define ROW_DOT_TYPE(T)                                                                      \
    static void row_dot_##T(int mc, const uint8_t* row, const acts_t* a, int m0, float* out) { \
        switch (mc) {                                                                        \
            case 1: row_dot_t(T, 1, row, a, m0, out); return;                                \
            case 2: row_dot_t(T, 2, row, a, m0, out); return;                                \
            case 3: row_dot_t(T, 3, row, a, m0, out); return;                                \
            default: row_dot_t(T, 4, row, a, m0, out); return;                               \
        }                                                                                    \
    }
ROW_DOT_TYPE(2)
ROW_DOT_TYPE(3)
ROW_DOT_TYPE(6)
ROW_DOT_TYPE(7)
ROW_DOT_TYPE(8)

typedef void (*row_dot_fn)(int, const uint8_t*, const acts_t*, int, float*);

static row_dot_fn row_dot_avx2(int type) {
    switch (type) {
        case 2: return row_dot_2;
        case 3: return row_dot_3;
        case 6: return row_dot_6;
        case 7: return row_dot_7;
        case 8: return row_dot_8;
        case 12: return row_dot_12;
        case 13: return row_dot_13;
        default: return row_dot_14;
    }
}
#endif

/* ---- entry points ---- */

int skiff_supported(int type) { return block_bytes(type) > 0; }

int skiff_act_block(int type) { return act_block(type); }

int skiff_simd(void) {
#ifdef __AVX2__
    return 2;
#else
    return 0;
#endif
}

#define ROW_BLOCK 16

/* y[M, ldy] (columns n0 .. n0 + N) = rows of x (rounded: xq, xd, xs) by the N weight rows at w
   (row_bytes each). Tasks are blocks of ROW_BLOCK weight rows by tiles of TILE_M activation
   rows, a block's tiles consecutive (its rows stay in cache while every tile meets them), the
   tasks split in contiguous ranges over the threads (each a long stream of rows for the
   prefetchers). simd 0 forces the portable path (tests). */
void skiff_qmatmul(int type, const uint8_t* w, long row_bytes, int n, int k, const int8_t* xq,
                   const float* xd, const int32_t* xs, int m, float* y, long ldy, int simd) {
    acts_t a = {xq, xd, xs, k};
    int tiles = (m + TILE_M - 1) / TILE_M;
    long blocks = (n + ROW_BLOCK - 1) / ROW_BLOCK;
#ifdef __AVX2__
    row_dot_fn fn = row_dot_avx2(type);
#endif
#pragma omp parallel for schedule(static)
    for (long t = 0; t < blocks * tiles; t++) {
        int rb = (int)(t / tiles), m0 = (int)(t % tiles) * TILE_M;
        int mc = m - m0 < TILE_M ? m - m0 : TILE_M;
        int r1 = (rb + 1) * ROW_BLOCK < n ? (rb + 1) * ROW_BLOCK : n;
        for (int r = rb * ROW_BLOCK; r < r1; r++) {
            float out[TILE_M];
            const uint8_t* row = w + (size_t)r * row_bytes;
#ifdef __AVX2__
            if (simd) fn(mc, row, &a, m0, out);
            else row_dot_ref(type, row, &a, m0, mc, out);
#else
            (void)simd;
            row_dot_ref(type, row, &a, m0, mc, out);
#endif
            for (int i = 0; i < mc; i++) y[(size_t)(m0 + i) * ldy + r] = out[i];
        }
    }
}

/* skiff_qmatmul of float32 x [M, K], rounded here (one call: no buffers for the caller to
   make) */
void skiff_matmul(int type, const uint8_t* w, long row_bytes, int n, int k, const float* x,
                  int m, float* y, long ldy, int simd) {
    int block = act_block(type);
    int8_t* xq = malloc((size_t)m * k);
    float* xd = malloc((size_t)m * (k / block) * sizeof(float));
    int32_t* xs = malloc((size_t)m * (k / 16) * sizeof(int32_t));
    if (m > 8) {
#pragma omp parallel for schedule(static)
        for (int r = 0; r < m; r++)
            skiff_quantize_rows(x + (size_t)r * k, 1, k, block, xq + (size_t)r * k,
                                xd + (size_t)r * (k / block), xs + (size_t)r * (k / 16));
    } else {
        skiff_quantize_rows(x, m, k, block, xq, xd, xs);
    }
    skiff_qmatmul(type, w, row_bytes, n, k, xq, xd, xs, m, y, ldy, simd);
    free(xq);
    free(xd);
    free(xs);
}
