/* RMSNorm of each attention head on its own (Qwen3's and Gemma 3's q/k norms, before RoPE): the
 * heads of a row are packed (d apart), the rows may be strided (the q or the k part of a fused
 * qkv output), and out may be x itself (the one-call decode stack norms its qkv buffer in place).
 *
 * Each head is one row of the plain RMSNorm kernel (rmsnorm_bf16 / rmsnorm_f32 over `heads` rows
 * of `d`), so the layer stack run one by one (runtime/engine/cpu/kernels.py) and the one-call
 * decode stack (decode_layers.c) give the same bits: both call this. A row of every token at
 * once where the rows are contiguous, else one call per token. Called by runtime/cpu/kernels.py
 * and decode_layers.c. */
#include "entry_points.h"

void rmsnorm_heads_bf16(const uint16_t* x, int64_t T, int64_t x_stride, int64_t heads, int64_t d,
                        const uint16_t* w, float eps, uint16_t* out, int64_t out_stride)
{
    if (x_stride == heads * d && out_stride == heads * d) {
        rmsnorm_bf16(x, 0, w, T * heads, d, eps, out);
        return;
    }
    for (int64_t t = 0; t < T; ++t) rmsnorm_bf16(x + t * x_stride, 0, w, heads, d, eps, out + t * out_stride);
}

void rmsnorm_heads_f32(const float* x, int64_t T, int64_t x_stride, int64_t heads, int64_t d, const float* w,
                       float eps, float* out, int64_t out_stride)
{
    if (x_stride == heads * d && out_stride == heads * d) {
        rmsnorm_f32(x, 0, w, T * heads, d, eps, out);
        return;
    }
    for (int64_t t = 0; t < T; ++t) rmsnorm_f32(x + t * x_stride, 0, w, heads, d, eps, out + t * out_stride);
}
