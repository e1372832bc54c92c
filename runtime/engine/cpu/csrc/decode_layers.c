/* A decode step's decoder layers in one call: for each layer, the same kernels in the same order
 * as the Python layer stack calls them one by one (RMSNorm with the residual add, the qkv linear,
 * each q and k head's RMSNorm where the layer has them (head_norm.c), rotary on q and k (a layer's
 * own table where it has one: Gemma 3's windowed layers), the KV pool write, the shared-prefix and
 * decode-mirror attention with the mirror append (a windowed layer: its window's keys gathered from
 * its own pool, as the backend's windowed path gathers them), the o linear, RMSNorm (Gemma's
 * sandwich: the attention output's norm, then the residual's), gate/up + silu*mul or gelu_tanh*mul,
 * the down linear (sandwich: and its output's norm), or a sparse layer's routed experts: moe_mlp.c),
 * so the results are
 * bit for bit those of that stack; what goes is the interpreter and dispatch work between the
 * kernels, during which the other OpenMP threads wait.
 *
 * Five sets of kernels, one order of calls: bf16 with its linears on AMX tiles (gate/up fused with
 * silu*mul), bf16 with them on AVX512-BF16 dot products (dp_linear_bf16, for CPUs without AMX;
 * gate/up then silu*mul, as the stack runs them there), fp32 with them on the panel kernel
 * (linear_f32; gate/up then silu*mul), and fp32 or bf16 with weights kept quantized
 * (quant_linear_f32; bf16 activations widened for it and its results rounded back).
 * Each is a table of the kernels it calls (Kernels), the layer loop is written once.
 *
 * A quantized KV cache (DecodeStep.kv_format, kv_codes.h) changes two calls in every set: the pool
 * write quantizes the new rows (store_kv_rows_q, the pool's reference bytes) and decode attention
 * reads the quantized mirror (decode_attention_q8, copying those stored rows in first); the
 * shared prefix stays the set's own kernel on its dequantized packed copy.
 *
 * Called by runtime/cpu/decode_layers.py only after it checked every bound the kernels check
 * (AMX: on, and the tile layout of every weight; dp: oneDNN's AVX512-BF16 layout and this build;
 * both at most 64 rows; fp32: panel copies and a row count the panel kernel takes; head shapes),
 * so a failure here means a broken precondition: the return value says which layer and stage. */
#include "common.h"
#include "entry_points.h"
#include "kv_codes.h"
#include "moe_mlp.h"

/* What every layer shares (one decode batch of n rows: one per request, or, in a speculative verify
 * step, each request's input token and drafts, which share its mirror row through kv_row and
 * attend causally among themselves through their mask rows). Activations are in the step's element
 * type (bf16 or fp32); scratch buffers are the caller's, contiguous, and reused by every layer. */
