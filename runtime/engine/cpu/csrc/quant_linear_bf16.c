/* Weight-only linear layers for a few rows of bf16 activations against weights kept quantized (the q8
 * and q4 layouts of quant_linear.c), on AVX512-BF16 dot products: a decode step or a verify step of
 * the qbf16 set (a bf16 model whose weights stay in their blocks).
 *
 * quant_linear.c's weight-only kernel widens the rows to fp32 and converts every block to fp32 values
 * (s * q + m, two FMAs and two conversions a block per 16 lanes): at one row the conversions, not the
 * weight's bytes, bound a decode step. Here a block's 32 values become bf16 and one vdpbf16ps
 * multiplies them with the row's 32 bf16 activations:
 * - q4 (values 0..15): bf16's bits of 128 + q are 0x4300 | q (exponent 2^7, q in the mantissa), so
 *   x . w = s * (x . (q + 128)) + (m - 128 s) * sum(x), the rows' block sums computed once per call.
 *   Four blocks at a time: their 64 bytes read as 32 16-bit words, each word's four nibbles (values
 *   2j and 2j + 16 of its block, in the low byte, 2j + 1 and 2j + 17 in the high one) a shift and an
 *   AND-OR (one vpternlog) away from bf16; the rows are copied once per call into that order
 *   (x_quads), so no weight value is shuffled, and the four blocks' scales fill four lanes each.
 * - q8 (int8 values): exact in bf16 (8 significant bits); converted through fp32. A scale per 16
 *   values is lanes 0-7 / 8-15 of the block's 16 pair sums; a scale per row is applied once.
 * Every product is exact (bf16 times bf16 in fp32); the activations are those of the bf16 model, not
 * rounded again; what differs from the widened kernel is the order and grouping of the fp32 sums, as
 * between builds. The results are fp32 (the caller rounds them to bf16).
 *
 * quant_linear_bf16 returns -1 (nothing written) where it does not apply: a build without AVX512-BF16,
 * QB_MAX_ROWS rows or more, int8 activations asked, or operands quant_linear_f32 would not take; the
 * callers (decode_layers.c's qbf16 set and runtime/engine/cpu/quant_kernels.py, the same rule) then
 * widen the rows for quant_linear_f32. */
#include "common.h"
#include "entry_points.h"
#include "quant_layout.h"

#define QB_ROWS 8            /* activation rows per pass over a weight row */
#define QB_CHUNK 8           /* weight rows per chunk of the threads' split */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
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

/* Rows it takes: up to 32, past quant_linear.c's few-row limit (a verify step of several requests'
 * drafts): the weight's 16-bit words serve every row from registers. From 33 rows the weight
 * dequantized to bf16 for oneDNN is faster (quant_kernels.BF16_DENSE_MIN_ROWS: a Q4_K 17920 x 1536
 * weight on 2 EPYC cores, 9.4 against 10.3 ms at 32 rows, 14.9 against 13.4 at 48). */
#define QB_MAX_ROWS 33

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Block b of a q4 weight row (16 bytes: values 0..15 low nibbles, 16..31 high) as bf16 of q + 128. */
static inline __m512bh q4_block(const uint8_t* wq, int64_t b)
{
    const __m128i raw = _mm_loadu_si128((const __m128i*)(wq + b * (QBLOCK / 2)));
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(q), _mm512_set1_epi16(0x4300));
}

/* Block b of a q8 weight row (32 int8 values) as bf16 (exact). */
static inline __m512bh q8_block(const uint8_t* wq, int64_t b)
{
    const __m128i lo = _mm_loadu_si128((const __m128i*)(wq + b * QBLOCK));
    const __m128i hi = _mm_loadu_si128((const __m128i*)(wq + b * QBLOCK + 16));
    return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
}

/* Blocks b..b + 3 of a q4 weight row as four vectors of 32 bf16 (q + 128): word j of the 64 bytes
 * belongs to block b + j / 8, its four nibbles to v[0..3] (so lanes 4i..4i + 3 of the pair sums are
 * block b + i's), and the four blocks' scales spread over those lanes. */
