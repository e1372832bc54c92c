/* A vector of AV_W fp32 lanes, for the fp32 kernels (attention_f32.c, elementwise_f32.c): 16 with
 * AVX-512, 8 with AVX2 + FMA, one float in plain C, so each kernel body is written once and every
 * build level has it. The *_n forms touch only the first m lanes (a row's remainder). */
#ifndef TINYSERVE_CPU_LANES_F32_H
#define TINYSERVE_CPU_LANES_F32_H
#include "common.h"

#if defined(__AVX512F__)
#define AV_W 16
typedef __m512 av;
static inline av av_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void av_store(float* p, av x) { _mm512_storeu_ps(p, x); }
static inline av av_load_n(const float* p, int64_t m) {
    return m == AV_W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1u), p);
}
static inline void av_store_n(float* p, av x, int64_t m) {
    if (m == AV_W) _mm512_storeu_ps(p, x);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << m) - 1u), x);
}
static inline av av_set1(float x) { return _mm512_set1_ps(x); }
static inline av av_fma(av a, av b, av c) { return _mm512_fmadd_ps(a, b, c); }
static inline av av_add(av a, av b) { return _mm512_add_ps(a, b); }
static inline av av_sub(av a, av b) { return _mm512_sub_ps(a, b); }
static inline av av_mul(av a, av b) { return _mm512_mul_ps(a, b); }
static inline av av_div(av a, av b) { return _mm512_div_ps(a, b); }
static inline av av_max(av a, av b) { return _mm512_max_ps(a, b); }
static inline float av_hmax(av x) { return _mm512_reduce_max_ps(x); }
static inline float av_hsum(av x) { return _mm512_reduce_add_ps(x); }
static inline av av_exp_neg(av x) { return fast_exp16(x); }
#elif defined(__AVX2__) && defined(__FMA__)
#define AV_W 8
typedef __m256 av;
static inline __m256i av_lanes_below(int64_t m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline av av_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void av_store(float* p, av x) { _mm256_storeu_ps(p, x); }
static inline av av_load_n(const float* p, int64_t m) {
    return m == AV_W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, av_lanes_below(m));
}
static inline void av_store_n(float* p, av x, int64_t m) {
    if (m == AV_W) _mm256_storeu_ps(p, x);
    else _mm256_maskstore_ps(p, av_lanes_below(m), x);
}
static inline av av_set1(float x) { return _mm256_set1_ps(x); }
static inline av av_fma(av a, av b, av c) { return _mm256_fmadd_ps(a, b, c); }
static inline av av_add(av a, av b) { return _mm256_add_ps(a, b); }
static inline av av_sub(av a, av b) { return _mm256_sub_ps(a, b); }
static inline av av_mul(av a, av b) { return _mm256_mul_ps(a, b); }
static inline av av_div(av a, av b) { return _mm256_div_ps(a, b); }
static inline av av_max(av a, av b) { return _mm256_max_ps(a, b); }
static inline float av_hmax(av x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline float av_hsum(av x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* fast_exp (common.h) on 8 lanes: x <= 0 or -inf. */
static inline av av_exp_neg(av x) {
    const av t = _mm256_max_ps(_mm256_set1_ps(EXP_MIN_T), _mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)));
    const av fi = _mm256_floor_ps(t);
    const av f = _mm256_sub_ps(t, fi);
    av p = _mm256_set1_ps(EXP_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fi), _mm256_set1_epi32(127)), 23);
    const av r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(EXP_ZERO_BELOW), _CMP_NLT_UQ));
}
#else
#define AV_W 1
typedef float av;
static inline av av_load(const float* p) { return *p; }
static inline void av_store(float* p, av x) { *p = x; }
static inline av av_load_n(const float* p, int64_t m) { (void)m; return *p; }
static inline void av_store_n(float* p, av x, int64_t m) { (void)m; *p = x; }
static inline av av_set1(float x) { return x; }
static inline av av_fma(av a, av b, av c) { return a * b + c; }
static inline av av_add(av a, av b) { return a + b; }
static inline av av_sub(av a, av b) { return a - b; }
static inline av av_mul(av a, av b) { return a * b; }
static inline av av_div(av a, av b) { return a / b; }
static inline av av_max(av a, av b) { return a > b ? a : b; }
static inline float av_hmax(av x) { return x; }
static inline float av_hsum(av x) { return x; }
static inline av av_exp_neg(av x) { return fast_exp(x); }
#endif

#endif