typedef struct {
    int64_t n, hidden, q_heads, kv_heads, head_dim, inter, rot_dim;
    int64_t cap, width;            /* the decode mirror: keys per request row, keys read */
    int64_t prefix_len, prefix_pad; /* the packed shared prefix (0, 0: none) */
    int64_t pool_slots;            /* KV pool rows (store_kv_rows' bound) */
    float eps, scale;
    void* residual;                /* [n, hidden]: the embeddings in, the residual stream out */
    void* hidden_out;              /* [n, hidden]: the last layer's MLP output */
    const void* cos;               /* [n, rot_dim / 2] */
    const void* sin;
    const int64_t* out_loc;        /* [n]: each new token's KV pool slot */
    const int64_t* append_pos;     /* [n]: its key index in the mirror's row */
    const float* mask;             /* [n, cap] key bias */
    void* normed;                  /* [n, hidden] */
    void* qkv;                     /* [n, (q_heads + 2 kv_heads) head_dim] */
    void* attn;                    /* [n, q_heads head_dim] */
    void* o;                       /* [n, hidden] */
    void* mid;                     /* [n, inter] */
    void* gate_up;                 /* [n, 2 inter]: the gate/up linear's output (unused on AMX, which fuses it) */
    float* prefix_out;             /* [n, q_heads head_dim] fp32 (prefix_len > 0) */
    float* prefix_lse;             /* [n, q_heads] fp32 */
    const int64_t* kv_row;         /* [n]: each row's mirror row (NULL: row i is request i) */
    int64_t kv_rows;               /* the mirror's rows (kv_row's bound) */
    const struct LoraRuns* lora;   /* the step's adapter runs (NULL: no row uses an adapter) */
    int64_t kv_format;             /* the KV pool's format (kv_codes.h; KV_PLAIN: the step's dtype) */
    int64_t activation;            /* the gated MLP's: ACT_SILU or ACT_GELU_TANH (every layer's) */
    const void* cos_local;         /* [n, rot_dim / 2]: the second rotary table (a layer's rope_table 1) */
    const void* sin_local;
    /* Windowed layers (DecodeLayer.windowed): their own pool (pool rows win_pool_slots), the new
     * tokens' slots there (win_out_loc [n]), and each request's last win_len keys' slots there
     * (win_slots [n, win_len], 0-padded) with their key bias (win_mask [n, win_len] or NULL),
     * gathered into win_k [n, kv_heads, head_dim, win_len] and win_v [n, kv_heads, win_len, head_dim]
     * (the caller's scratch) for the decode attention kernel, as the backend's windowed path does. */
    const int64_t* win_out_loc;
    const int64_t* win_slots;
    int64_t win_len, win_pool_slots;
    const float* win_mask;
    void *win_k, *win_v;
} DecodeStep;

enum { ACT_SILU, ACT_GELU_TANH };

/* Multi-LoRA (lora.c): which runs of the step's rows use which adapter slot, and the slots' shape. */
typedef struct LoraRuns {
    int64_t slots, rank, n;        /* S, R, the number of runs */
    const int32_t* starts;         /* [n + 1]: run i is rows starts[i] .. starts[i + 1] */
    const int32_t* run_slots;      /* [n]: its slot (-1: the base model) */
} LoraRuns;

/* One linear's adapter slots, as lora.c reads them (a NULL: the linear takes no adapter). */
typedef struct {
    const void *a, *b;             /* [S, parts R, in], [S, out, R] */
    const int64_t* part_rows;      /* [parts + 1] */
    int64_t parts;
} LoraLinear;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_LINEARS };

/* One layer's weights (the addresses the linear kernels read) and KV buffers. */
typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *o, *post_norm, *gate_up, *down;
    char *k_pool, *v_pool;         /* [pool_slots, kv_heads, head_dim] (quantized: kv_row_bytes per head) */
    void *k_t, *v;                 /* the mirror: [n, kv_heads, head_dim, cap], [n, kv_heads, cap, head_dim] */
    const void *prefix_k, *prefix_v;
    LoraLinear lora[LORA_LINEARS];  /* its linears' adapter slots (a server with --enable-lora) */
    float *k_scales, *v_scales;    /* a quantized mirror's per-key scales [n, kv_heads, cap] (int8; else NULL) */
    float k_scale, v_scale;        /* fp8's layer scales (1 otherwise) */
    const void *q_norm, *k_norm;   /* [head_dim]: RMSNorm of each q and k head before RoPE (NULL: none) */
    float qk_eps;
    /* OLMoE: the q/k norms span the whole projection (q_norm [q_heads head_dim], k_norm [kv_heads
     * head_dim]) and q, k, v are clamped to +-clip after them (0: no clamp) */
    int64_t qk_whole;
    float clip;
    const MoeLayer* moe;           /* a sparse layer's routed experts in place of gate_up/down (moe_mlp.c; NULL: dense) */
    /* Gemma's sandwich norms (NULL: pre-norm): post_norm then norms the attention output alone,
     * pre_mlp_norm the residual stream after its add, post_mlp_norm the MLP's output */
    const void *pre_mlp_norm, *post_mlp_norm;
    int64_t rope_table;            /* 0: the step's cos/sin; 1: cos_local/sin_local */
    int64_t windowed;              /* 1: attends over its window's keys in its own pool (DecodeStep.win_*) */
} DecodeLayer;

