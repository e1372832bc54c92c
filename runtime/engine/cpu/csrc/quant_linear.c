/* Linear layers on weights kept quantized (runtime/quant/weight.py: the q8 and q4 layouts), for any
 * number of rows, in one of two numerics (the caller's choice, per weight: bit 2 of `kind`):
 *
 * - weight-only (the default): the activations are not rounded at all. Each tile of weight rows is
 *   dequantized to fp32 once (into the thread's cache) and every activation row passes over it as
 *   plain fp32 dot products, so the result is the dense (dequantized) model's, its sums in another
 *   order. For one row (a decode step) the weight's bytes still bound the product: a 4-bit weight
 *   is streamed at an eighth of its fp32 bytes, and the conversion runs from L1. (bf16 rows on
 *   AVX512-BF16 go to quant_linear_bf16.c, through its callers.)
 * - int8 activations (QUANT_INT8_ACTIVATIONS, llama.cpp's CPU numerics), for fewer than
 *   QGEMM_MIN_ROWS rows: each block of 32 activations of a row gets one fp32 scale (max |x| / 127)
 *   and int8 values, a block's 32 products are summed exactly in int32, and the block's scales (the
 *   weight's and the activation's) are applied to that sum in fp32. Fewer instructions per value
 *   than a conversion and an FMA, but the rounding of the activations changes a small model's
 *   greedy answers (docs/quantization.md), so it is an explicit choice (--quantized-activations int8).
 *
 * int8 activations, in detail:
 * - q8 (int8 weights, a scale per 16 or 32 values, or per row): vpmaddubsw takes an unsigned and a
 *   signed operand, so the weight's sign moves onto the activation (|w| times x * sign(w)) and the
 *   pair sums fit in int16 (2 * 128 * 127). The int32 lanes 0-3 of a block hold its first 16
 *   values' sums and lanes 4-7 the last 16's, so a per-16 scale (Q6_K) costs nothing more.
 * - q4 (values 0..15 two a byte, a scale and a min per 32): w = s * q + m, so
 *   x . w = s * (x . q) + m * sum(x); q is unsigned already, and sum(x) is the exact fp32 sum of
 *   the activation block (computed once with its quantization).
 * The integer sums use vpdpbusd where the build has AVX512-VNNI (with VL) or AVX-VNNI, vpmaddubsw
 * with AVX2, plain C elsewhere; the only rounding that differs between builds is the order of the
 * fp32 sums of the blocks. Threads split the output rows (OpenMP).
 *
 * Many rows (QGEMM_MIN_ROWS and more: a prefill, a loaded server's decode batch) take the weight-only
 * path in either numerics: there the integer products cost a conversion and a scale per block and
 * activation row (vpmaddubsw, vpmaddwd, a conversion, an FMA per 32 values), which is more than an
 * fp32 FMA per value once the weight is no longer what bounds the step, and the dequantization is
 * shared by all rows. */
#include "lanes_f32.h"
#include "entry_points.h"
#include "quant_layout.h"

#define QROWS 8      /* activation rows per pass over a weight row (its unpacked blocks serve them all) */
#define OUT_CHUNK 8  /* weight rows per chunk: every activation row group passes over them */

/* x [m, k] (rows ldx apart) -> xq int8 [m, k], xd [m, k / 32] (each block's scale), xs [m, k / 32]
 * (each block's exact sum). Rounds to nearest even (cvtps / nearbyintf under the default mode). */
static void quantize_activations(const float* x, int64_t m, int64_t ldx, int64_t k, int8_t* xq, float* xd,
                                 float* xs)
{
    const int64_t nb = k / QBLOCK;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t i = 0; i < m * nb; ++i) {
        const int64_t r = i / nb, b = i % nb;
        const float* v = x + r * ldx + b * QBLOCK;
        int8_t* q = xq + r * k + b * QBLOCK;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QBLOCK; ++j) {
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
            sum += v[j];
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xd[i] = d;
        xs[i] = sum;
#if defined(__AVX2__)
        const __m256 s = _mm256_set1_ps(inv);
        for (int j = 0; j < QBLOCK; j += 8) {
            const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j), s));
            const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
            const __m128i n8 = _mm_packs_epi16(n16, n16);
            memcpy(q + j, &n8, 8);
        }