static inline __attribute__((always_inline)) __m512 q4_quad_values(const uint8_t* wq, const float* ws, int64_t b,
                                                                   __m512bh v[4])
{
    const __m512i words = _mm512_loadu_si512(wq + b * (QBLOCK / 2));
    const __m512i nibble = _mm512_set1_epi16(0x0F), exponent = _mm512_set1_epi16(0x4300);
    /* (v & 0x0F) | 0x4300 in one vpternlog: A = v, B = 0x0F, C = 0x4300 -> (A & B) | C */
#define QB_NIBBLE(v) (__m512bh)_mm512_ternarylogic_epi32((v), nibble, exponent, 0xEA)
    v[0] = QB_NIBBLE(words), v[1] = QB_NIBBLE(_mm512_srli_epi16(words, 4));
    v[2] = QB_NIBBLE(_mm512_srli_epi16(words, 8)), v[3] = QB_NIBBLE(_mm512_srli_epi16(words, 12));
#undef QB_NIBBLE
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(ws + b)));
}

/* Blocks b..b + 3 of a q4 weight row against the rows in x_quads' order (xp: row 0, the four blocks'
 * 128 bf16 at xp + b * 32), scaled into acc[r][c] (rows and c constants at each call: the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void q4_quad(const int rows, const int c, const uint8_t* wq,
                                                          const float* ws, int64_t b, const uint16_t* xp,
                                                          int64_t ldxp, __m512 acc[][4])
{
    __m512bh v[4];
    const __m512 s = q4_quad_values(wq, ws, b, v);
    for (int r = 0; r < rows; ++r) {
        const uint16_t* xr = xp + r * ldxp + b * QBLOCK;
        /* two chains of two (the latency of four dependent dot products would bound one row) */
        const __m512 d0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0], (__m512bh)_mm512_loadu_si512(xr));
        const __m512 d1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[1], (__m512bh)_mm512_loadu_si512(xr + QBLOCK));
        const __m512 d2 = _mm512_dpbf16_ps(d0, v[2], (__m512bh)_mm512_loadu_si512(xr + 2 * QBLOCK));
        const __m512 d3 = _mm512_dpbf16_ps(d1, v[3], (__m512bh)_mm512_loadu_si512(xr + 3 * QBLOCK));
        acc[r][c] = _mm512_fmadd_ps(_mm512_add_ps(d2, d3), s, acc[r][c]);
    }
}

/* q4_quad for two weight rows at once (w0, w1): each activation vector loaded serves both rows' dot
 * products, which halves the loads that bound a product of several rows. Same sums, same order. */
static inline __attribute__((always_inline)) void q4_quad_pair(const int rows, const uint8_t* wq0, const uint8_t* wq1,
                                                               const float* ws0, const float* ws1, int64_t b,
                                                               const uint16_t* xp, int64_t ldxp, __m512 acc0[][4],
                                                               __m512 acc1[][4])
{
    __m512bh v[4], u[4];
    const __m512 s0 = q4_quad_values(wq0, ws0, b, v), s1 = q4_quad_values(wq1, ws1, b, u);
    for (int r = 0; r < rows; ++r) {
        const uint16_t* xr = xp + r * ldxp + b * QBLOCK;
        __m512 d[4], e[4];
        for (int t = 0; t < 4; ++t) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + t * QBLOCK);
            d[t] = _mm512_dpbf16_ps(t < 2 ? _mm512_setzero_ps() : d[t - 2], v[t], xv);
            e[t] = _mm512_dpbf16_ps(t < 2 ? _mm512_setzero_ps() : e[t - 2], u[t], xv);
        }
        acc0[r][0] = _mm512_fmadd_ps(_mm512_add_ps(d[2], d[3]), s0, acc0[r][0]);
        acc1[r][0] = _mm512_fmadd_ps(_mm512_add_ps(e[2], e[3]), s1, acc1[r][0]);
    }
}