enum { STAGE_QKV = 1, STAGE_KV_STORE, STAGE_PREFIX, STAGE_ATTENTION, STAGE_O, STAGE_MLP, STAGE_DOWN, STAGE_LORA };

/* One set of kernels, each in the layer loop's terms. */
typedef struct {
    int64_t elem;  /* bytes per activation */
    void (*rmsnorm)(const void* x, void* residual, const void* w, int64_t rows, int64_t hidden, float eps, void* out);
    int (*linear)(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                  void* out);
    void (*rotary)(void* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, int64_t rot_dim,
                   const void* cos, const void* sin);
    int (*prefix)(const void* q, int64_t q_stride, const void* kp, const void* vp, int64_t p, int64_t p_pad,
                  int64_t n, int64_t hkv, int64_t group, int64_t d, float scale, float* out, float* lse);
    int (*decode)(const void* q, int64_t q_stride, void* kt, void* v, const float* bias, int64_t cap, int64_t width,
                  void* out, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale, const void* k_new,
                  int64_t k_new_stride, const void* v_new, int64_t v_new_stride, const int64_t* pos,
                  const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows);
    void (*silu_mul)(const void* gate_up, int64_t rows, int64_t inter, void* out);
    void (*gelu_tanh_mul)(const void* gate_up, int64_t rows, int64_t inter, void* out);
    /* NULL, or both in one pass: mid [m, inter] = silu(gate) * up of x times the gate/up weight
     * ([2 inter, k], gate rows first) */
    int (*fused_gate_up)(const void* x, int64_t m, const void* w, int64_t inter, int64_t k, void* mid);
    /* out [m, n] += the step's adapter products of x [m, k] (lora.c, in the set's element type) */
    int (*lora_add)(const void* x, int64_t ldx, void* out, int64_t ldo, int64_t m, int64_t k, int64_t n,
                    const LoraLinear* w, const LoraRuns* runs);
    /* RMSNorm of each head of T strided rows of packed heads, in place (head_norm.c) */
    void (*head_norm)(void* x, int64_t T, int64_t stride, int64_t heads, int64_t d, const void* w, float eps);
} Kernels;

/* The element-wise and attention kernels of one element type, in the loop's terms: each kernel is
 * named by its type's suffix (bf16, f32), and C converts the void pointers to its own types. */
#define ELEMENT_KERNELS(T)                                                                                   \
    static void rmsnorm_##T##_v(const void* x, void* residual, const void* w, int64_t rows, int64_t hidden,  \
                                float eps, void* out)                                                          \
    {                                                                                                          \
        rmsnorm_##T(x, residual, w, rows, hidden, eps, out);                                                   \
    }                                                                                                          \
    static void rotary_##T##_v(void* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d,          \
                               int64_t rot_dim, const void* cos, const void* sin)                              \
    {                                                                                                          \
        rotary_##T(x, rows, row_stride, heads, d, rot_dim, cos, sin);                                          \
    }                                                                                                          \
    static int prefix_##T##_v(const void* q, int64_t q_stride, const void* kp, const void* vp, int64_t p,     \
                              int64_t p_pad, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,   \
                              float* out, float* lse)                                                          \
    {                                                                                                          \
        return prefix_attention_##T(q, q_stride, kp, vp, p, p_pad, n, hkv, group, d, scale, out, lse);         \
    }                                                                                                          \
    static int decode_##T##_v(const void* q, int64_t q_stride, void* kt, void* v, const float* bias,          \
                              int64_t cap, int64_t width, void* out, int64_t n, int64_t hkv, int64_t group,    \
                              int64_t d, float scale, const void* k_new, int64_t k_new_stride,                 \
                              const void* v_new, int64_t v_new_stride, const int64_t* pos,                     \
                              const float* init_o, const float* init_lse, const int64_t* kv_row,               \
                              int64_t kv_rows)                                                                 \
    {                                                                                                          \
        return decode_attention_##T(q, q_stride, kt, v, bias, cap, width, out, 0, n, hkv, group, d, scale,    \
                                    k_new, k_new_stride, v_new, v_new_stride, pos, init_o, init_lse, kv_row,   \
                                    kv_rows);                                                                  \
    }                                                                                                          \
    static void silu_mul_##T##_v(const void* gate_up, int64_t rows, int64_t inter, void* out)                 \
    {                                                                                                          \
        silu_mul_##T(gate_up, rows, inter, out);                                                               \
    }                                                                                                          \
    static void gelu_tanh_mul_##T##_v(const void* gate_up, int64_t rows, int64_t inter, void* out)            \
    {                                                                                                          \
        gelu_tanh_mul_##T(gate_up, rows, inter, out);                                                          \
    }                                                                                                          \
    static void head_norm_##T##_v(void* x, int64_t rows, int64_t stride, int64_t heads, int64_t d,           \
                                  const void* w, float eps)                                                    \
    {                                                                                                          \
        rmsnorm_heads_##T(x, rows, stride, heads, d, w, eps, x, stride);                                       \
    }

