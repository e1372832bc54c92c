/* Helpers shared by the CPU kernels' sources (csrc/ *.c, built together by
 * runtime/cpu/kernel_library.py at each instruction-set level): bf16 <-> fp32, a polynomial
 * exp, a row max, and their AVX-512 forms where the build targets AVX-512. */
#ifndef TINYSERVE_CPU_COMMON_H
#define TINYSERVE_CPU_COMMON_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

#define BLOCK 128      /* keys per online-softmax block */
#define MAX_G 16       /* query heads per KV head */
#define MAX_D 256      /* head dim */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* exp(x) for x <= 0 (-inf gives 0): 2^(x log2 e) from exponent bits and a degree-6 polynomial
 * in the fraction (coefficients highest first; fast_exp16 is the same on 16 lanes). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_MIN_T -126.0f   /* 2^t below this is a denormal: clamped */
#define EXP_ZERO_BELOW -87.0f
#define EXP_C6 1.535336188319500e-4f
#define EXP_C5 1.339887440266574e-3f
#define EXP_C4 9.618437357674640e-3f
#define EXP_C3 5.550332471162809e-2f
#define EXP_C2 2.402264791363012e-1f
#define EXP_C1 6.931472028550421e-1f
static inline float fast_exp(float x) {
    float t = x * EXP_LOG2E;
    t = t < EXP_MIN_T ? EXP_MIN_T : t;
    float fi = floorf(t);
    float f = t - fi;
    float p = EXP_C6;
    p = p * f + EXP_C5;
    p = p * f + EXP_C4;
    p = p * f + EXP_C3;
    p = p * f + EXP_C2;
    p = p * f + EXP_C1;
    p = p * f + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)fi + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return x < EXP_ZERO_BELOW ? 0.0f : p * scale;
}

/* A row pass's share [from, to) of the next weight block's lines (linear_f32.c, dp_linear.c),
 * fetched a few per chunk of the pass: lines per chunk rounded up, so the share is fetched within
 * the pass (one division per pass: a division per chunk cost as much as the chunk's products).
 * fetch_share_next moves `at` to the end of the lines due by the next chunk and returns where they
 * start. */
typedef struct { int64_t at, to, per_chunk; } FetchShare;
static inline FetchShare fetch_share(int64_t from, int64_t to, int64_t chunk, int64_t depth) {
    FetchShare share = {from, to, ((to - from) * chunk + depth - 1) / depth};
    return share;
}
static inline int64_t fetch_share_next(FetchShare* share) {
    const int64_t start = share->at;
    share->at = start + share->per_chunk < share->to ? start + share->per_chunk : share->to;
    return start;
}

/* max of x[0..n) (-inf for n == 0). */
static inline float row_max(const float* x, int64_t n) {
    float mx = -INFINITY;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(x + j));
    mx = _mm512_reduce_max_ps(vmx);
#endif
    for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
    return mx;
}

#ifdef __AVX512F__
static inline __m512 load_bf16x16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX512F__
/* f32_to_bf16 on 16 lanes (nearest-even, NaN kept quiet): one instruction with AVX512-BF16. */
static inline __m256i f32x16_to_bf16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet));
#endif
}

/* round_bf16 on 16 lanes. */
static inline __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(x)), 16));
}
#endif

#ifdef __AVX512F__
/* fast_exp on 16 lanes (x <= 0 or -inf). */
static inline __m512 fast_exp16(__m512 x)
{
    const __m512 t = _mm512_max_ps(_mm512_set1_ps(EXP_MIN_T), _mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fi), _mm512_set1_epi32(127)), 23);
    const __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_ZERO_BELOW), _CMP_NLT_UQ), r);
}
#endif

/* GELU's tanh form as a sigmoid: 0.5 x (1 + tanh(k (x + c x^3))) = x * sigmoid(z), z = 2k (x + c x^3)
 * (k = sqrt(2 / pi), c = 0.044715), one exp and no cancellation in 1 + tanh. */
#define GELU_2K 1.5957691216057308f
#define GELU_2KC 0.0713548162726f

#ifdef __AVX512F__
/* bf16(bf16(silu(g)) * u) on 16 lanes of bf16 values g (gate) and u (up), in fp32 as torch's bf16
 * silu and multiply round: silu(g) = g * (g >= 0 ? 1 : e) / (1 + e), e = exp(-|g|). */
static inline __m256i silu_mul16(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), one);
    const __m512 act = round_bf16x16(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))));
    return f32x16_to_bf16(_mm512_mul_ps(act, u));
}

/* bf16(bf16(gelu_tanh(g)) * u) on 16 lanes, as torch's bf16 F.gelu(approximate="tanh") then the
 * product round; sigmoid(z) = (z >= 0 ? 1 : e) / (1 + e), e = exp(-|z|), as silu_mul16. */
static inline __m256i gelu_tanh_mul16(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 z = _mm512_mul_ps(g, _mm512_add_ps(_mm512_set1_ps(GELU_2K),
                                                    _mm512_mul_ps(_mm512_set1_ps(GELU_2KC), _mm512_mul_ps(g, g))));
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
    const __m512 num = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ), one);
    const __m512 act = round_bf16x16(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))));
    return f32x16_to_bf16(_mm512_mul_ps(act, u));
}
#endif

#endif
