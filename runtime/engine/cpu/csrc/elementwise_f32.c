/* fp32 elementwise kernels of the decoder layer: silu*mul, RMSNorm (residual add fused) and
 * rotary embedding, each computing torch's fp32 formula in one pass over memory (torch runs
 * each of them as several ops, each its own pass). Called by runtime/cpu/kernels.py.
 *
 * Written once over the lane vector of lanes_f32.h (AVX-512, AVX2 + FMA or plain C). A row's
 * remainder (fewer than AV_W elements) goes through masked loads and stores, so every loop body
 * exists once. */
/* Every operation here rounds where torch's does: no FMA contraction (a*b+c rounds once) and
 * no reassociation (the library builds with -fassociative-math), in this file only. Set
 * before the includes so that the intrinsics inline with the same options. */
#if defined(__clang__)
#pragma clang fp contract(off)
#pragma clang fp reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#endif
#include "lanes_f32.h"
#include "entry_points.h"

/* Below this many elements a call runs on the calling thread: forking the OpenMP team costs
 * more than the work (a one-request decode step's norm is one row of ~1-4 K floats). */
#define PAR_MIN_ELEMS 16384

static inline int64_t lanes(int64_t left) { return left < AV_W ? left : AV_W; }

/* exp(x) within ~1-2 ulp (torch's vectorised exp is within 1) for x up to overflow (inf above
 * ~88.72, NaN kept); results below ~2^-125 become 0 (they do not change 1 + exp(x), all silu
 * needs). x = n ln2 + r, |r| <= ln2/2 (Cody-Waite: ln2 in two parts), exp(r) by Cephes' expf
 * polynomial (explicit FMAs), times 2^n as 2p * 2^(n-1) so that n = 128 still fits the
 * exponent field. Plain C calls libm's expf. */
#if AV_W > 1
#define EXPF_LN2_HI 0.693359375f
#define EXPF_LN2_LO -2.12194440e-4f
#if AV_W == 16
static inline av av_round(av x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline av av_fnmadd(av a, av b, av c) { return _mm512_fnmadd_ps(a, b, c); }
static inline av av_clamp(av x, float lo, float hi) {  /* NaN stays NaN: max/min return x then */
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x));
}
static inline av av_pow2_minus1(av n) {  /* 2^(n - 1) for integral n in [-126, 128] (0 at -126) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23));
}
#else
static inline av av_round(av x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline av av_fnmadd(av a, av b, av c) { return _mm256_fnmadd_ps(a, b, c); }
static inline av av_clamp(av x, float lo, float hi) {
    return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
static inline av av_pow2_minus1(av n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23));
}
#endif
static inline av av_expf(av x) {
    x = av_clamp(x, -87.0f, 89.0f);  /* n in [-126, 128]: inf at the top, 0 at the bottom */
    const av n = av_round(av_mul(x, av_set1(EXP_LOG2E)));
    av r = av_fnmadd(n, av_set1(EXPF_LN2_HI), x);
    r = av_fnmadd(n, av_set1(EXPF_LN2_LO), r);
    av p = av_set1(1.9875691500e-4f);
    p = av_fma(p, r, av_set1(1.3981999507e-3f));
    p = av_fma(p, r, av_set1(8.3334519073e-3f));
    p = av_fma(p, r, av_set1(4.1665795894e-2f));
    p = av_fma(p, r, av_set1(1.6666665459e-1f));
    p = av_fma(p, r, av_set1(5.0000001201e-1f));
    p = av_add(av_fma(p, av_mul(r, r), r), av_set1(1.0f));
    return av_mul(av_add(p, p), av_pow2_minus1(n));  /* 2p exactly, one rounding: no product to reorder */
}
#else
static inline av av_expf(av x) { return expf(x); }
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
        for (int64_t j = 0; j < inter; j += AV_W) {
            const int64_t m = lanes(inter - j);
            const av x = av_load_n(g + j, m);
            const av silu = av_div(x, av_add(av_set1(1.0f), av_expf(av_sub(av_set1(0.0f), x))));
            av_store_n(o + j, av_mul(silu, av_load_n(u + j, m)), m);
        }
    }
}

/* out [rows, inter] = gelu_tanh(gate) * up, gate_up [rows, 2 * inter] (gate first): torch's
 * F.gelu(gate, approximate="tanh").mul_(up) with gelu_tanh(x) = 0.5 x (1 + tanh(k (x + c x^3)))
 * computed as x / (1 + exp(-z)), z = 2k (x + c x^3) (common.h): one exp, no cancellation in
 * 1 + tanh (within a few ulp of torch's where torch's own sum does not cancel). */
void gelu_tanh_mul_f32(const float* gate_up, int64_t rows, int64_t inter, float* out)
{
#pragma omp parallel for schedule(static) if (rows * inter >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        for (int64_t j = 0; j < inter; j += AV_W) {
            const int64_t m = lanes(inter - j);
            const av x = av_load_n(g + j, m);
            const av z = av_mul(x, av_add(av_set1(GELU_2K), av_mul(av_set1(GELU_2KC), av_mul(x, x))));
            const av gelu = av_div(x, av_add(av_set1(1.0f), av_expf(av_sub(av_set1(0.0f), z))));
            av_store_n(o + j, av_mul(gelu, av_load_n(u + j, m)), m);
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
 * x.pow(2)). tests/unit/runtime/engine/cpu/test_cpu_kernels_f32.py holds this to the installed torch. */
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
            for (int64_t j = 0; j < hidden; j += AV_W) {
                const int64_t m = lanes(hidden - j);
                av_store_n(res + j, av_add(av_load_n(res + j, m), av_load_n(v + j, m)), m);
            }
            v = res;
        }
        const av inv = av_set1(1.0f / sqrtf(torch_sum_squares(v, hidden) / (float)hidden + eps));
        float* o = out + r * hidden;
        for (int64_t j = 0; j < hidden; j += AV_W) {
            const int64_t m = lanes(hidden - j);
            av_store_n(o + j, av_mul(av_load_n(w + j, m), av_mul(av_load_n(v + j, m), inv)), m);
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
            for (int64_t j = 0; j < half; j += AV_W) {
                const int64_t m = lanes(half - j);
                const av a = av_load_n(x1 + j, m), b = av_load_n(x2 + j, m);
                const av c = av_load_n(ct + j, m), s = av_load_n(st + j, m);
                av_store_n(x1 + j, av_sub(av_mul(a, c), av_mul(b, s)), m);
                av_store_n(x2 + j, av_add(av_mul(b, c), av_mul(a, s)), m);
            }
        }
    }
}