ELEMENT_KERNELS(bf16)
ELEMENT_KERNELS(f32)

/* The linears of each set (bf16 kernels also take a bias and an fp32-output flag). */
static int linear_amx(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                      void* out)
{
    return amx_linear_bf16(x, m, ldx, w, n, k, bias, 0, out);
}
static int fused_gate_up_amx(const void* x, int64_t m, const void* w, int64_t inter, int64_t k, void* mid)
{
    return amx_linear_silu_mul_bf16(x, m, k, w, inter, k, mid);
}
static int linear_dp(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                     void* out)
{
    return dp_linear_bf16(x, m, ldx, w, n, k, bias, 0, out);
}
/* A weight kept quantized (runtime/quant/weight.py), as quant_linear_f32 reads it: the "address" a
 * layer of the qf32 set gives for each linear. A weight in bands (QuantizedBands: a merged layer whose
 * parts' formats differ) is a chain: each band its `rows` output rows, the next band after them,
 * one quant_linear_f32 call per band into its columns of the output, as quant_kernels.py calls them. */
typedef struct QuantWeight {
    int64_t kind, group;
    const void* qs;
    const void* scales;              /* fp32, or the super-block form's codes (quant_layout.h) */
    const void* mins;
    const float* supers;             /* the super-block form's factors, or NULL (the plain form) */
    int64_t rows;                    /* this band's output rows */
    const struct QuantWeight* next;  /* the next band (NULL: the last) */
} QuantWeight;
/* out [m, n] fp32 (rows n apart) = x times the bands of w (+ bias); 0, or the first band's failure (or
 * -1 where the bands' rows do not add up to n). */
static int quant_bands(const float* x, int64_t m, int64_t ldx, const QuantWeight* w, int64_t n, int64_t k,
                       const float* bias, float* out)
{
    int64_t first = 0;
    for (const QuantWeight* q = w; q; q = q->next) {
        if (first + q->rows > n) return -1;
        const int rc = quant_linear_f32(x, m, ldx, (int)q->kind, q->qs, q->scales, q->mins, q->supers, q->group, q->rows, k,
                                        bias ? bias + first : 0, out + first, n);
        if (rc) return rc;
        first += q->rows;
    }
    return first == n ? 0 : -1;
}
static int linear_q(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                    void* out)
{
    return quant_bands((const float*)x, m, ldx, (const QuantWeight*)w, n, k, (const float*)bias, (float*)out);
}
/* The qbf16 set's linear: bf16 activations against a weight kept quantized, as the layer stack's
 * quant_linear runs them (runtime/engine/cpu/quant_kernels.py): each band through quant_linear_bf16
 * (the rows as they are), or, where it declines (a build without AVX512-BF16, many rows), x and the
 * bias widened to fp32 (exact) for quant_linear_f32; the fp32 result rounded to bf16 (nearest even).
 * The fp32 copies live in a buffer of the calling thread, grown to the largest call and kept. */
static _Thread_local float* qb_buffer;
static _Thread_local int64_t qb_floats;

