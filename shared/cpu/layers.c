/* A run of Llama-family decoder layers in one call: the sequence of the library's own ops that
   the model's Python modules would call one by one (shared/model/llama.py, transformer.py),
   in the same order on the same buffers, so the result is the same bit for bit. What it saves
   is Python: a decode step of a small model called ~10 ops a layer, each through torch's
   allocator and ctypes (SmolLM2: ~7 of a 16 ms step outside the ops themselves).

   Per layer: h = RMSNorm(x + residual) (the first layer of a run that starts the stream:
   RMSNorm(x), the residual x); q, k, v = h W^T (one to three row blocks of the fused
   projection, each of its own type, biases added); RoPE and the KV write; attention; the
   output projection; h = RMSNorm(a + residual); gate, up (one or two row blocks); act(gate) *
   up; the down projection: the next layer's x. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void skiff_matmul(int type, const uint8_t* w, long row_bytes, int n, int k, const float* x,
                  int m, float* y, long ldy, int simd);
void skiff_add_rms_norm(const float* x, const float* residual, const float* w, float eps,
                        int rows, int d, float* out, float* sum_out);
void skiff_gated_act(const float* gate, const float* up, long stride, int rows, int n, int gelu,
                     float* out);
void skiff_rope_kv(float* q, float* k, const float* v, const int64_t* positions, int t, int hq,
                   int hk, int d, int rope_dim, const float* inv_freq, float scale, int neox,
                   void* k_cache, void* v_cache, const int64_t* slots, int half_cache);
void skiff_attention(const float* q, const void* k_cache, const void* v_cache, int half_cache,
                     const int32_t* block_tables, int width, const int32_t* qstart,
                     const int32_t* seq_lens, int n_seqs, int hq, int hk, int d, int block_size,
                     float scale, int window, float* out);

typedef struct {
    int type;          /* ggml type id */
    const uint8_t* w;  /* the GGUF rows */
    long row_bytes;
    int n;             /* rows (output columns) */
    const float* bias; /* NULL: none */
} skiff_qpart;

typedef struct {
    const float* attn_norm;
    const float* ffn_norm;
    const float* q_norm;         /* per-head RMSNorm of q and k before RoPE (NULL: none) */
    const float* k_norm;
    const float* post_attn_norm; /* Gemma 3: norms after attention and the MLP, added to x */
    const float* post_ffn_norm;  /* (NULL: Llama's residual stream) */
    skiff_qpart qkv[3];
    int n_qkv;
    skiff_qpart wo;
    skiff_qpart gate_up[2];
    int n_gate_up;
    skiff_qpart down;
    void* k_cache; /* [rows, hk, hd], float32 or float16 (half_cache) */
    void* v_cache;
    int rope_dim;
    const float* inv_freq;
    float rope_scale;
    int window;
} skiff_layer;

typedef struct {
    int t, d_model, hq, hk, hd, ffn, neox, half_cache, gelu;
    float eps, attn_scale;
    const int64_t* positions;
    const int64_t* slots;
    const int32_t* block_tables;
    int width;
    const int32_t* qstart;
    const int32_t* seq_lens;
    int n_seqs, block_size, simd;
} skiff_step;

/* the parts' products side by side in y [t, ldy], each plus its bias */
static void parts_matmul(const skiff_qpart* parts, int n_parts, const float* x, int t, int k,
                         float* y, long ldy, int simd) {
    long col = 0;
    for (int p = 0; p < n_parts; p++) {
        const skiff_qpart* q = &parts[p];
        skiff_matmul(q->type, q->w, q->row_bytes, q->n, k, x, t, y + col, ldy, simd);
        if (q->bias != NULL)
            for (int r = 0; r < t; r++)
                for (int i = 0; i < q->n; i++) y[(size_t)r * ldy + col + i] += q->bias[i];
        col += q->n;
    }
}

/* q, k, v out of a row of the fused projection's product; QK-norm per head where the layer
   has it (in place: each row's sum of squares is taken before it is overwritten) */
static void split_qkv(const skiff_layer* L, const skiff_step* s, const float* qkv, float* q,
                      float* k, float* v) {
    int t = s->t, qd = s->hq * s->hd, kvd = s->hk * s->hd;
    long qkv_w = qd + 2L * kvd;
    for (int r = 0; r < t; r++) {
        const float* row = qkv + (size_t)r * qkv_w;
        memcpy(q + (size_t)r * qd, row, sizeof(float) * qd);
        memcpy(k + (size_t)r * kvd, row + qd, sizeof(float) * kvd);
        memcpy(v + (size_t)r * kvd, row + qd + kvd, sizeof(float) * kvd);
    }
    if (L->q_norm != NULL) {
        skiff_add_rms_norm(q, NULL, L->q_norm, s->eps, t * s->hq, s->hd, q, NULL);
        skiff_add_rms_norm(k, NULL, L->k_norm, s->eps, t * s->hk, s->hd, k, NULL);
    }
}

