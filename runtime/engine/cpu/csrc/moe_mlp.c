/* A sparse layer's MLP for a decode step's rows, as the layers one by one compute it
 * (runtime/engine/layers/moe.py: SparseMoeMLP.forward, CpuOps.moe_experts), call for call:
 *
 * the router linear on the step's rows; routing (moe_route, the kernel CpuOps.moe_route runs: the
 * same bits on both paths); then for each expert in ascending id its routed (token, choice) pairs
 * in ascending flat order, the tokens' rows gathered, the gate/up linear and silu*mul (or the fused
 * AMX pass) and the down linear over those m rows, the very calls the expert loop makes with the
 * same row count; each output row times its routing weight, rounded to the step's type, added to
 * the token's sum (zero to begin with), in the same order as index_add_ adds them. In a bf16 step
 * the product of a bf16 output and an fp32 weight is rounded to bf16 before the bf16 add, as
 * torch's type promotion and `.to(x.dtype)` round it.
 *
 * Scratch is a buffer of the calling thread, grown to the largest step and kept. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "moe_mlp.h"

void moe_route(const void* logits, int64_t elem, int64_t T, int64_t E, int64_t top_k, int64_t renormalize,
               int64_t* ids, float* weights)
{
    float probs[E];
    for (int64_t t = 0; t < T; ++t) {
        float top = -INFINITY;
        for (int64_t e = 0; e < E; ++e) {
            const int64_t i = t * E + e;
            probs[e] = elem == 2 ? bf16_to_f32(((const uint16_t*)logits)[i]) : ((const float*)logits)[i];
            top = probs[e] > top ? probs[e] : top;
        }
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) {
            probs[e] = expf(probs[e] - top);
            sum += probs[e];
        }
        for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
        int64_t* row_ids = ids + t * top_k;
        float* row_w = weights + t * top_k;
        float chosen_sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                int taken = 0;
                for (int64_t c = 0; c < j; ++c) taken |= row_ids[c] == e;
                if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
            }
            row_ids[j] = best;
            row_w[j] = probs[best];
            chosen_sum += probs[best];
        }
        if (renormalize)
            for (int64_t j = 0; j < top_k; ++j) row_w[j] /= chosen_sum;
    }
}

int moe_router_bf16(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                    void* out)
{
    (void)bias;
    const uint16_t *xb = (const uint16_t*)x, *wb = (const uint16_t*)w;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t e = 0; e < n; ++e) {
            float acc = 0.f;
            for (int64_t j = 0; j < k; ++j) acc += bf16_to_f32(xb[r * ldx + j]) * bf16_to_f32(wb[e * k + j]);
            ((uint16_t*)out)[r * n + e] = f32_to_bf16(acc);
        }
    return 0;
}

int moe_router_f32(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                   void* out)
{
    (void)bias;
    const float *xf = (const float*)x, *wf = (const float*)w;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t e = 0; e < n; ++e) {
            float acc = 0.f;
            for (int64_t j = 0; j < k; ++j) acc += xf[r * ldx + j] * wf[e * k + j];
            ((float*)out)[r * n + e] = acc;
        }
    return 0;
}

static _Thread_local char* moe_buffer;
static _Thread_local int64_t moe_bytes;

static char* moe_scratch(int64_t bytes)
{
    if (bytes > moe_bytes) {
        free(moe_buffer);
        const int64_t size = (bytes + 63) / 64 * 64;
        moe_buffer = (char*)aligned_alloc(64, (size_t)size);
        moe_bytes = moe_buffer ? size : 0;
    }
    return moe_buffer;
}

static int64_t aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* out row += round(y row * w) in the step's type (the product then the sum, each rounded: no fused
 * multiply-add, as torch's two ops) */
__attribute__((optimize("fp-contract=off"))) static void add_weighted(int64_t elem, const void* y, float w,
                                                                       int64_t hidden, void* out)
{
    if (elem == 2) {
        const uint16_t* yb = (const uint16_t*)y;
        uint16_t* ob = (uint16_t*)out;
        for (int64_t c = 0; c < hidden; ++c) {
            const float product = round_bf16(bf16_to_f32(yb[c]) * w);
            ob[c] = f32_to_bf16(bf16_to_f32(ob[c]) + product);
        }
    } else {
        const float* yf = (const float*)y;
        float* of = (float*)out;
        for (int64_t c = 0; c < hidden; ++c) {
            volatile float product = yf[c] * w;
            of[c] = of[c] + product;
        }
    }
}

