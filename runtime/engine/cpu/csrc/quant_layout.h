/* The two layouts of weights kept quantized (runtime/engine/quant/weight.py: q8 and q4), as the CPU
 * kernels that read them share them (quant_linear.c, quant_linear_bf16.c, quant_dequantize.c): the
 * block size, the bits of a kernel's `kind`, which groups each layout takes, and one row's values. */
#ifndef TINYSERVE_CPU_QUANT_LAYOUT_H
#define TINYSERVE_CPU_QUANT_LAYOUT_H
#include <stdint.h>
#include <stddef.h>

#define QBLOCK 32                   /* values per block */
#define QUANT_LAYOUT_Q4 1           /* kind bit 1: the q4 layout (else q8) */
#define QUANT_INT8_ACTIVATIONS 2    /* kind bit 2: quantize the activations to int8 for few rows */

/* Whether `kind` names a layout and numerics these kernels know, with groups that layout takes. */
static inline int takes_kind(int kind, const float* mins, int64_t group, int64_t k)
{
    if (kind & ~(QUANT_LAYOUT_Q4 | QUANT_INT8_ACTIVATIONS)) return 0;
    if (kind & QUANT_LAYOUT_Q4) return group == QBLOCK && mins != NULL;
    if (mins != NULL) return group == QBLOCK; /* q8 with a min per block of 32 (Q5_1, Q5_K) */
    return group == 16 || group == QBLOCK || group == k;
}

/* Weight row o's values [k0, k0 + kc) as fp32 into dst (kc a multiple of 32; q4: non-zero for the q4
 * layout; operands as quant_linear_f32's). */
void quant_dequantize_row(int q4, const uint8_t* qs, const float* scales, const float* mins, int64_t group,
                          int64_t k, int64_t o, int64_t k0, int64_t kc, float* dst);
#endif