/* RoPE and the KV write, attention into o */
static void attend(const skiff_layer* L, const skiff_step* s, float* q, float* k, float* v,
                   float* o) {
    skiff_rope_kv(q, k, v, s->positions, s->t, s->hq, s->hk, s->hd, L->rope_dim, L->inv_freq,
                  L->rope_scale, s->neox, L->k_cache, L->v_cache, s->slots, s->half_cache);
    skiff_attention(q, L->k_cache, L->v_cache, s->half_cache, s->block_tables, s->width,
                    s->qstart, s->seq_lens, s->n_seqs, s->hq, s->hk, s->hd, s->block_size,
                    s->attn_scale, L->window, o);
}

/* x += RMSNorm(y) with weight w, rows of d (y's norm into tmp) */
static void add_normed(float* x, const float* y, const float* w, const skiff_step* s,
                       float* tmp) {
    long n = (long)s->t * s->d_model;
    skiff_add_rms_norm(y, NULL, w, s->eps, s->t, s->d_model, tmp, NULL);
    for (long i = 0; i < n; i++) x[i] = x[i] + tmp[i];
}

/* Gemma 3's layer (shared/model/gemma3.py): h = x + norm(attn(norm(x))), then
   x = h + norm(mlp(norm(h))) */
static void gemma_layer(const skiff_layer* L, const skiff_step* s, float* x, float* h,
                        float* qkv, float* q, float* k, float* v, float* o, float* gu,
                        float* mid, float* tmp) {
    int t = s->t, d = s->d_model, qd = s->hq * s->hd, f = s->ffn;
    skiff_add_rms_norm(x, NULL, L->attn_norm, s->eps, t, d, h, NULL);
    parts_matmul(L->qkv, L->n_qkv, h, t, d, qkv, qd + 2L * s->hk * s->hd, s->simd);
    split_qkv(L, s, qkv, q, k, v);
    attend(L, s, q, k, v, o);
    parts_matmul(&L->wo, 1, o, t, qd, h, d, s->simd); /* h: the attention's output */
    add_normed(x, h, L->post_attn_norm, s, tmp);
    skiff_add_rms_norm(x, NULL, L->ffn_norm, s->eps, t, d, h, NULL);
    parts_matmul(L->gate_up, L->n_gate_up, h, t, d, gu, 2L * f, s->simd);
    skiff_gated_act(gu, gu + f, 2L * f, t, f, s->gelu, mid);
    parts_matmul(&L->down, 1, mid, t, f, h, d, s->simd);
    add_normed(x, h, L->post_ffn_norm, s, tmp);
}

/* x [t, d] in: the previous layer's output (the embedding before the first); residual [t, d]:
   the stream before it (has_residual 0: none yet, x is the stream). Out: x the last layer's
   output, residual the stream it adds to (always set). */
void skiff_llama_layers(const skiff_layer* layers, int n_layers, const skiff_step* s, float* x,
                        float* residual, int has_residual) {
    int t = s->t, d = s->d_model, qd = s->hq * s->hd, kvd = s->hk * s->hd, f = s->ffn;
    long qkv_w = qd + 2L * kvd;
    float* h = malloc(sizeof(float) * (size_t)t * d);
    float* sum = malloc(sizeof(float) * (size_t)t * d);
    float* qkv = malloc(sizeof(float) * (size_t)t * qkv_w);
    float* q = malloc(sizeof(float) * (size_t)t * qd);
    float* k = malloc(sizeof(float) * (size_t)t * kvd);
    float* v = malloc(sizeof(float) * (size_t)t * kvd);
    float* o = malloc(sizeof(float) * (size_t)t * qd);
    float* gu = malloc(sizeof(float) * (size_t)t * 2 * f);
    float* mid = malloc(sizeof(float) * (size_t)t * f);
    for (int l = 0; l < n_layers; l++) {
        const skiff_layer* L = &layers[l];
        if (L->post_attn_norm != NULL) { /* Gemma 3: x is the stream, no residual beside it */
            gemma_layer(L, s, x, h, qkv, q, k, v, o, gu, mid, sum);
            continue;
        }
        if (has_residual) {
            skiff_add_rms_norm(x, residual, L->attn_norm, s->eps, t, d, h, sum);
            memcpy(residual, sum, sizeof(float) * (size_t)t * d);
        } else {
            skiff_add_rms_norm(x, NULL, L->attn_norm, s->eps, t, d, h, NULL);
            memcpy(residual, x, sizeof(float) * (size_t)t * d);
            has_residual = 1;
        }
        parts_matmul(L->qkv, L->n_qkv, h, t, d, qkv, qkv_w, s->simd);
        split_qkv(L, s, qkv, q, k, v);
        attend(L, s, q, k, v, o);
        parts_matmul(&L->wo, 1, o, t, qd, x, d, s->simd); /* x: the attention's output now */
        skiff_add_rms_norm(x, residual, L->ffn_norm, s->eps, t, d, h, sum);
        memcpy(residual, sum, sizeof(float) * (size_t)t * d);
        parts_matmul(L->gate_up, L->n_gate_up, h, t, d, gu, 2L * f, s->simd);
        skiff_gated_act(gu, gu + f, 2L * f, t, f, s->gelu, mid);
        parts_matmul(&L->down, 1, mid, t, f, x, d, s->simd);
    }
    free(h);
    free(sum);
    free(qkv);
    free(q);
    free(k);
    free(v);
    free(o);
    free(gu);
    free(mid);
}