/* x [m, k] (rows ldx apart) -> out [m, k] in q4_quad's order: for each four blocks, four runs of 32
 * (the values word j's nibbles hold: 2j, 2j + 16, 2j + 1, 2j + 17 of block j / 8, j = 0..31); the
 * blocks after the last four as they are. */
static void x_quads(const uint16_t* x, int64_t m, int64_t ldx, int64_t k, uint16_t* out)
{
    static const int offset[4] = {0, 16, 1, 17}; /* nibble t of word j: value 2 (j % 8) + offset[t] */
    const int64_t nb = k / QBLOCK;
    for (int64_t r = 0; r < m; ++r) {
        const uint16_t* src = x + r * ldx;
        uint16_t* dst = out + r * k;
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4)
            for (int t = 0; t < 4; ++t)
                for (int j = 0; j < 32; ++j)
                    dst[b * QBLOCK + t * 32 + j] = src[(b + j / 8) * QBLOCK + 2 * (j % 8) + offset[t]];
        memcpy(dst + b * QBLOCK, src + b * QBLOCK, sizeof(uint16_t) * (size_t)((nb - b) * QBLOCK));
    }
}

/* How a weight row's scales apply: one per row (after the sums), one per block, one per 16 values. */
enum { SCALE_ROW = 0, SCALE_BLOCK = 1, SCALE_HALF = 2 };

/* The weight's scale for block b's 16 pair sums. */
static inline __m512 block_scale(int mode, const float* ws, int64_t b)
{
    if (mode == SCALE_HALF) { /* lanes 0-7 the first 16 values' scale, 8-15 the last's: one load, one permute */
        const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m128 pair = _mm_castpd_ps(_mm_load_sd((const double*)(ws + 2 * b)));
        return _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(pair));
    }
    return _mm512_set1_ps(ws[b]);
}

/* Block b's share of out[r] for r < rows (rows and c constants at each call: acc[r][c] stays in a
 * register): without a scale (one per row, applied after the sums) the dot products accumulate
 * directly; with one they are scaled into the accumulator. */
static inline __attribute__((always_inline)) void qb_block(const int rows, const int c, int q4, const uint8_t* wq,
                                                           const float* ws, int mode, int64_t b, const uint16_t* x,
                                                           int64_t ldx, __m512 acc[][4])
{
    const __m512bh w = q4 ? q4_block(wq, b) : q8_block(wq, b);
    if (mode == SCALE_ROW) {
        for (int r = 0; r < rows; ++r)
            acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, (__m512bh)_mm512_loadu_si512(x + r * ldx + b * QBLOCK));
        return;
    }
    const __m512 s = block_scale(mode, ws, b);
    for (int r = 0; r < rows; ++r) {
        const __m512 dot =
            _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(x + r * ldx + b * QBLOCK));
        acc[r][c] = _mm512_fmadd_ps(dot, s, acc[r][c]);
    }
}

/* out[r] = weight row . activation row r (bf16, rows ldx apart) without the block terms, for r < rows
 * (a constant in each caller). One row keeps four accumulators (blocks in turn), two rows two each, so
 * that independent FMA chains hide their latency; more rows overlap their own chains. */
