/* A weight kept quantized, dequantized (the q8 and q4 layouts: quant_layout.h): one row's values, which
 * quant_linear.c's tiles multiply in cache, and the whole weight in fp32 or rounded to bf16, which a
 * product of many rows hands to the BLAS (runtime/engine/cpu/quant_kernels.py): its blocking for large
 * products beats the kernels' tiles, and the conversion is one pass over the weight. */
#include "common.h"
#include "entry_points.h"
#include "quant_layout.h"

#define DEQ_CHUNK 512  /* values of a row converted to bf16 from a buffer in L1 */

void quant_dequantize_row(int q4, const uint8_t* qs, const float* ws, const float* wm, int64_t group, int64_t k,
                          int64_t o, int64_t k0, int64_t kc, float* dst)
{
    for (int64_t b = k0 / QBLOCK; b < (k0 + kc) / QBLOCK; ++b, dst += QBLOCK) {
        if (q4) {
            const uint8_t* w = qs + o * (k / 2) + b * (QBLOCK / 2);
            const float sc = ws[b], mn = wm[b];
#if defined(__AVX2__)
            const __m128i raw = _mm_loadu_si128((const __m128i*)w);
            const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
            const __m256 vs = _mm256_set1_ps(sc), vm = _mm256_set1_ps(mn);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int j = 0; j < 4; ++j)
                _mm256_storeu_ps(dst + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), vs, vm));
#else
            for (int j = 0; j < QBLOCK / 2; ++j) {
                dst[j] = sc * (float)(w[j] & 0x0F) + mn;
                dst[j + QBLOCK / 2] = sc * (float)(w[j] >> 4) + mn;
            }
#endif
        } else {
            const int8_t* w = (const int8_t*)qs + o * k + b * QBLOCK;
            const float mn = wm ? wm[b] : 0.0f; /* (mins come with groups of 32) */
            for (int half = 0; half < 2; ++half) {
                const float sc = ws[(b * QBLOCK + half * 16) / group];
#if defined(__AVX2__)
                const __m256 vs = _mm256_set1_ps(sc);
                for (int j = 0; j < 16; j += 8) {
                    const __m128i raw = _mm_loadl_epi64((const __m128i*)(w + half * 16 + j));
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                    _mm256_storeu_ps(dst + half * 16 + j,
                                     wm ? _mm256_fmadd_ps(q, vs, _mm256_set1_ps(mn)) : _mm256_mul_ps(q, vs));
                }
#else
                for (int j = 0; j < 16; ++j)
                    dst[half * 16 + j] = wm ? sc * (float)w[half * 16 + j] + mn : sc * (float)w[half * 16 + j];
#endif
            }
        }
    }
}

/* The whole weight dequantized: out [n, k] fp32 (kind, layouts and groups as quant_linear_f32's).
 * Returns 0, or -1 (nothing written) for operands quant_linear_f32 would not take. */
int quant_dequantize_f32(int kind, const void* qs, const void* scales, const void* mins, const float* supers,
                         int64_t group, int64_t n, int64_t k, float* out)
{
    if (n < 1 || k < QBLOCK || k % QBLOCK || !takes_kind(kind, mins, supers, group, k)) return -1;
    const int q4 = kind & QUANT_LAYOUT_Q4;
#pragma omp parallel
    {
        float buf[ROW_SCALES_FLOATS(1, k) + 1];
#pragma omp for schedule(static)
        for (int64_t o = 0; o < n; ++o) {
            const float *ws, *wm;
            row_scales(scales, mins, supers, group, k, o, 1, buf, &ws, &wm);
            quant_dequantize_row(q4, (const uint8_t*)qs, ws, wm, group, k, o, 0, k, out + o * k);
        }
    }
    return 0;
}

/* quant_dequantize_f32's values rounded to bf16 (nearest even) into out [n, k]: a product of many
 * bf16 rows on the dequantized weight reads half the bytes, and no fp32 copy is written first. */
int quant_dequantize_bf16(int kind, const void* qs, const void* scales, const void* mins, const float* supers,
                          int64_t group, int64_t n, int64_t k, uint16_t* out)
{
    if (n < 1 || k < QBLOCK || k % QBLOCK || !takes_kind(kind, mins, supers, group, k)) return -1;
    const int q4 = kind & QUANT_LAYOUT_Q4;
#pragma omp parallel
    {
        float row[DEQ_CHUNK] __attribute__((aligned(64)));
        float buf[ROW_SCALES_FLOATS(1, k) + 1];
#pragma omp for schedule(static)
        for (int64_t o = 0; o < n; ++o) {
            const float *ws, *wm;
            row_scales(scales, mins, supers, group, k, o, 1, buf, &ws, &wm);
            for (int64_t k0 = 0; k0 < k; k0 += DEQ_CHUNK) {
                const int64_t kc = k - k0 < DEQ_CHUNK ? k - k0 : DEQ_CHUNK;
                quant_dequantize_row(q4, (const uint8_t*)qs, ws, wm, group, k, o, k0, kc, row);
                int64_t j = 0;
#if defined(__AVX512F__)
                for (; j + 16 <= kc; j += 16)
                    _mm256_storeu_si256((__m256i*)(out + o * k + k0 + j), f32x16_to_bf16(_mm512_load_ps(row + j)));
#endif
                for (; j < kc; ++j) out[o * k + k0 + j] = f32_to_bf16(row[j]);
            }
        }
    }
    return 0;
}

