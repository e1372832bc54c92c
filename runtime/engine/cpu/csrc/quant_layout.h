/* The two layouts of weights kept quantized (runtime/engine/quant/weight.py: q8 and q4), as the CPU
 * kernels that read them share them (quant_linear.c, quant_linear_bf16.c, quant_dequantize.c): the
 * block size, the bits of a kernel's `kind`, which groups each layout takes, one row's values, and the
 * two forms of their scales and mins: fp32 per group (plain), or a K-quant's super-block form, an
 * 8-bit code per group and an fp32 factor per 256 values (`supers` not NULL), which the kernels decode
 * a weight row at a time into the plain form's values (row_scales): the same fp32 products the loader
 * would have stored, at 3 bytes per 32 values instead of 8. */
#ifndef TINYSERVE_CPU_QUANT_LAYOUT_H
#define TINYSERVE_CPU_QUANT_LAYOUT_H
#include <stdint.h>
#include <stddef.h>

#define QBLOCK 32                   /* values per block */
#define QUANT_LAYOUT_Q4 1           /* kind bit 1: the q4 layout (else q8) */
#define QUANT_INT8_ACTIVATIONS 2    /* kind bit 2: quantize the activations to int8 for few rows */
#define QSUPER 256                  /* values per super-block (the super-block form's factors) */

/* Whether `kind` names a layout and numerics these kernels know, with groups that layout takes (and,
 * in the super-block form, groups it has codes for: 16 without mins (Q6_K), 32 with (Q4_K, Q5_K)). */
static inline int takes_kind(int kind, const void* mins, const float* supers, int64_t group, int64_t k)
{
    if (kind & ~(QUANT_LAYOUT_Q4 | QUANT_INT8_ACTIVATIONS)) return 0;
    if (supers != NULL && (k % QSUPER || (group == 16) == (mins != NULL) || (group != 16 && group != QBLOCK)))
        return 0;
    if (kind & QUANT_LAYOUT_Q4) return group == QBLOCK && mins != NULL;
    if (mins != NULL) return group == QBLOCK; /* q8 with a min per block of 32 (Q5_1, Q5_K) */
    return group == 16 || group == QBLOCK || group == k;
}

/* Floats row_scales may write for `count` rows of a weight of k columns (a caller's buffer). */
#define ROW_SCALES_FLOATS(count, k) (2 * (count) * ((k) / 16))

/* Weight rows [o, o + count)'s scales, and mins (*wm NULL without), as fp32, k / group apart: in the
 * plain form the weight's own; in the super-block form (supers [n, k / 256, 2]: d and dmin) decoded into
 * buf from the codes, scale = d * code and min = -(dmin * min code), the loader's fp32 products
 * (runtime/engine/quant/gguf_blocks.py). Codes: int8 per 16 values (group 16), else uint8 per 32. */
static inline void row_scales(const void* scales, const void* mins, const float* supers, int64_t group, int64_t k,
                              int64_t o, int64_t count, float* buf, const float** ws, const float** wm)
{
    const int64_t per_row = k / group;
    if (supers == NULL) {
        *ws = (const float*)scales + o * per_row;
        *wm = mins ? (const float*)mins + o * per_row : NULL;
        return;
    }
    const int64_t n_super = k / QSUPER, per_super = QSUPER / group;
    float* s = buf;
    float* mn = mins ? buf + count * per_row : NULL;
    for (int64_t i = 0; i < count * n_super; ++i) {
        const float d = supers[(o * n_super + i) * 2], dmin = supers[(o * n_super + i) * 2 + 1];
        const int64_t at = i * per_super;
        if (group == 16) {
            const int8_t* code = (const int8_t*)scales + o * per_row + at;
            for (int64_t j = 0; j < per_super; ++j) s[at + j] = d * (float)code[j];
        } else {
            const uint8_t* code = (const uint8_t*)scales + o * per_row + at;
            const uint8_t* mcode = (const uint8_t*)mins + o * per_row + at;
            for (int64_t j = 0; j < per_super; ++j) {
                s[at + j] = d * (float)code[j];
                mn[at + j] = -(dmin * (float)mcode[j]);
            }
        }
    }
    *ws = s;
    *wm = mn;
}

/* Weight row o's values [k0, k0 + kc) as fp32 into dst (kc a multiple of 32; q4: non-zero for the q4
 * layout; ws and wm: the row's fp32 scales and mins (row_scales), wm NULL without). */
void quant_dequantize_row(int q4, const uint8_t* qs, const float* ws, const float* wm, int64_t group, int64_t k,
                          int64_t o, int64_t k0, int64_t kc, float* dst);
#endif
