/* Prototypes of the kernels that one source calls from another (decode_layers.c runs a whole
 * decode step through them); each defining source includes this header, so the compiler
 * checks every definition against the prototype the callers use. */
#ifndef TINYSERVE_CPU_ENTRY_POINTS_H
#define TINYSERVE_CPU_ENTRY_POINTS_H
#include <stdint.h>

void rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, int64_t rows, int64_t hidden,
                  float eps, uint16_t* out);
void rotary_bf16(uint16_t* x, int64_t T, int64_t row_stride, int64_t heads, int64_t d, int64_t rot_dim,
                 const uint16_t* cos, const uint16_t* sin);
/* cpu_kernels.c: pool rows at loc [n * w] into a decode mirror's K^T [n, hkv, d, cap] and V [n, hkv, cap, d] */
int mirror_gather(const char* k_pool, const char* v_pool, int64_t slots, const int64_t* loc, int64_t n, int64_t w,
                  int64_t hkv, int64_t d, int64_t cap, int64_t elem, char* kt, char* v);
int store_kv_rows(const char* k, int64_t k_stride, const char* v, int64_t v_stride, const int64_t* loc,
                  int64_t n, int64_t row_bytes, char* k_buf, char* v_buf, int64_t slots);
/* kv_quant.c: a quantized KV pool's write (kv_codes.h names the formats) */
int store_kv_rows_q(const char* k, int64_t k_stride, const char* v, int64_t v_stride, int64_t elem,
                    const int64_t* loc, int64_t n, int64_t hkv, int64_t d, int fmt, float k_scale, float v_scale,
                    char* k_buf, char* v_buf, int64_t slots);
/* attention_q8.c: decode attention over a quantized decode mirror */
int decode_attention_q8(
    const void* q, int64_t q_stride, int q_bf16, int fmt,
    uint8_t* kt, uint8_t* v, float* ks, float* vs, float k_scale, float v_scale,
    const float* bias, int64_t cap, int64_t width,
    void* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const char* k_pool, const char* v_pool, int64_t pool_slots, const int64_t* loc, const int64_t* pos,
    const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows);
int decode_attention_bf16(
    const uint16_t* q, int64_t q_stride,
    uint16_t* kt, uint16_t* v, const float* bias, int64_t cap, int64_t width,
    uint16_t* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const uint16_t* k_new, int64_t k_new_stride, const uint16_t* v_new, int64_t v_new_stride, const int64_t* pos,
    const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows);
int prefix_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp,
                          int64_t p, int64_t p_pad, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
                          float* out, float* lse);
int amx_linear_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t n, int64_t k,
                    const uint16_t* bias, int float_out, void* out);
int amx_linear_silu_mul_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t inter,
                             int64_t k, uint16_t* out);
int dp_linear_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t n, int64_t k,
                   const uint16_t* bias, int float_out, void* out);
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out);
void gelu_tanh_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out);

void rmsnorm_f32(const float* x, float* residual, const float* w, int64_t rows, int64_t hidden, float eps,
                 float* out);
/* head_norm.c: RMSNorm of each head of strided rows of packed heads (out may be x) */
void rmsnorm_heads_bf16(const uint16_t* x, int64_t T, int64_t x_stride, int64_t heads, int64_t d,
                        const uint16_t* w, float eps, uint16_t* out, int64_t out_stride);
void rmsnorm_heads_f32(const float* x, int64_t T, int64_t x_stride, int64_t heads, int64_t d, const float* w,
                       float eps, float* out, int64_t out_stride);
void rotary_f32(float* x, int64_t T, int64_t row_stride, int64_t heads, int64_t d, int64_t rot_dim,
                const float* cos, const float* sin);
void silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, float* out);
void gelu_tanh_mul_f32(const float* gate_up, int64_t rows, int64_t inter, float* out);
int linear_f32(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t k,
               const float* bias, float* out);
int quant_dequantize_f32(int kind, const void* qs, const void* scales, const void* mins, const float* supers,
                         int64_t group, int64_t n, int64_t k, float* out);
int quant_dequantize_bf16(int kind, const void* qs, const void* scales, const void* mins, const float* supers,
                          int64_t group, int64_t n, int64_t k, uint16_t* out);
int quant_linear_f32(const float* x, int64_t m, int64_t ldx, int kind, const void* qs, const void* scales,
                     const void* mins, const float* supers, int64_t group, int64_t n, int64_t k, const float* bias,
                     float* out, int64_t ldo);
/* quant_linear_bf16.c: the same weights, a few rows of bf16 activations (AVX512-BF16 builds; else -1) */
int quant_linear_bf16(const uint16_t* x, int64_t m, int64_t ldx, int kind, const void* qs, const void* scales,
                      const void* mins, const float* supers, int64_t group, int64_t n, int64_t k, const float* bias,
                      float* out, int64_t ldo);
int decode_attention_f32(
    const float* q, int64_t q_stride,
    float* kt, float* v, const float* bias, int64_t cap, int64_t width,
    float* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const float* k_new, int64_t k_new_stride, const float* v_new, int64_t v_new_stride, const int64_t* pos,
    const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows);
int prefix_attention_f32(const float* q, int64_t q_stride, const float* kp, const float* v, int64_t p,
                         int64_t p_pad, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
                         float* out, float* lse);

/* lora.c: multi-LoRA's shrink and expand of one linear (runtime/engine/ops/lora.py's meaning) */
int lora_add_f32(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t T, int64_t K, int64_t N,
                 const float* a, const float* b, int64_t S, int64_t R, int64_t P, const int64_t* part_rows,
                 const int32_t* starts, const int32_t* slots, int64_t n);
int lora_add_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t ldo, int64_t T, int64_t K, int64_t N,
                  const uint16_t* a, const uint16_t* b, int64_t S, int64_t R, int64_t P, const int64_t* part_rows,
                  const int32_t* starts, const int32_t* slots, int64_t n);

#endif
