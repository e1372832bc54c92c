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
#include <immintrin.h>

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
    const int64_t n_super = count * (k / QSUPER), per_super = QSUPER / group;
    float* s = buf;
    float* mn = mins ? buf + count * per_row : NULL;
    const float* f = supers + o * (k / QSUPER) * 2; /* d, dmin of each super-block, row after row */
    int64_t i = 0;
    /* (a decode step is bound by these kernels' compute at one row: the codes are widened 16 at a time) */
    if (group == 16) {
        const int8_t* code = (const int8_t*)scales + o * per_row;
#if defined(__AVX512F__)
        for (; i < n_super; ++i)
            _mm512_storeu_ps(s + i * 16, _mm512_mul_ps(_mm512_set1_ps(f[2 * i]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                                                _mm_loadu_si128((const __m128i*)(code + i * 16))))));
#endif
        for (; i < n_super; ++i)
            for (int64_t j = 0; j < per_super; ++j) s[i * 16 + j] = f[2 * i] * (float)code[i * 16 + j];
    } else {
        const uint8_t* code = (const uint8_t*)scales + o * per_row;
        const uint8_t* mcode = (const uint8_t*)mins + o * per_row;
#if defined(__AVX512F__)
        /* two super-blocks a vector: lanes 0-7 the first's 8 codes, 8-15 the second's */
        const __m512i d_at = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i dmin_at = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
        for (; i + 2 <= n_super; i += 2) {
            const __m512 pair = _mm512_castps128_ps512(_mm_loadu_ps(f + 2 * i));
            const __m512 d = _mm512_permutexvar_ps(d_at, pair), dmin = _mm512_permutexvar_ps(dmin_at, pair);
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(code + i * 8))));
            const __m512 mc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mcode + i * 8))));
            _mm512_storeu_ps(s + i * 8, _mm512_mul_ps(d, sc));
            _mm512_storeu_si512(mn + i * 8, _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, mc)), sign));
        }
#endif
        for (; i < n_super; ++i)
            for (int64_t j = 0; j < per_super; ++j) {
                s[i * 8 + j] = f[2 * i] * (float)code[i * 8 + j];
                mn[i * 8 + j] = -(f[2 * i + 1] * (float)mcode[i * 8 + j]);
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
