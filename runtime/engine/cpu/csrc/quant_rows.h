/* What a few-row kernel on kept blocks beside quant_linear.c needs of its layout (quant_linear_bf16.c):
 * the layout constants and the threads' split, and the block terms a weight's mins and its values'
 * offset add to a dot product. */
#ifndef TINYSERVE_CPU_QUANT_ROWS_H
#define TINYSERVE_CPU_QUANT_ROWS_H
#include "common.h"

#define QROW_BLOCK 32          /* values per block (a scale and a min each, in q4) */
#define QROW_LAYOUT_Q4 1       /* quant_linear.c's kind bits: the q4 layout */
#define QROW_INT8_ACTIVATIONS 2 /* ... and int8 activations (not these kernels') */
#define QROW_ROWS 8            /* activation rows per pass over a weight row */
#define QROW_CHUNK 8           /* weight rows per chunk of the threads' split */

#if defined(__AVX512F__)
/* sum over blocks b < nb of (m_b + offset s_b) * xs_b (wm NULL: no mins): the share of a dot product
 * that the weight's mins, and the offset its values were given, add through the rows' block sums xs. */
static inline float block_terms(float offset, const float* ws, const float* wm, int64_t nb, const float* xs)
{
    __m512 acc = _mm512_setzero_ps();
    const __m512 by = _mm512_set1_ps(offset);
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 lanes = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        const __m512 s = _mm512_maskz_loadu_ps(lanes, ws + b);
        const __m512 m = wm ? _mm512_maskz_loadu_ps(lanes, wm + b) : _mm512_setzero_ps();
        acc = _mm512_fmadd_ps(_mm512_fmadd_ps(by, s, m), _mm512_maskz_loadu_ps(lanes, xs + b), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

#endif