#else
        for (int j = 0; j < QBLOCK; ++j) q[j] = (int8_t)nearbyintf(v[j] * inv);
#endif
    }
}

#if defined(__AVX2__)
static inline __m256i dot_u8i8(__m256i u, __m256i s)  /* 8 int32 sums of 4 products of u (unsigned) and s */
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Block b's 32 products of the weight row and an activation row (xq: the row), as 8 fp32 partial
 * sums times the weight's scales (lanes 0-3: the block's first 16 values, 4-7: the last 16); the
 * caller multiplies in the activation block's scale (the unpacked weight serves every row). */
static inline __attribute__((always_inline)) __m256 block_dot(int q4, const uint8_t* wq, const float* ws,
                                                              int64_t scale_step, int half, int64_t b,
                                                              const int8_t* xq)
{
    const __m256i a = _mm256_loadu_si256((const __m256i*)(xq + b * QBLOCK));
    if (q4) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(wq + b * (QBLOCK / 2)));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8i8(w, a)), _mm256_set1_ps(ws[b]));
    }
    const __m256i w = _mm256_loadu_si256((const __m256i*)(wq + b * QBLOCK));
    const float* sp = ws + b * scale_step;
    const __m256 sv = half ? _mm256_set_m128(_mm_set1_ps(sp[1]), _mm_set1_ps(sp[0])) : _mm256_set1_ps(sp[0]);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))), sv);
}
#endif

/* out[r] = weight row . activation row r, for r < rows (<= QROWS; a constant in each caller).
 * q8: wq int8 [k], ws its scales (scale_step per block, `half`: a second scale for the block's last
 * 16 values at ws[1]). q4: wq packed [k / 2], ws and wm a scale and a min per block. */
static inline __attribute__((always_inline)) void row_dots(
    const int rows, int q4, const uint8_t* wq, const float* ws, const float* wm, int64_t scale_step, int half,
    int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t k, float* out)
{
#if defined(__AVX2__)
    /* one row: two accumulators, for even and odd blocks (the loop unrolled by two so that they stay
     * in registers), so that two FMA chains overlap; more rows: one each, the rows' chains overlap */
    __m256 acc0[QROWS], acc1[QROWS];
    for (int r = 0; r < rows; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    if (rows == 1)
        for (; b + 1 < nb; b += 2) {
            acc0[0] = _mm256_fmadd_ps(block_dot(q4, wq, ws, scale_step, half, b, xq),
                                      _mm256_set1_ps(xd[b]), acc0[0]);
            acc1[0] = _mm256_fmadd_ps(block_dot(q4, wq, ws, scale_step, half, b + 1, xq),
                                      _mm256_set1_ps(xd[b + 1]), acc1[0]);
        }
    for (; b < nb; ++b)
        for (int r = 0; r < rows; ++r)
            acc0[r] = _mm256_fmadd_ps(block_dot(q4, wq, ws, scale_step, half, b, xq + r * k),
                                      _mm256_set1_ps(xd[r * nb + b]), acc0[r]);
    for (int r = 0; r < rows; ++r) {
        float msum = 0.0f;  /* a weight with mins: the blocks' mins times the activation blocks' sums */
        if (wm)
            for (int64_t j = 0; j < nb; ++j) msum += wm[j] * xs[r * nb + j];
        out[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r])) + msum;
    }