static float* qb_scratch(int64_t floats)
{
    if (floats > qb_floats) {
        free(qb_buffer);
        const int64_t bytes = (floats * (int64_t)sizeof(float) + 63) / 64 * 64;
        qb_buffer = (float*)aligned_alloc(64, (size_t)bytes);
        qb_floats = qb_buffer ? floats : 0;
    }
    return qb_buffer;
}

static int linear_qb(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                     void* out)
{
    const int64_t x_floats = (m * k + 15) / 16 * 16, b_floats = (n + 15) / 16 * 16;
    float* of = qb_scratch(x_floats + b_floats + m * n);
    if (!of) return -1;
    float* bf = of + m * n;
    float* xf = bf + b_floats;
    const uint16_t* xb = (const uint16_t*)x;
    if (bias)
        for (int64_t j = 0; j < n; ++j) bf[j] = bf16_to_f32(((const uint16_t*)bias)[j]);
    int widened = 0;
    int64_t first = 0;
    for (const QuantWeight* q = (const QuantWeight*)w; q; q = q->next) {
        if (first + q->rows > n) return -1;
        const float* band_bias = bias ? bf + first : 0;
        if (quant_linear_bf16(xb, m, ldx, (int)q->kind, q->qs, q->scales, q->mins, q->supers, q->group, q->rows, k, band_bias,
                              of + first, n)) {
            if (!widened)
                for (int64_t r = 0; r < m; ++r)
                    for (int64_t j = 0; j < k; ++j) xf[r * k + j] = bf16_to_f32(xb[r * ldx + j]);
            widened = 1;
            const int rc = quant_linear_f32(xf, m, k, (int)q->kind, q->qs, q->scales, q->mins, q->supers, q->group, q->rows, k,
                                            band_bias, of + first, n);
            if (rc) return rc;
        }
        first += q->rows;
    }
    if (first != n) return -1;
    uint16_t* ob = (uint16_t*)out;
    for (int64_t i = 0; i < m * n; ++i) ob[i] = f32_to_bf16(of[i]);
    return 0;
}
static int linear_f(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                    void* out)
{
    return linear_f32(x, m, ldx, w, n, k, bias, out);
}

static int lora_bf16_v(const void* x, int64_t ldx, void* out, int64_t ldo, int64_t m, int64_t k, int64_t n,
                       const LoraLinear* w, const LoraRuns* r)
{
    return lora_add_bf16(x, ldx, out, ldo, m, k, n, w->a, w->b, r->slots, r->rank, w->parts, w->part_rows,
                         r->starts, r->run_slots, r->n);
}
static int lora_f32_v(const void* x, int64_t ldx, void* out, int64_t ldo, int64_t m, int64_t k, int64_t n,
                      const LoraLinear* w, const LoraRuns* r)
{
    return lora_add_f32(x, ldx, out, ldo, m, k, n, w->a, w->b, r->slots, r->rank, w->parts, w->part_rows, r->starts,
                        r->run_slots, r->n);
}

/* (without a fused gate/up, the two calls the layer stack makes: the linear, then silu*mul) */
static const Kernels AMX = {2, rmsnorm_bf16_v, linear_amx, rotary_bf16_v, prefix_bf16_v, decode_bf16_v, silu_mul_bf16_v,
                            gelu_tanh_mul_bf16_v, fused_gate_up_amx, lora_bf16_v, head_norm_bf16_v};
static const Kernels DP = {2,       rmsnorm_bf16_v,  linear_dp, rotary_bf16_v, prefix_bf16_v, decode_bf16_v,
                           silu_mul_bf16_v, gelu_tanh_mul_bf16_v, 0, lora_bf16_v, head_norm_bf16_v};
static const Kernels F32 = {4,       rmsnorm_f32_v, linear_f, rotary_f32_v, prefix_f32_v, decode_f32_v,
                            silu_mul_f32_v, gelu_tanh_mul_f32_v, 0, lora_f32_v, head_norm_f32_v};
static const Kernels QF32 = {4,       rmsnorm_f32_v, linear_q, rotary_f32_v, prefix_f32_v, decode_f32_v,
                             silu_mul_f32_v, gelu_tanh_mul_f32_v, 0, lora_f32_v, head_norm_f32_v};
