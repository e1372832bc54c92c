/* fp32 elementwise kernels of the decoder layer: silu*mul, RMSNorm (residual add fused) and
 * rotary embedding, each computing torch's fp32 formula in one pass over memory (torch runs
 * each of them as several ops, each its own pass). Called by runtime/cpu/kernels.py.
 *
 * Written once over a small vector layer: 16 lanes of AVX-512 where the build has them, 8 of
 * AVX2 + FMA, else one float (plain C). A row's remainder (fewer than W elements) goes through
 * masked loads and stores, so every loop body exists once. */
/* Every operation here rounds where torch's does: no FMA contraction (a*b+c rounds once) and
 * no reassociation (the library builds with -fassociative-math), in this file only. Set
 * before the includes so that the intrinsics inline with the same options. */
#if defined(__clang__)
#pragma clang fp contract(off)
#pragma clang fp reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#endif
#include "common.h"

/* Below this many elements a call runs on the calling thread: forking the OpenMP team costs
 * more than the work (a one-request decode step's norm is one row of ~1-4 K floats). */
#define PAR_MIN_ELEMS 16384

#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
static inline vf v_load_n(const float* p, int64_t m) {
    return m == W ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1u), p);
}
static inline void v_store_n(float* p, vf x, int64_t m) {
    if (m == W) _mm512_storeu_ps(p, x);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << m) - 1u), x);
}
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vf;
static inline __m256i lanes_below(int64_t m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf v_load_n(const float* p, int64_t m) {
    return m == W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(m));
}
static inline void v_store_n(float* p, vf x, int64_t m) {
    if (m == W) _mm256_storeu_ps(p, x);
    else _mm256_maskstore_ps(p, lanes_below(m), x);
}
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float v_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define W 1
typedef float vf;
static inline vf v_load_n(const float* p, int64_t m) { (void)m; return *p; }
static inline void v_store_n(float* p, vf x, int64_t m) { (void)m; *p = x; }
static inline vf v_set1(float x) { return x; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_div(vf a, vf b) { return a / b; }
static inline vf v_fmadd(vf a, vf b, vf c) { return a * b + c; }
static inline float v_sum(vf a) { return a; }
#endif

static inline int64_t lanes(int64_t left) { return left < W ? left : W; }

/* exp(x) within ~1-2 ulp (torch's vectorised exp is within 1) for x up to overflow (inf above
 * ~88.72, NaN kept); results below ~2^-125 become 0 (they do not change 1 + exp(x), all silu
 * needs). x = n ln2 + r, |r| <= ln2/2 (Cody-Waite: ln2 in two parts), exp(r) by Cephes' expf
 * polynomial (explicit FMAs), times 2^n as 2p * 2^(n-1) so that n = 128 still fits the
 * exponent field. Plain C calls libm's expf. */
#if W > 1
#define EXPF_LN2_HI 0.693359375f
#define EXPF_LN2_LO -2.12194440e-4f
#if W == 16
static inline vf v_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf v_clamp(vf x, float lo, float hi) {  /* NaN stays NaN: max/min return x then */
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x));
}
static inline vf v_pow2_minus1(vf n) {  /* 2^(n - 1) for integral n in [-126, 128] (0 at -126) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23));
}
#else
static inline vf v_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf v_clamp(vf x, float lo, float hi) {
    return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
static inline vf v_pow2_minus1(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23));
}
#endif
static inline vf v_exp(vf x) {
    x = v_clamp(x, -87.0f, 89.0f);  /* n in [-126, 128]: inf at the top, 0 at the bottom */
    const vf n = v_round(v_mul(x, v_set1(EXP_LOG2E)));
    vf r = v_fnmadd(n, v_set1(EXPF_LN2_HI), x);
    r = v_fnmadd(n, v_set1(EXPF_LN2_LO), r);
    vf p = v_set1(1.9875691500e-4f);
    p = v_fmadd(p, r, v_set1(1.3981999507e-3f));
    p = v_fmadd(p, r, v_set1(8.3334519073e-3f));
    p = v_fmadd(p, r, v_set1(4.1665795894e-2f));
    p = v_fmadd(p, r, v_set1(1.6666665459e-1f));
    p = v_fmadd(p, r, v_set1(5.0000001201e-1f));
    p = v_add(v_fmadd(p, v_mul(r, r), r), v_set1(1.0f));
    return v_mul(v_add(p, p), v_pow2_minus1(n));  /* 2p exactly, one rounding: no product to reorder */
}
#else
static inline vf v_exp(vf x) { return expf(x); }
#endif

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] (gate first), silu(x) =
 * x / (1 + exp(-x)) rounded before the product: torch's F.silu(gate).mul_(up). */
void silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, float* out)
{
#pragma omp parallel for schedule(static) if (rows * inter >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        for (int64_t j = 0; j < inter; j += W) {
            const int64_t m = lanes(inter - j);
            const vf x = v_load_n(g + j, m);
            const vf silu = v_div(x, v_add(v_set1(1.0f), v_exp(v_sub(v_set1(0.0f), x))));
            v_store_n(o + j, v_mul(silu, v_load_n(u + j, m)), m);
        }
    }
}

/* The sum of squares of v[0..n) in exactly torch's order, so that RMSNorm's statistic (and
 * with it every output) is bit-identical to torch's x.pow(2).mean(-1): aten's cascade sum
 * (SumKernel.cpp) over vectors of L = 8 floats (its sum kernel is registered for AVX2 and
 * below only, so 8 lanes on every x86 host; L = 1 for rows shorter than that): four
 * interleaved partial sums of L lanes, each a 4-level cascade of chunks of
 * 2^max(4, ceil(log2(size)) / 4) vectors (less rounding error than one running sum), the
 * vectors past the last group of four into partial 0, the partials summed, then 0 + the
 * row's scalar tail + the L lanes in order. Each square is rounded (torch materialises
 * x.pow(2)). tests/test_cpu_kernels_f32.py holds this to the installed torch. */