#else
    for (int r = 0; r < rows; ++r) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const int8_t* a = xq + r * k + b * QBLOCK;
            int32_t s0 = 0, s1 = 0;
            if (q4) {
                const uint8_t* w = wq + b * (QBLOCK / 2);
                for (int j = 0; j < QBLOCK / 2; ++j) {
                    s0 += (int32_t)(w[j] & 0x0F) * a[j];
                    s1 += (int32_t)(w[j] >> 4) * a[j + QBLOCK / 2];
                }
                acc += (float)(s0 + s1) * (ws[b] * xd[r * nb + b]) + wm[b] * xs[r * nb + b];
            } else {
                const int8_t* w = (const int8_t*)wq + b * QBLOCK;
                for (int j = 0; j < QBLOCK / 2; ++j) {
                    s0 += (int32_t)w[j] * a[j];
                    s1 += (int32_t)w[j + QBLOCK / 2] * a[j + QBLOCK / 2];
                }
                const float* sp = ws + b * scale_step;
                acc += ((float)s0 * sp[0] + (float)s1 * sp[half]) * xd[r * nb + b] + (wm ? wm[b] * xs[r * nb + b] : 0.0f);
            }
        }
        out[r] = acc;
    }
#endif
}

static void row_dots_n(int rows, int q4, const uint8_t* wq, const float* ws, const float* wm, int64_t scale_step,
                       int half, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t k,
                       float* out)
{
    switch (rows) {  /* one unrolled copy per row count */
#define ROW_CASE(R) case R: row_dots(R, q4, wq, ws, wm, scale_step, half, nb, xq, xd, xs, k, out); break;
        ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) ROW_CASE(5) ROW_CASE(6) ROW_CASE(7) ROW_CASE(8)
#undef ROW_CASE
    }
}

/* ---- weight-only (and many rows in either numerics): dequantize a tile of weight rows once, fp32 dot
 * products for every row ---- */
#define QGEMM_MIN_ROWS 24  /* from this many activation rows on (docs/benchmarks.md, "Quantized weights") */
#define DQ_W 8             /* weight rows dequantized per tile */
#define DQ_K 512           /* depths per tile: DQ_W x DQ_K fp32 = 16 KiB, in L1 while every row passes */
#define DOT_W 4            /* weight rows per register tile */
#define DOT_X 3            /* activation rows per register tile (DOT_W x DOT_X accumulators) */

/* acc[r][o] += x row r . w row o over kc depths (kc a multiple of AV_W), for XR x WR rows (constants at
 * each call: the accumulators stay in registers); results added into out (rows ldo apart). */
static inline __attribute__((always_inline)) void dot_tile(const int XR, const int WR, const float* x, int64_t ldx,
                                                          const float* w, int64_t kc, float* out, int64_t ldo)
{
    av acc[DOT_X][DOT_W];
    for (int r = 0; r < XR; ++r)
        for (int o = 0; o < WR; ++o) acc[r][o] = av_set1(0.0f);
    for (int64_t d = 0; d < kc; d += AV_W) {
        av xv[DOT_X];
        for (int r = 0; r < XR; ++r) xv[r] = av_load(x + r * ldx + d);
        for (int o = 0; o < WR; ++o) {
            const av wv = av_load(w + o * DQ_K + d);
            for (int r = 0; r < XR; ++r) acc[r][o] = av_fma(xv[r], wv, acc[r][o]);
        }
    }
    for (int r = 0; r < XR; ++r)
        for (int o = 0; o < WR; ++o) out[r * ldo + o] += av_hsum(acc[r][o]);
}

static void dot_tile_n(int xr, int wr, const float* x, int64_t ldx, const float* w, int64_t kc, float* out,
                       int64_t ldo)
{
#define DOT_CASE(X, W) if (xr == X && wr == W) { dot_tile(X, W, x, ldx, w, kc, out, ldo); return; }
    DOT_CASE(3, 4) DOT_CASE(2, 4) DOT_CASE(1, 4) DOT_CASE(3, 3) DOT_CASE(2, 3) DOT_CASE(1, 3)
    DOT_CASE(3, 2) DOT_CASE(2, 2) DOT_CASE(1, 2) DOT_CASE(3, 1) DOT_CASE(2, 1) DOT_CASE(1, 1)
#undef DOT_CASE
}