static const Kernels QBF16 = {2,       rmsnorm_bf16_v, linear_qb, rotary_bf16_v, prefix_bf16_v, decode_bf16_v,
                              silu_mul_bf16_v, gelu_tanh_mul_bf16_v, 0, lora_bf16_v, head_norm_bf16_v};

/* The kernel of a sparse layer's router (moe_mlp.h: MOE_ROUTER_*): the set's linear, or in a set
 * whose linears read blocks, the dense kernel of its dtype that the router's plan gives. */
static MoeLinear router_linear(const Kernels* kn, int64_t code)
{
    switch (code) {
    case MOE_ROUTER_F32: return linear_f;
    case MOE_ROUTER_DP: return linear_dp;
    case MOE_ROUTER_AMX: return linear_amx;
    case MOE_ROUTER_DOT: return kn->elem == 2 ? moe_router_bf16 : moe_router_f32;
    default: return kn->linear;
    }
}

/* q, k and v of n rows of the qkv buffer clamped to +-clip in place (OLMoE's clip_qkv, after the q/k
 * norms): each value compared in fp32 and the bound rounded to the buffer's type, as torch's clamp_. */
static void clamp_rows(void* qkv, int64_t elem, int64_t n, int64_t cols, float clip)
{
    for (int64_t i = 0; i < n * cols; ++i) {
        if (elem == 2) {
            uint16_t* x = (uint16_t*)qkv + i;
            const float v = bf16_to_f32(*x);
            *x = v > clip ? f32_to_bf16(clip) : v < -clip ? f32_to_bf16(-clip) : *x;
        } else {
            float* x = (float*)qkv + i;
            *x = *x > clip ? clip : *x < -clip ? -clip : *x;
        }
    }
}

/* out += the step's adapter products for linear ``which`` of layer l, where it takes adapters; 0 or -1 */
static int add_lora(const Kernels* kn, const DecodeStep* s, const DecodeLayer* l, int which, const void* x,
                    int64_t ldx, void* out, int64_t k, int64_t n)
{
    const LoraLinear* w = &l->lora[which];
    if (!s->lora || !w->a) return 0;
    return kn->lora_add(x, ldx, out, n, s->n, k, n, w, s->lora) ? -1 : 0;
}

/* A windowed layer's KV write and attention: the new rows into its own pool (at win_out_loc), its
 * window's keys gathered from there (mirror_gather, as the backend's windowed path gathers them),
 * the decode kernel over them. 0, or the stage that refused. (A plain pool only: decode_layers.py
 * hands no quantized one with windowed layers.) */
static int attend_window(const Kernels* kn, const DecodeStep* s, const DecodeLayer* l)
{
    const int64_t n = s->n, hd = s->head_dim, group = s->q_heads / s->kv_heads;
    const int64_t q_cols = s->q_heads * hd, kv_cols = s->kv_heads * hd, qkv_cols = q_cols + 2 * kv_cols;
    const char* k_new = (const char*)s->qkv + q_cols * kn->elem;
    const char* v_new = (const char*)s->qkv + (q_cols + kv_cols) * kn->elem;
    if (s->kv_format != KV_PLAIN ||
        store_kv_rows(k_new, qkv_cols * kn->elem, v_new, qkv_cols * kn->elem, s->win_out_loc, n, kv_cols * kn->elem,
                      l->k_pool, l->v_pool, s->win_pool_slots) ||
        mirror_gather(l->k_pool, l->v_pool, s->win_pool_slots, s->win_slots, n, s->win_len, s->kv_heads, hd,
                      s->win_len, kn->elem, (char*)s->win_k, (char*)s->win_v))
        return STAGE_KV_STORE;
    if (kn->decode(s->qkv, qkv_cols, s->win_k, s->win_v, s->win_mask, s->win_len, s->win_len, s->attn, n,
                   s->kv_heads, group, hd, s->scale, 0, 0, 0, 0, 0, 0, 0, 0, n))
        return STAGE_ATTENTION;
    return 0;
}