#define SUM_LANES 8
#define SUM_LEVELS 4
#define SUM_ILP 4

static inline int64_t ceil_log2(int64_t x) {  /* as aten's utils::CeilLog2: 1 for x <= 2 */
    int64_t r = 1;
    while (x > 2 && ((int64_t)1 << r) < x) ++r;
    return r;
}

/* acc[k][l] += x[k L + l]^2: one group of SUM_ILP vectors */
static inline __attribute__((always_inline)) void add_squares(float acc[SUM_ILP][SUM_LANES], const float* x,
                                                             const int64_t L)
{
    for (int64_t k = 0; k < SUM_ILP; ++k)
        for (int64_t l = 0; l < L; ++l) acc[k][l] += x[k * L + l] * x[k * L + l];
}

static inline __attribute__((always_inline)) float cascade_sum_squares(const float* v, int64_t n, const int64_t L)
{
    const int64_t vecs = n / L, size = vecs / SUM_ILP;
    int64_t power = ceil_log2(size) / SUM_LEVELS;
    power = power < 4 ? 4 : power;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[SUM_LEVELS][SUM_ILP][SUM_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    for (; i + step <= size;) {
        for (const int64_t end = i + step; i < end; ++i) add_squares(acc[0], v + i * SUM_ILP * L, L);
        for (int64_t lv = 1; lv < SUM_LEVELS; ++lv) {
            for (int64_t k = 0; k < SUM_ILP; ++k)
                for (int64_t l = 0; l < L; ++l) {
                    acc[lv][k][l] += acc[lv - 1][k][l];
                    acc[lv - 1][k][l] = 0.0f;
                }
            if (i & (mask << (lv * power))) break;
        }
    }
    for (; i < size; ++i) add_squares(acc[0], v + i * SUM_ILP * L, L);
    for (int64_t lv = 1; lv < SUM_LEVELS; ++lv)
        for (int64_t k = 0; k < SUM_ILP; ++k)
            for (int64_t l = 0; l < L; ++l) acc[0][k][l] += acc[lv][k][l];
    for (int64_t e = size * SUM_ILP; e < vecs; ++e)
        for (int64_t l = 0; l < L; ++l) acc[0][0][l] += v[e * L + l] * v[e * L + l];
    for (int64_t k = 1; k < SUM_ILP; ++k)
        for (int64_t l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vecs * L; e < n; ++e) total += v[e] * v[e];
    for (int64_t l = 0; l < L; ++l) total += acc[0][0][l];
    return total;
}

static float torch_sum_squares(const float* v, int64_t n)
{
    return n >= SUM_LANES ? cascade_sum_squares(v, n, SUM_LANES) : cascade_sum_squares(v, n, 1);
}

/* RMSNorm over rows of `hidden`: with residual != NULL, first residual += x and the norm reads
 * the sum; out = w * (v * (1 / sqrt(sum(v^2) / hidden + eps))), every step rounded as torch's
 * fp32 ops round (the sum in torch's order): bit-identical. */
void rmsnorm_f32(const float* x, float* residual, const float* w, int64_t rows, int64_t hidden, float eps,
                 float* out)
{
#pragma omp parallel for schedule(static) if (rows * hidden >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r) {
        const float* v = x + r * hidden;
        if (residual) {
            float* res = residual + r * hidden;
            for (int64_t j = 0; j < hidden; j += W) {
                const int64_t m = lanes(hidden - j);
                v_store_n(res + j, v_add(v_load_n(res + j, m), v_load_n(v + j, m)), m);
            }
            v = res;
        }
        const vf inv = v_set1(1.0f / sqrtf(torch_sum_squares(v, hidden) / (float)hidden + eps));
        float* o = out + r * hidden;
        for (int64_t j = 0; j < hidden; j += W) {
            const int64_t m = lanes(hidden - j);
            v_store_n(o + j, v_mul(v_load_n(w + j, m), v_mul(v_load_n(v + j, m), inv)), m);
        }
    }
}

/* Rotary embedding (neox halves) in place on fp32 rows: x[t][h][:] for h < heads, rows
 * `row_stride` apart (the q and k heads of a fused qkv output, d apart), the first rot_dim
 * dims rotated by cos/sin [T, rot_dim / 2]: (x1 c - x2 s, x2 c + x1 s) with each product and
 * the sum rounded, as torch's ops round (an FMA would round once: one bit off). */
void rotary_f32(float* x, int64_t T, int64_t row_stride, int64_t heads, int64_t d, int64_t rot_dim,
                const float* cos, const float* sin)
{
    const int64_t half = rot_dim / 2;
#pragma omp parallel for collapse(2) schedule(static) if (T * heads * rot_dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
            const float* ct = cos + t * half;
            const float* st = sin + t * half;
            float* x1 = x + t * row_stride + h * d;
            float* x2 = x1 + half;
            for (int64_t j = 0; j < half; j += W) {
                const int64_t m = lanes(half - j);
                const vf a = v_load_n(x1 + j, m), b = v_load_n(x2 + j, m);
                const vf c = v_load_n(ct + j, m), s = v_load_n(st + j, m);
                v_store_n(x1 + j, v_sub(v_mul(a, c), v_mul(b, s)), m);
                v_store_n(x2 + j, v_add(v_mul(b, c), v_mul(a, s)), m);
            }
        }
    }
}