/* quant_linear_f32 for m >= QGEMM_MIN_ROWS (same operands): out starts at the bias (or 0), each
 * tile of DQ_W weight rows by DQ_K depths is dequantized and every row's dot products added. */
static void dequantized_gemm(const float* x, int64_t m, int64_t ldx, int q4, const void* qs, const void* scales,
                             const void* mins, const float* supers, int64_t group, int64_t n, int64_t k,
                             const float* bias, float* out, int64_t ldo)
{
    const int64_t tiles = (n + DQ_W - 1) / DQ_W, per_row = k / group;
#pragma omp parallel
    {
        /* the tile's rows' fp32 scales and mins, decoded once (the super-block form) for all its depths */
        float buf[supers ? ROW_SCALES_FLOATS(DQ_W, k) : 1];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            float w[DQ_W * DQ_K] __attribute__((aligned(64)));
            const int64_t o0 = t * DQ_W, wn = n - o0 < DQ_W ? n - o0 : DQ_W;
            const float *ws, *wm;
            row_scales(scales, mins, supers, group, k, o0, wn, buf, &ws, &wm);
            for (int64_t r = 0; r < m; ++r)
                for (int64_t o = 0; o < wn; ++o) out[r * ldo + o0 + o] = bias ? bias[o0 + o] : 0.0f;
            for (int64_t k0 = 0; k0 < k; k0 += DQ_K) {
                const int64_t kc = k - k0 < DQ_K ? k - k0 : DQ_K;
                for (int64_t o = 0; o < wn; ++o)
                    quant_dequantize_row(q4, (const uint8_t*)qs, ws + o * per_row, wm ? wm + o * per_row : NULL, group,
                                         k, o0 + o, k0, kc, w + o * DQ_K);
                for (int64_t r = 0; r < m; r += DOT_X)  /* (an activation tile stays in L1 across the weight tiles) */
                    for (int64_t o = 0; o < wn; o += DOT_W)
                        dot_tile_n((int)(m - r < DOT_X ? m - r : DOT_X), (int)(wn - o < DOT_W ? wn - o : DOT_W),
                                   x + r * ldx + k0, ldx, w + o * DQ_K, kc, out + r * ldo + o0 + o, ldo);
            }
        }
    }
}

/* ---- weight-only, few rows: each block dequantized in registers, fp32 FMAs against the rows ---- */
#define WO_ROWS 8        /* activation rows per pass over a weight row (its dequantized blocks serve them all) */
#define WO_MAX_ROWS 24   /* below this many rows; from it on the dequantized tiles (shared by more rows) */
#define WO_VECS (QBLOCK / AV_W)  /* vectors per block: 2 with AVX-512, 4 with AVX2 */

#if defined(__AVX2__) && defined(__FMA__)
/* Block b of a weight row as WO_VECS vectors of AV_W fp32 values (value j in lane j % AV_W of
 * v[j / AV_W]): the values dequantize_row writes (q4: one FMA, s * q + m; q8: s * q). */
static inline __attribute__((always_inline)) void block_values(int q4, const uint8_t* wq, const float* ws,
                                                               const float* wm, int64_t scale_step, int half,
                                                               int64_t b, av v[WO_VECS])
{
    if (q4) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(wq + b * (QBLOCK / 2)));
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));                   /* values 0..15 */
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)); /* values 16..31 */
        const av s = av_set1(ws[b]), m = av_set1(wm[b]);
#if defined(__AVX512F__)
        v[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), s, m);
        v[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), s, m);
#else
        v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, m);
        v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, m);
        v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, m);
        v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, m);
#endif
        return;
    }
    const __m128i raw0 = _mm_loadu_si128((const __m128i*)(wq + b * QBLOCK));
    const __m128i raw1 = _mm_loadu_si128((const __m128i*)(wq + b * QBLOCK + 16));
    const float* sp = ws + b * scale_step;
    const av s0 = av_set1(sp[0]), s1 = av_set1(sp[half]); /* values 0..15, 16..31 */