/* A full-attention layer's KV write (the pool's format) and attention over the shared prefix and
 * the decode mirror, whose new key the attention kernel appends. 0, or the stage that refused. */
static int attend_mirror(const Kernels* kn, const DecodeStep* s, const DecodeLayer* l)
{
    const int64_t n = s->n, hd = s->head_dim, group = s->q_heads / s->kv_heads;
    const int64_t q_cols = s->q_heads * hd, kv_cols = s->kv_heads * hd, qkv_cols = q_cols + 2 * kv_cols;
    const char* k_new = (const char*)s->qkv + q_cols * kn->elem;
    const char* v_new = (const char*)s->qkv + (q_cols + kv_cols) * kn->elem;
    const int fmt = (int)s->kv_format;
    if (fmt == KV_PLAIN ? store_kv_rows(k_new, qkv_cols * kn->elem, v_new, qkv_cols * kn->elem, s->out_loc, n,
                                        kv_cols * kn->elem, l->k_pool, l->v_pool, s->pool_slots)
                        : store_kv_rows_q(k_new, qkv_cols * kn->elem, v_new, qkv_cols * kn->elem, kn->elem,
                                          s->out_loc, n, s->kv_heads, hd, fmt, l->k_scale, l->v_scale, l->k_pool,
                                          l->v_pool, s->pool_slots))
        return STAGE_KV_STORE;
    if (s->prefix_len > 0 &&
        kn->prefix(s->qkv, qkv_cols, l->prefix_k, l->prefix_v, s->prefix_len, s->prefix_pad, n, s->kv_heads,
                   group, hd, s->scale, s->prefix_out, s->prefix_lse))
        return STAGE_PREFIX;
    const float* init_o = s->prefix_len > 0 ? s->prefix_out : 0;
    const float* init_lse = s->prefix_len > 0 ? s->prefix_lse : 0;
    if (fmt == KV_PLAIN ? kn->decode(s->qkv, qkv_cols, l->k_t, l->v, s->mask, s->cap, s->width, s->attn, n,
                                     s->kv_heads, group, hd, s->scale, k_new, qkv_cols, v_new, qkv_cols,
                                     s->append_pos, init_o, init_lse, s->kv_row, s->kv_rows)
                        : decode_attention_q8(s->qkv, qkv_cols, kn->elem == 2, fmt, l->k_t, l->v, l->k_scales,
                                              l->v_scales, l->k_scale, l->v_scale, s->mask, s->cap, s->width,
                                              s->attn, 0, n, s->kv_heads, group, hd, s->scale, l->k_pool,
                                              l->v_pool, s->pool_slots, s->out_loc, s->append_pos, init_o,
                                              init_lse, s->kv_row, s->kv_rows))
        return STAGE_ATTENTION;
    return 0;
}