static inline __attribute__((always_inline)) void qb_row_dots(const int rows, int q4, const uint8_t* wq,
                                                              const float* ws, int mode, int64_t nb,
                                                              const uint16_t* x, int64_t ldx, float* out)
{
    const int chains = rows == 1 ? 4 : rows == 2 ? 2 : 1;
    __m512 acc[QB_ROWS][4];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < chains; ++c) acc[r][c] = _mm512_setzero_ps();
    int64_t b = 0;
    if (q4) { /* x in x_quads' order */
        for (; b + 4 * chains <= nb; b += 4 * chains)
            for (int c = 0; c < chains; ++c) q4_quad(rows, c, wq, ws, b + 4 * c, x, ldx, acc);
        for (; b + 4 <= nb; b += 4) q4_quad(rows, 0, wq, ws, b, x, ldx, acc);
    } else {
        for (; b + chains <= nb; b += chains)
            for (int c = 0; c < chains; ++c) qb_block(rows, c, q4, wq, ws, mode, b + c, x, ldx, acc);
    }
    for (; b < nb; ++b) qb_block(rows, 0, q4, wq, ws, mode, b, x, ldx, acc);
    for (int r = 0; r < rows; ++r) {
        __m512 sum = acc[r][0];
        for (int c = 1; c < chains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
        out[r] = _mm512_reduce_add_ps(sum) * (mode == SCALE_ROW ? ws[0] : 1.0f);
    }
}

static void qb_row_dots_n(int rows, int q4, const uint8_t* wq, const float* ws, int mode, int64_t nb,
                          const uint16_t* x, int64_t ldx, float* out)
{
    switch (rows) {  /* one unrolled copy per row count */
#define QB_CASE(R) case R: qb_row_dots(R, q4, wq, ws, mode, nb, x, ldx, out); break;
        QB_CASE(1) QB_CASE(2) QB_CASE(3) QB_CASE(4) QB_CASE(5) QB_CASE(6) QB_CASE(7) QB_CASE(8)
#undef QB_CASE
    }
}

/* qb_row_dots of two q4 weight rows (wq and the next, row_bytes apart) for r < rows <= QB_PAIR_ROWS (a
 * constant in each caller), one chain a row and weight row: for more than two activation rows (the only
 * counts it is called for) qb_row_dots' sums in its order, bit for bit. On 2 EPYC cores, 16 rows of a Q4_K
 * 1536 x 8960 weight 3.00 -> 2.2 ms, of a 17920 x 1536 one 4.87 -> 4.4 ms (activation loads halved). */
#define QB_PAIR_ROWS 4
static inline __attribute__((always_inline)) void q4_pair_dots(const int rows, const uint8_t* wq, int64_t row_bytes,
                                                               const float* ws, int64_t nb, const uint16_t* xp,
                                                               int64_t ldxp, float* out0, float* out1)
{
    __m512 acc0[QB_PAIR_ROWS][4], acc1[QB_PAIR_ROWS][4];
    for (int r = 0; r < rows; ++r) acc0[r][0] = acc1[r][0] = _mm512_setzero_ps();
    const uint8_t* wq1 = wq + row_bytes;
    const float* ws1 = ws + nb;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) q4_quad_pair(rows, wq, wq1, ws, ws1, b, xp, ldxp, acc0, acc1);
    for (; b < nb; ++b) {
        qb_block(rows, 0, 1, wq, ws, SCALE_BLOCK, b, xp, ldxp, acc0);
        qb_block(rows, 0, 1, wq1, ws1, SCALE_BLOCK, b, xp, ldxp, acc1);
    }
    for (int r = 0; r < rows; ++r) {
        out0[r] = _mm512_reduce_add_ps(acc0[r][0]);
        out1[r] = _mm512_reduce_add_ps(acc1[r][0]);
    }
}

static void q4_pair_dots_n(int rows, const uint8_t* wq, int64_t row_bytes, const float* ws, int64_t nb,
                           const uint16_t* xp, int64_t ldxp, float* out0, float* out1)
{
    for (int r = 0; r < rows; r += QB_PAIR_ROWS) {
        const int n = rows - r < QB_PAIR_ROWS ? rows - r : QB_PAIR_ROWS;
        const uint16_t* x = xp + r * ldxp;
        switch (n) {  /* one unrolled copy per row count */
#define QB_PAIR_CASE(R) case R: q4_pair_dots(R, wq, row_bytes, ws, nb, x, ldxp, out0 + r, out1 + r); break;
            QB_PAIR_CASE(1) QB_PAIR_CASE(2) QB_PAIR_CASE(3) QB_PAIR_CASE(4)
#undef QB_PAIR_CASE
        }
    }
}
#endif

