/* A bf16 decode step's decoder layers in one call: for each layer, the same kernels in the same
 * order as the Python layer stack calls them one by one (RMSNorm with the residual add, the qkv
 * linear, rotary on q and k, the KV pool write, the shared-prefix and decode-mirror attention with
 * the mirror append, the o linear, RMSNorm, the fused gate/up + silu*mul, the down linear), so the
 * results are bit for bit those of that stack; what goes is the interpreter and dispatch work
 * between the kernels, during which the other OpenMP threads wait.
 *
 * Called by runtime/cpu/decode_layers.py only after it checked every bound the kernels check
 * (AMX on and the tile layout of every weight, rows <= 64, head shapes), so a failure here means a
 * broken precondition: the return value says which layer and stage. */
#include <stdint.h>
#include "entry_points.h"

/* What every layer shares (one decode batch of n requests). Scratch buffers are the caller's,
 * contiguous, and reused by every layer. */
typedef struct {
    int64_t n, hidden, q_heads, kv_heads, head_dim, inter, rot_dim;
    int64_t cap, width;            /* the decode mirror: keys per request row, keys read */
    int64_t prefix_len, prefix_pad; /* the packed shared prefix (0, 0: none) */
    int64_t pool_slots;            /* KV pool rows (store_kv_rows' bound) */
    float eps, scale;
    uint16_t* residual;            /* [n, hidden]: the embeddings in, the residual stream out */
    uint16_t* hidden_out;          /* [n, hidden]: the last layer's MLP output */
    const uint16_t* cos;           /* [n, rot_dim / 2] */
    const uint16_t* sin;
    const int64_t* out_loc;        /* [n]: each new token's KV pool slot */
    const int64_t* append_pos;     /* [n]: its key index in the mirror's row */
    const float* mask;             /* [n, cap] key bias */
    uint16_t* normed;              /* [n, hidden] */
    uint16_t* qkv;                 /* [n, (q_heads + 2 kv_heads) head_dim] */
    uint16_t* attn;                /* [n, q_heads head_dim] */
    uint16_t* o;                   /* [n, hidden] */
    uint16_t* mid;                 /* [n, inter] */
    float* prefix_out;             /* [n, q_heads head_dim] fp32 (prefix_len > 0) */
    float* prefix_lse;             /* [n, q_heads] fp32 */
} DecodeStep;

/* One layer's weights (packed addresses for the linears) and KV buffers. */
typedef struct {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *post_norm, *gate_up, *down;
    char *k_pool, *v_pool;         /* [pool_slots, kv_heads, head_dim] */
    uint16_t *k_t, *v;             /* the mirror: [n, kv_heads, head_dim, cap], [n, kv_heads, cap, head_dim] */
    const uint16_t *prefix_k, *prefix_v;
} DecodeLayer;

enum { STAGE_QKV = 1, STAGE_KV_STORE, STAGE_PREFIX, STAGE_ATTENTION, STAGE_O, STAGE_MLP, STAGE_DOWN };

/* Returns 0, or -(layer * 16 + stage) for the first kernel that refused. */
int decode_layers_bf16(const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    const int64_t n = s->n, hd = s->head_dim, group = s->q_heads / s->kv_heads;
    const int64_t q_cols = s->q_heads * hd, kv_cols = s->kv_heads * hd, qkv_cols = q_cols + 2 * kv_cols;
    const uint16_t* k_new = s->qkv + q_cols;
    const uint16_t* v_new = s->qkv + q_cols + kv_cols;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecodeLayer* l = layers + i;
        const int fail = -(int)(i * 16);
        /* the first layer's residual is its input; later ones add the previous MLP output first */
        rmsnorm_bf16(i == 0 ? s->residual : s->hidden_out, i == 0 ? 0 : s->residual, l->input_norm, n, s->hidden,
                     s->eps, s->normed);
        if (amx_linear_bf16(s->normed, n, s->hidden, l->qkv, qkv_cols, s->hidden, l->qkv_bias, 0, s->qkv))
            return fail - STAGE_QKV;
        rotary_bf16(s->qkv, n, qkv_cols, s->q_heads + s->kv_heads, hd, s->rot_dim, s->cos, s->sin);
        if (store_kv_rows((const char*)k_new, qkv_cols * 2, (const char*)v_new, qkv_cols * 2, s->out_loc, n,
                          kv_cols * 2, l->k_pool, l->v_pool, s->pool_slots))
            return fail - STAGE_KV_STORE;
        if (s->prefix_len > 0 &&
            prefix_attention_bf16(s->qkv, qkv_cols, l->prefix_k, l->prefix_v, s->prefix_len, s->prefix_pad, n,
                                  s->kv_heads, group, hd, s->scale, s->prefix_out, s->prefix_lse))
            return fail - STAGE_PREFIX;
        if (decode_attention_bf16(s->qkv, qkv_cols, l->k_t, l->v, s->mask, s->cap, s->width, s->attn, 0, n,
                                  s->kv_heads, group, hd, s->scale, k_new, qkv_cols, v_new, qkv_cols, s->append_pos,
                                  s->prefix_len > 0 ? s->prefix_out : 0, s->prefix_len > 0 ? s->prefix_lse : 0))
            return fail - STAGE_ATTENTION;
        if (amx_linear_bf16(s->attn, n, q_cols, l->o, s->hidden, q_cols, 0, 0, s->o))
            return fail - STAGE_O;
        rmsnorm_bf16(s->o, s->residual, l->post_norm, n, s->hidden, s->eps, s->normed);
        if (amx_linear_silu_mul_bf16(s->normed, n, s->hidden, l->gate_up, s->inter, s->hidden, s->mid))
            return fail - STAGE_MLP;
        if (amx_linear_bf16(s->mid, n, s->inter, l->down, s->hidden, s->inter, 0, 0, s->hidden_out))
            return fail - STAGE_DOWN;
    }
    return 0;
}