/* Returns 0, or -(layer * 16 + stage) for the first kernel that refused. */
static int run_layers(const Kernels* kn, const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    const int64_t n = s->n, hd = s->head_dim;
    const int64_t q_cols = s->q_heads * hd, kv_cols = s->kv_heads * hd, qkv_cols = q_cols + 2 * kv_cols;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecodeLayer* l = layers + i;
        const int fail = -(int)(i * 16);
        /* the first layer's residual is its input; later ones add the previous MLP output first */
        kn->rmsnorm(i == 0 ? s->residual : s->hidden_out, i == 0 ? 0 : s->residual, l->input_norm, n, s->hidden,
                    s->eps, s->normed);
        if (kn->linear(s->normed, n, s->hidden, l->qkv, qkv_cols, s->hidden, l->qkv_bias, s->qkv))
            return fail - STAGE_QKV;
        if (add_lora(kn, s, l, LORA_QKV, s->normed, s->hidden, s->qkv, s->hidden, qkv_cols)) return fail - STAGE_LORA;
        if (l->q_norm) { /* (describe_layers gives both norms or neither) */
            const int64_t q_parts = l->qk_whole ? 1 : s->q_heads, kv_parts = l->qk_whole ? 1 : s->kv_heads;
            kn->head_norm(s->qkv, n, qkv_cols, q_parts, q_cols / q_parts, l->q_norm, l->qk_eps);
            kn->head_norm((char*)s->qkv + q_cols * kn->elem, n, qkv_cols, kv_parts, kv_cols / kv_parts, l->k_norm,
                          l->qk_eps);
        }
        if (l->clip > 0) clamp_rows(s->qkv, kn->elem, n, qkv_cols, l->clip);
        kn->rotary(s->qkv, n, qkv_cols, s->q_heads + s->kv_heads, hd, s->rot_dim,
                   l->rope_table ? s->cos_local : s->cos, l->rope_table ? s->sin_local : s->sin);
        const int stage = l->windowed ? attend_window(kn, s, l) : attend_mirror(kn, s, l);
        if (stage) return fail - stage;
        if (kn->linear(s->attn, n, q_cols, l->o, s->hidden, q_cols, 0, s->o))
            return fail - STAGE_O;
        if (add_lora(kn, s, l, LORA_O, s->attn, q_cols, s->o, q_cols, s->hidden)) return fail - STAGE_LORA;
        if (l->pre_mlp_norm) { /* sandwich: the attention output normed alone, then added and normed again */
            kn->rmsnorm(s->o, 0, l->post_norm, n, s->hidden, s->eps, s->o);
            kn->rmsnorm(s->o, s->residual, l->pre_mlp_norm, n, s->hidden, s->eps, s->normed);
        } else {
            kn->rmsnorm(s->o, s->residual, l->post_norm, n, s->hidden, s->eps, s->normed);
        }
        if (l->moe) {
            const MoeKernels moe = {kn->elem, kn->linear, router_linear(kn, l->moe->router_kernel), kn->silu_mul,
                                    kn->fused_gate_up};
            if (moe_mlp(&moe, l->moe, s->normed, n, s->hidden, s->hidden_out)) return fail - STAGE_MLP;
            continue;
        }
        /* (an adapter's product joins gate/up before the activation: no fused pass then) */
        if (kn->fused_gate_up && s->activation == ACT_SILU && !(s->lora && l->lora[LORA_GATE_UP].a)) {
            if (kn->fused_gate_up(s->normed, n, l->gate_up, s->inter, s->hidden, s->mid)) return fail - STAGE_MLP;
        } else {
            if (kn->linear(s->normed, n, s->hidden, l->gate_up, 2 * s->inter, s->hidden, 0, s->gate_up))
                return fail - STAGE_MLP;
            if (add_lora(kn, s, l, LORA_GATE_UP, s->normed, s->hidden, s->gate_up, s->hidden, 2 * s->inter))
                return fail - STAGE_LORA;
            (s->activation == ACT_GELU_TANH ? kn->gelu_tanh_mul : kn->silu_mul)(s->gate_up, n, s->inter, s->mid);
        }
        /* (sandwich: the MLP's output goes through its own norm into hidden_out) */
        void* down_out = l->post_mlp_norm ? s->o : s->hidden_out;
        if (kn->linear(s->mid, n, s->inter, l->down, s->hidden, s->inter, 0, down_out))
            return fail - STAGE_DOWN;
        if (add_lora(kn, s, l, LORA_DOWN, s->mid, s->inter, down_out, s->inter, s->hidden))
            return fail - STAGE_LORA;
        if (l->post_mlp_norm) kn->rmsnorm(s->o, 0, l->post_mlp_norm, n, s->hidden, s->eps, s->hidden_out);
    }
    return 0;
}

int decode_layers_amx(const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    return run_layers(&AMX, s, layers, num_layers);
}

int decode_layers_dp(const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    return run_layers(&DP, s, layers, num_layers);
}

int decode_layers_f32(const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    return run_layers(&F32, s, layers, num_layers);
}

int decode_layers_qf32(const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    return run_layers(&QF32, s, layers, num_layers);
}

int decode_layers_qbf16(const DecodeStep* s, const DecodeLayer* layers, int64_t num_layers)
{
    return run_layers(&QBF16, s, layers, num_layers);
}