int quant_linear_bf16(const uint16_t* x, int64_t m, int64_t ldx, int kind, const void* qs, const void* scales,
                      const void* mins, const float* supers, int64_t group, int64_t n, int64_t k, const float* bias,
                      float* out, int64_t ldo)
{
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (m < 1 || m >= QB_MAX_ROWS || n < 1 || k < QBLOCK || k % QBLOCK || ldx < k || ldo < n) return -1;
    if ((kind & QUANT_INT8_ACTIVATIONS) || !takes_kind(kind, mins, supers, group, k)) return -1; /* (int8: quant_linear_f32's) */
    const int q4 = kind & QUANT_LAYOUT_Q4;
    const int64_t nb = k / QBLOCK, scales_per_row = k / group, row_bytes = q4 ? k / 2 : k;
    const int mode = group == 16 ? SCALE_HALF : group == QBLOCK ? SCALE_BLOCK : SCALE_ROW;
    const int terms = q4 || mins; /* whether dots need the rows' block sums */
    float* xs = NULL;
    uint16_t* xp = NULL; /* q4: the rows in x_quads' order */
    if (q4) {
        xp = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(m * k));
        if (!xp) return -1;
        x_quads(x, m, ldx, k, xp);
    }
    if (terms) {
        xs = (float*)malloc(sizeof(float) * (size_t)(m * nb));
        if (!xs) { free(xp); return -1; }
        for (int64_t r = 0; r < m; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                const __m512 lo = load_bf16x16(x + r * ldx + b * QBLOCK);
                const __m512 hi = load_bf16x16(x + r * ldx + b * QBLOCK + 16);
                xs[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
            }
    }
    const int64_t chunks = (n + QB_CHUNK - 1) / QB_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t o0 = c * QB_CHUNK, o1 = o0 + QB_CHUNK < n ? o0 + QB_CHUNK : n;
        float buf[supers ? ROW_SCALES_FLOATS(2, k) : 1]; /* a row pair's decoded scales (the super-block form) */
        for (int64_t r0 = 0; r0 < m; r0 += QB_ROWS) {
            const int rows = (int)(m - r0 < QB_ROWS ? m - r0 : QB_ROWS);
            for (int64_t o = o0; o < o1;) {
                /* a q4 weight's rows two at a time for several activation rows (q4_pair_dots) */
                const int pair = q4 && rows > 2 && o + 1 < o1;
                float dots[2][QB_ROWS];
                const uint8_t* wq = (const uint8_t*)qs + o * row_bytes;
                const float *ws, *wm;
                row_scales(scales, mins, supers, group, k, o, 1 + pair, buf, &ws, &wm);
                if (pair)
                    q4_pair_dots_n(rows, wq, row_bytes, ws, nb, xp + r0 * k, k, dots[0], dots[1]);
                else
                    qb_row_dots_n(rows, q4, wq, ws, mode, nb, q4 ? xp + r0 * k : x + r0 * ldx, q4 ? k : ldx, dots[0]);
                for (int p = 0; p <= pair; ++p, ++o) {
                    const float* row_ws = ws + p * scales_per_row;
                    const float* row_wm = wm ? wm + p * scales_per_row : NULL;
                    const float add = bias ? bias[o] : 0.0f;
                    for (int r = 0; r < rows; ++r)
                        out[(r0 + r) * ldo + o] = dots[p][r] + (terms ? block_terms(q4 ? -128.0f : 0.0f, row_ws, row_wm, nb, xs + (r0 + r) * nb) : 0.0f) + add;
                }
            }
        }
    }
    free(xs);
    free(xp);
    return 0;
#else
    (void)x, (void)m, (void)ldx, (void)kind, (void)qs, (void)scales, (void)mins, (void)supers, (void)group, (void)n;
    (void)k;
    (void)bias, (void)out, (void)ldo;
    return -1;
#endif
}