#if defined(__AVX512F__)
    v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw0));
    v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw1));
#else
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw0));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw0, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw1));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw1, 8)));
#endif
    if (wm) { /* a q8 weight with mins (Q5_1, Q5_K): s * q + m, one FMA as q4's */
        const av m = av_set1(wm[b]);
        for (int j = 0; j < WO_VECS; ++j) v[j] = av_fma(v[j], j < WO_VECS / 2 ? s0 : s1, m);
    } else {
        for (int j = 0; j < WO_VECS; ++j) v[j] = av_mul(v[j], j < WO_VECS / 2 ? s0 : s1);
    }
}

/* out[r] = weight row . activation row r (fp32, rows ldx apart), for r < rows (a constant in each
 * caller). Each row keeps `chains` accumulators (up to WO_VECS for one row, fewer as rows grow), so
 * that independent FMA chains hide their latency while the registers last. */
static inline __attribute__((always_inline)) void wo_row_dots(const int rows, int q4, const uint8_t* wq,
                                                              const float* ws, const float* wm, int64_t scale_step,
                                                              int half, int64_t nb, const float* x, int64_t ldx,
                                                              float* out)
{
    const int chains = rows == 1 ? WO_VECS : rows == 2 && WO_VECS > 2 ? 2 : 1;
    av acc[WO_ROWS][WO_VECS];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < chains; ++c) acc[r][c] = av_set1(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        av v[WO_VECS];
        block_values(q4, wq, ws, wm, scale_step, half, b, v);
        for (int r = 0; r < rows; ++r) {
            const float* xr = x + r * ldx + b * QBLOCK;
            for (int j = 0; j < WO_VECS; ++j)
                acc[r][j % chains] = av_fma(v[j], av_load(xr + AV_W * j), acc[r][j % chains]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        av sum = acc[r][0];
        for (int c = 1; c < chains; ++c) sum = av_add(sum, acc[r][c]);
        out[r] = av_hsum(sum);
    }
}

static void wo_row_dots_n(int rows, int q4, const uint8_t* wq, const float* ws, const float* wm, int64_t scale_step,
                          int half, int64_t nb, const float* x, int64_t ldx, float* out)
{
    switch (rows) {  /* one unrolled copy per row count */
#define WO_CASE(R) case R: wo_row_dots(R, q4, wq, ws, wm, scale_step, half, nb, x, ldx, out); break;
        WO_CASE(1) WO_CASE(2) WO_CASE(3) WO_CASE(4) WO_CASE(5) WO_CASE(6) WO_CASE(7) WO_CASE(8)
#undef WO_CASE
    }
}

#if defined(__AVX512F__)
/* wo_row_dots for two weight rows at once (AVX-512, where the accumulators of both fit the registers):
 * each activation vector loaded serves both rows' FMAs, which halves the loads that bound the product
 * of several rows. Same sums in the same order as wo_row_dots of 2 or more rows (one chain a row). */
static inline __attribute__((always_inline)) void wo_pair_dots(const int rows, int q4, const uint8_t* wq,
                                                               int64_t row_bytes, const float* ws, const float* wm,
                                                               int64_t scales_per_row, int64_t scale_step, int half,
                                                               int64_t nb, const float* x, int64_t ldx, float* out0,
                                                               float* out1)
{
    av acc0[WO_ROWS], acc1[WO_ROWS];
    for (int r = 0; r < rows; ++r) acc0[r] = acc1[r] = av_set1(0.0f);
    const float* wm1 = wm ? wm + scales_per_row : NULL;
    for (int64_t b = 0; b < nb; ++b) {
        av v0[WO_VECS], v1[WO_VECS];
        block_values(q4, wq, ws, wm, scale_step, half, b, v0);
        block_values(q4, wq + row_bytes, ws + scales_per_row, wm1, scale_step, half, b, v1);
        for (int r = 0; r < rows; ++r) {
            const float* xr = x + r * ldx + b * QBLOCK;
            for (int j = 0; j < WO_VECS; ++j) {
                const av xv = av_load(xr + AV_W * j);
                acc0[r] = av_fma(v0[j], xv, acc0[r]);
                acc1[r] = av_fma(v1[j], xv, acc1[r]);
            }
        }
    }
    for (int r = 0; r < rows; ++r) {
        out0[r] = av_hsum(acc0[r]);
        out1[r] = av_hsum(acc1[r]);
    }
}

static void wo_pair_dots_n(int rows, int q4, const uint8_t* wq, int64_t row_bytes, const float* ws, const float* wm,
                           int64_t scales_per_row, int64_t scale_step, int half, int64_t nb, const float* x,
                           int64_t ldx, float* out0, float* out1)
{
    switch (rows) {  /* one unrolled copy per row count (a single row takes wo_row_dots' chains) */
#define PAIR_CASE(R) \
    case R: wo_pair_dots(R, q4, wq, row_bytes, ws, wm, scales_per_row, scale_step, half, nb, x, ldx, out0, out1); break;
        PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4) PAIR_CASE(5) PAIR_CASE(6) PAIR_CASE(7) PAIR_CASE(8)
#undef PAIR_CASE
    }
}
#define WO_PAIRS 1
#else
#define WO_PAIRS 0
#endif