void moe_sigmoid(const void* x, int64_t elem, int64_t n, void* out)
{
    for (int64_t i = 0; i < n; ++i) {
        const float v = elem == 2 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
        const float s = 1.0f / (1.0f + expf(-v));
        if (elem == 2)
            ((uint16_t*)out)[i] = f32_to_bf16(s);
        else
            ((float*)out)[i] = s;
    }
}

/* The gated MLP of m rows (the set's fused gate/up or its linear then silu_mul; then down) into y. */
static int gated_mlp(const MoeKernels* kn, const void* rows, int64_t m, int64_t hidden, const void* gate_up_w,
                     const void* down_w, int64_t inter, void* gate_up, void* mid, void* y)
{
    if (kn->fused_gate_up) {
        if (kn->fused_gate_up(rows, m, gate_up_w, inter, hidden, mid)) return -1;
    } else {
        if (kn->linear(rows, m, hidden, gate_up_w, 2 * inter, hidden, 0, gate_up)) return -1;
        kn->silu_mul(gate_up, m, inter, mid);
    }
    return kn->linear(mid, m, inter, down_w, hidden, inter, 0, y);
}

int moe_mlp(const MoeKernels* kn, const MoeLayer* l, const void* x, int64_t n, int64_t hidden, void* out)
{
    const int64_t E = l->experts, k = l->top_k, el = kn->elem, pairs = n * k;
    const int64_t I = l->inter > l->shared_inter ? l->inter : l->shared_inter; /* (the scratch's widest) */
    const int64_t sizes[] = {
        aligned(n * (E > 2 ? E : 2) * el),  /* router logits (then the shared gate's logits and values) */
        aligned(pairs * 8),               /* ids */
        aligned(pairs * 4),               /* weights */
        aligned(pairs * 8),               /* one expert's pairs */
        aligned(n * hidden * el),         /* its tokens' rows */
        aligned(n * 2 * I * el),          /* gate/up */
        aligned(n * I * el),              /* silu(gate) * up */
        aligned(n * hidden * el),         /* down */
    };
    int64_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; ++i) total += sizes[i];
    char* p = moe_scratch(total);
    if (!p) return -1;
    void* logits = p;
    int64_t* ids = (int64_t*)(p += sizes[0]);
    float* weights = (float*)(p += sizes[1]);
    int64_t* chosen = (int64_t*)(p += sizes[2]);
    char* rows = p += sizes[3];
    char* gate_up = p += sizes[4];
    char* mid = p += sizes[5];
    char* y = p + sizes[6];
    if (kn->router_linear(x, n, hidden, l->router, E, hidden, 0, logits)) return -1;
    moe_route(logits, el, n, E, k, l->renormalize, ids, weights);
    if (el == 2 && l->round_weights)
        for (int64_t i = 0; i < pairs; ++i) weights[i] = round_bf16(weights[i]);
    memset(out, 0, (size_t)(n * hidden * el));
    for (int64_t e = 0; e < E; ++e) {
        int64_t m = 0;
        for (int64_t i = 0; i < pairs; ++i)
            if (ids[i] == e) chosen[m++] = i;
        if (!m) continue;
        for (int64_t j = 0; j < m; ++j)
            memcpy(rows + j * hidden * el, (const char*)x + chosen[j] / k * hidden * el, (size_t)(hidden * el));
        if (gated_mlp(kn, rows, m, hidden, l->gate_up[e], l->down[e], l->inter, gate_up, mid, y)) return -1;
        for (int64_t j = 0; j < m; ++j)
            add_weighted(el, y + j * hidden * el, weights[chosen[j]], hidden, (char*)out + chosen[j] / k * hidden * el);
    }
    if (l->shared_inter) { /* out + sigmoid(gate . x) * shared(x), each product and sum rounded as torch's */
        char* gate = (char*)logits;
        (el == 2 ? moe_router_bf16 : moe_router_f32)(x, n, hidden, l->shared_gate, 1, hidden, 0, gate);
        moe_sigmoid(gate, el, n, gate + n * el);
        if (gated_mlp(kn, x, n, hidden, l->shared_gate_up, l->shared_down, l->shared_inter, gate_up, mid, y)) return -1;
        for (int64_t r = 0; r < n; ++r) {
            const char* g = gate + (n + r) * el;
            const float w = el == 2 ? bf16_to_f32(*(const uint16_t*)g) : *(const float*)g;
            add_weighted(el, y + r * hidden * el, w, hidden, (char*)out + r * hidden * el);
        }
    }
    return 0;
}
