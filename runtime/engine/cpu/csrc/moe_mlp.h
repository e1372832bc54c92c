/* A sparse (mixture-of-experts) layer's MLP for a decode step's rows (moe_mlp.c), as the one-call
 * decode stack (decode_layers.c) runs it in a layer's MLP step, and the routing kernel the layers
 * one by one run too (runtime/engine/cpu/ops.py: CpuOps.moe_route), so both paths route alike. */
#ifndef TINYSERVE_CPU_MOE_MLP_H
#define TINYSERVE_CPU_MOE_MLP_H
#include <stdint.h>

/* The linear and activation kernels of one of decode_layers.c's kernel sets, in its terms. */
typedef int (*MoeLinear)(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k,
                         const void* bias, void* out);
typedef void (*MoeSiluMul)(const void* gate_up, int64_t rows, int64_t inter, void* out);
typedef int (*MoeFusedGateUp)(const void* x, int64_t m, const void* w, int64_t inter, int64_t k, void* mid);

typedef struct {
    int64_t elem;             /* bytes per activation: 2 (bf16) or 4 (fp32) */
    MoeLinear linear;         /* the experts' linear (the set's) */
    MoeLinear router_linear;  /* the router's (the set's, or a dense kernel of its dtype: MoeLayer.router_kernel) */
    MoeSiluMul silu_mul;
    MoeFusedGateUp fused_gate_up;  /* NULL: gate/up linear, then silu_mul */
} MoeKernels;

/* Which kernel runs the router in a set whose linears read quantized blocks (a GGUF file keeps its
 * router dense): the set's own, or the dense kernel of its dtype the router's plan gives. */
enum { MOE_ROUTER_SET = 0, MOE_ROUTER_F32, MOE_ROUTER_DP, MOE_ROUTER_AMX, MOE_ROUTER_DOT };

/* A router whose weight no kernel set reads (too few experts for a packed copy: MOE_ROUTER_DOT):
 * out [m, E] = x [m, k] (rows ldx apart) times w [E, k], as plain dot products in fp32 rounded to
 * the type (CpuOps.moe_route runs it too). The bias is unused (routers have none); returns 0. */
int moe_router_bf16(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                    void* out);
int moe_router_f32(const void* x, int64_t m, int64_t ldx, const void* w, int64_t n, int64_t k, const void* bias,
                   void* out);

/* One sparse layer (runtime/engine/cpu/stack_description.py: CMoeLayer). */
typedef struct MoeLayer {
    int64_t experts, top_k, inter;  /* E, k, each expert's intermediate size I */
    int64_t renormalize;            /* the top-k weights divided by their sum */
    int64_t round_weights;          /* the weights rounded to bf16 in a bf16 step (weights_in_model_dtype) */
    int64_t router_kernel;          /* MOE_ROUTER_* */
    const void* router;             /* [E, hidden], the address its kernel reads */
    const void* const* gate_up;     /* [E]: each expert's [2 I, hidden] (gate rows first) */
    const void* const* down;        /* [E]: [hidden, I] */
    /* an always-on shared expert (Qwen2-MoE; shared_inter 0: none): its output times
     * sigmoid(shared_gate . x) added after the routed experts' */
    int64_t shared_inter;
    const void* shared_gate;        /* [1, hidden] dense, in the step's type (moe_router_*'s dot products) */
    const void* shared_gate_up;     /* [2 shared_inter, hidden], the set's linear */
    const void* shared_down;        /* [hidden, shared_inter] */
} MoeLayer;

/* out [n, hidden] (the step's element type) = the sparse MLP of x [n, hidden]; 0, or -1 where a
 * kernel refused or scratch could not be allocated. */
int moe_mlp(const MoeKernels* kn, const MoeLayer* l, const void* x, int64_t n, int64_t hidden, void* out);

/* out[i] = sigmoid(x[i]) for n values of the type (elem 2: bf16, else fp32), in fp32 then rounded to
 * the type: the shared expert's gate, here and in the layers one by one (CpuOps.moe_shared_gate). */
void moe_sigmoid(const void* x, int64_t elem, int64_t n, void* out);

/* Each row's top_k experts from its router logits [T, E] (bf16 with elem 2, else fp32): softmax in
 * fp32, the k largest (the lower id first among equals), renormalised where asked; ids int64
 * [T, k] and fp32 weights [T, k] in that (descending) order. */
void moe_route(const void* logits, int64_t elem, int64_t T, int64_t E, int64_t top_k, int64_t renormalize,
               int64_t* ids, float* weights);
#endif