/* quant_linear_f32's weight-only product of a few rows (same operands): chunks of output rows split
 * among the threads, each weight row streamed once per WO_ROWS activation rows. */
static void weight_only_rows(const float* x, int64_t m, int64_t ldx, int q4, const void* qs, const void* scales,
                             const void* mins, const float* supers, int64_t group, int64_t n, int64_t k,
                             const float* bias, float* out, int64_t ldo)
{
    const int64_t nb = k / QBLOCK, scales_per_row = k / group;
    const int64_t scale_step = group == 16 ? 2 : (group == QBLOCK ? 1 : 0);
    const int half = group == 16;
    const int64_t row_bytes = q4 ? k / 2 : k;
    const int64_t chunks = (n + OUT_CHUNK - 1) / OUT_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t o0 = c * OUT_CHUNK, o1 = o0 + OUT_CHUNK < n ? o0 + OUT_CHUNK : n;
        float buf[supers ? ROW_SCALES_FLOATS(2, k) : 1]; /* a row pair's decoded scales (the super-block form) */
        for (int64_t r0 = 0; r0 < m; r0 += WO_ROWS) {
            const int rows = (int)(m - r0 < WO_ROWS ? m - r0 : WO_ROWS);
            for (int64_t o = o0; o < o1;) {
                float dots[2][WO_ROWS] = {{0}};
                const int pair = WO_PAIRS && rows > 1 && o + 1 < o1;
                const uint8_t* wq = (const uint8_t*)qs + o * row_bytes;
                const float *ws, *wm;
                row_scales(scales, mins, supers, group, k, o, 1 + pair, buf, &ws, &wm);
#if defined(__AVX512F__)
                if (pair)
                    wo_pair_dots_n(rows, q4, wq, row_bytes, ws, wm, scales_per_row, scale_step, half, nb,
                                   x + r0 * ldx, ldx, dots[0], dots[1]);
                else
#endif
                    wo_row_dots_n(rows, q4, wq, ws, wm, scale_step, half, nb, x + r0 * ldx, ldx, dots[0]);
                for (int p = 0; p <= pair; ++p, ++o) {
                    const float add = bias ? bias[o] : 0.0f;
                    for (int r = 0; r < rows; ++r) out[(r0 + r) * ldo + o] = dots[p][r] + add;
                }
            }
        }
    }
}
#endif

/* out [m, n] fp32 (rows ldo apart) = x [m, k] fp32 (rows ldx apart) times the quantized weight
 * [n, k] (+ bias [n] when not NULL).
 * kind 0 (q8): qs int8 [n, k]; scales [n, k / group] with group 16, 32 or k; mins NULL, or with group
 *   32 a min per block [n, k / 32] (w = s * q + m).
 * kind 1 (q4): qs uint8 [n, k / 2]; scales and mins [n, k / 32]; group 32.
 * supers NULL: scales and mins fp32 as above (the plain form); else the super-block form (quant_layout.h:
 *   row_scales): scales and mins 8-bit codes of those shapes, supers fp32 [n, k / 256, 2].
 * kind | QUANT_INT8_ACTIVATIONS: fewer than QGEMM_MIN_ROWS rows quantize the activations to int8
 * (see the top of this file); without it every product is weight-only.
 * Returns 0, or -1 (nothing written) for operands it does not take: k not a multiple of 32,
 * another group or kind, m < 1. */
int quant_linear_f32(const float* x, int64_t m, int64_t ldx, int kind, const void* qs, const void* scales,
                     const void* mins, const float* supers, int64_t group, int64_t n, int64_t k, const float* bias,
                     float* out, int64_t ldo)
{
    if (m < 1 || n < 1 || k < QBLOCK || k % QBLOCK || ldx < k || ldo < n) return -1;
    if (!takes_kind(kind, mins, supers, group, k)) return -1;
    const int64_t nb = k / QBLOCK;
    const int q4 = kind & QUANT_LAYOUT_Q4;
#if defined(__AVX2__) && defined(__FMA__)
    if (m < WO_MAX_ROWS && !(kind & QUANT_INT8_ACTIVATIONS)) {
        weight_only_rows(x, m, ldx, q4, qs, scales, mins, supers, group, n, k, bias, out, ldo);
        return 0;
    }
#endif
    if (m >= QGEMM_MIN_ROWS || !(kind & QUANT_INT8_ACTIVATIONS)) {
        dequantized_gemm(x, m, ldx, q4, qs, scales, mins, supers, group, n, k, bias, out, ldo);
        return 0;
    }
    /* scales per 32-block: 2 (group 16), 1 (group 32), 0 (one per row) */
    const int64_t scale_step = group == 16 ? 2 : (group == QBLOCK ? 1 : 0);
    const int half = group == 16;
    const int64_t row_bytes = q4 ? k / 2 : k;
    int8_t* xq = (int8_t*)malloc((size_t)(m * k));
    float* xd = (float*)malloc(sizeof(float) * (size_t)(m * nb * 2));
    if (xq == NULL || xd == NULL) { free(xq); free(xd); return -1; }
    float* xs = xd + m * nb;
    quantize_activations(x, m, ldx, k, xq, xd, xs);
    const int64_t chunks = (n + OUT_CHUNK - 1) / OUT_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t o0 = c * OUT_CHUNK, o1 = o0 + OUT_CHUNK < n ? o0 + OUT_CHUNK : n;
        float buf[supers ? ROW_SCALES_FLOATS(1, k) : 1]; /* a row's decoded scales (the super-block form) */
        for (int64_t r0 = 0; r0 < m; r0 += QROWS) {
            const int rows = (int)(m - r0 < QROWS ? m - r0 : QROWS);
            for (int64_t o = o0; o < o1; ++o) {
                float dots[QROWS] = {0};
                const float *ws, *wm;
                row_scales(scales, mins, supers, group, k, o, 1, buf, &ws, &wm);
                row_dots_n(rows, q4, (const uint8_t*)qs + o * row_bytes, ws, wm, scale_step, half, nb, xq + r0 * k,
                           xd + r0 * nb, xs + r0 * nb, k, dots);
                const float add = bias ? bias[o] : 0.0f;
                for (int r = 0; r < rows; ++r) out[(r0 + r) * ldo + o] = dots[r] + add;
            }
        }
    }
    free(xq);
    free(xd);
    return 0;
}
