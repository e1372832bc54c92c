/* Weight-only products of a few fp32 activation rows with a q4 weight (quant_linear.c's layout: values
 * 0..15 two a byte, a scale and a min per 32) on AVX-512 without a single cross-lane shuffle of the
 * weight: the widened kernel's share of the step on CPUs without native bf16 (AVX-512 F/BW/VL, the
 * common cloud server), where quant_linear.c's block conversion (two zero-extensions, two int-to-float
 * conversions and two FMAs a block per 16 lanes) and not the weight's bytes bounded a decode step.
 *
 * A value q becomes an fp32 value without a conversion: the bits 0x3F800000 | q << 19 are 1 + q / 16
 * (q in the top of the mantissa), so x . w = 16 s (x . v) + (m - 16 s) sum(x) with v = 1 + q / 16, each
 * product rounded once as in the dense product. Four blocks at a time: their 64 bytes are 16 dwords,
 * each dword's eight nibbles a shift and one vpternlog (AND the nibble's place, OR the exponent) from
 * 16 lanes of v; the rows are copied once per call into that order (quant_rows.h), and the four
 * blocks' scales fill four lanes each. The rows' block sums are computed once per call. What differs
 * from the dense (dequantized) product is the grouping of the fp32 sums, as between builds.
 *
 * quant_q4_rows_f32 returns -1 (nothing written) where it does not apply: a build without AVX-512, 24
 * rows or more, fewer than four blocks a row, int8 activations asked, or operands quant_linear_f32
 * would not take; quant_linear_f32 then runs its own kernel. */
#include "common.h"
#include "entry_points.h"
#include "quant_rows.h"

#if defined(__AVX512F__)
/* The quad's lanes 4i..4i + 3 take block b + i's scale. */
static inline __m512 quad_scales(const float* ws, int64_t b)
{
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(ws + b)));
}

/* Blocks b..b + 3 of a q4 weight row against the rows in quad order (xp: row 0, the four blocks' 128
 * values at xp + b * 32: eight runs of 16, run t nibble t of each dword), s-scaled into acc[r][c]
 * (rows and c constants at each call: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void f32_quad(const int rows, const int c, const uint8_t* wq,
                                                           const float* ws, int64_t b, const float* xp,
                                                           int64_t ldxp, __m512 acc[][4])
{
    const __m512i words = _mm512_loadu_si512(wq + b * (QROW_BLOCK / 2));
    const __m512i place = _mm512_set1_epi32(0xF << 19), one = _mm512_set1_epi32(0x3F800000);
    __m512 v[8];
    /* nibble t sits at bits 4t..4t + 3: moved to bits 19..22 */
#define QR_VALUE(t, moved) v[t] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32((moved), place, one, 0xEA))
    QR_VALUE(0, _mm512_slli_epi32(words, 19));
    QR_VALUE(1, _mm512_slli_epi32(words, 15));
    QR_VALUE(2, _mm512_slli_epi32(words, 11));
    QR_VALUE(3, _mm512_slli_epi32(words, 7));
    QR_VALUE(4, _mm512_slli_epi32(words, 3));
    QR_VALUE(5, _mm512_srli_epi32(words, 1));
    QR_VALUE(6, _mm512_srli_epi32(words, 5));
    QR_VALUE(7, _mm512_srli_epi32(words, 9));
#undef QR_VALUE
    const __m512 s = quad_scales(ws, b);
    for (int r = 0; r < rows; ++r) {
        const float* xr = xp + r * ldxp + b * QROW_BLOCK;
        /* two chains of four products, joined before the block's scale */
        __m512 d0 = _mm512_mul_ps(v[0], _mm512_loadu_ps(xr));
        __m512 d1 = _mm512_mul_ps(v[1], _mm512_loadu_ps(xr + 16));
        for (int t = 2; t < 8; t += 2) {
            d0 = _mm512_fmadd_ps(v[t], _mm512_loadu_ps(xr + 16 * t), d0);
            d1 = _mm512_fmadd_ps(v[t + 1], _mm512_loadu_ps(xr + 16 * t + 16), d1);
        }
        acc[r][c] = _mm512_fmadd_ps(_mm512_add_ps(d0, d1), s, acc[r][c]);
    }
}

/* out[r] = 16 sum_b s_b (x_b . v_b) over the row's whole quads, for r < rows (a constant in each
 * caller); one row keeps four accumulators (quads in turn), two rows two each. */
static inline __attribute__((always_inline)) void f32_quad_dots(const int rows, const uint8_t* wq, const float* ws,
                                                                int64_t quads, const float* xp, int64_t ldxp,
                                                                float* out)
{
    const int chains = rows == 1 ? 4 : rows == 2 ? 2 : 1;
    __m512 acc[QROW_ROWS][4];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < chains; ++c) acc[r][c] = _mm512_setzero_ps();
    int64_t q = 0;
    for (; q + chains <= quads; q += chains)
        for (int c = 0; c < chains; ++c) f32_quad(rows, c, wq, ws, 4 * (q + c), xp, ldxp, acc);
    for (; q < quads; ++q) f32_quad(rows, 0, wq, ws, 4 * q, xp, ldxp, acc);
    for (int r = 0; r < rows; ++r) {
        __m512 sum = acc[r][0];
        for (int c = 1; c < chains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
        out[r] = 16.0f * _mm512_reduce_add_ps(sum);
    }
}

static void f32_quad_dots_n(int rows, const uint8_t* wq, const float* ws, int64_t quads, const float* xp,
                            int64_t ldxp, float* out)
{
    switch (rows) {  /* one unrolled copy per row count */
#define QR_CASE(R) case R: f32_quad_dots(R, wq, ws, quads, xp, ldxp, out); break;
        QR_CASE(1) QR_CASE(2) QR_CASE(3) QR_CASE(4) QR_CASE(5) QR_CASE(6) QR_CASE(7) QR_CASE(8)
#undef QR_CASE
    }
}

/* x [m, k] (rows ldx apart) -> out [m, 4 * quads * 32]: each quad's eight runs of 16, run t lane L
 * holding the value nibble t of dword L stands for (block L / 4, byte 4 (L % 4) + t / 2, the high
 * nibble, + 16, for odd t). */
static void x_quads_f32(const float* x, int64_t m, int64_t ldx, int64_t quads, int64_t k, float* out)
{
    for (int64_t r = 0; r < m; ++r)
        for (int64_t q = 0; q < quads; ++q) {
            const float* src = x + r * ldx + q * 4 * QROW_BLOCK;
            float* dst = out + r * k + q * 4 * QROW_BLOCK;
            for (int t = 0; t < 8; ++t)
                for (int lane = 0; lane < 16; ++lane)
                    dst[16 * t + lane] = src[(lane / 4) * QROW_BLOCK + 4 * (lane % 4) + t / 2 + 16 * (t % 2)];
        }
}

/* The q4 weight row's blocks from `first` on against the rows in their own order (x_b . w_b, with
 * the min): the blocks after the last whole quad. */
static float tail_dot(const uint8_t* wq, const float* ws, const float* wm, int64_t first, int64_t nb,
                      const float* x)
{
    float sum = 0.0f;
    for (int64_t b = first; b < nb; ++b)
        for (int j = 0; j < QROW_BLOCK / 2; ++j) {
            const uint8_t byte = wq[b * (QROW_BLOCK / 2) + j];
            sum += x[b * QROW_BLOCK + j] * (ws[b] * (float)(byte & 0x0F) + wm[b]);
            sum += x[b * QROW_BLOCK + j + 16] * (ws[b] * (float)(byte >> 4) + wm[b]);
        }
    return sum;
}
#endif

int quant_q4_rows_f32(const float* x, int64_t m, int64_t ldx, int kind, const void* qs, const float* scales,
                      const float* mins, int64_t group, int64_t n, int64_t k, const float* bias, float* out,
                      int64_t ldo)
{
#if defined(__AVX512F__)
    const int64_t nb = k / QROW_BLOCK, quads = nb / 4;
    if (m < 1 || m >= QROW_MAX_ROWS || n < 1 || k % QROW_BLOCK || quads < 1 || ldx < k || ldo < n) return -1;
    if (kind != QROW_LAYOUT_Q4 || group != QROW_BLOCK || !mins) return -1;
    float* xp = (float*)malloc(sizeof(float) * (size_t)(m * k + m * nb));
    if (!xp) return -1;
    float* xs = xp + m * k; /* each row's block sums */
    x_quads_f32(x, m, ldx, quads, k, xp);
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b)
            xs[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + r * ldx + b * QROW_BLOCK),
                                                                _mm512_loadu_ps(x + r * ldx + b * QROW_BLOCK + 16)));
    const int64_t chunks = (n + QROW_CHUNK - 1) / QROW_CHUNK, row_bytes = k / 2, whole = 4 * quads;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t o0 = c * QROW_CHUNK, o1 = o0 + QROW_CHUNK < n ? o0 + QROW_CHUNK : n;
        for (int64_t r0 = 0; r0 < m; r0 += QROW_ROWS) {
            const int rows = (int)(m - r0 < QROW_ROWS ? m - r0 : QROW_ROWS);
            for (int64_t o = o0; o < o1; ++o) {
                float dots[QROW_ROWS];
                const uint8_t* wq = (const uint8_t*)qs + o * row_bytes;
                const float* ws = scales + o * nb;
                const float* wm = mins + o * nb;
                f32_quad_dots_n(rows, wq, ws, quads, xp + r0 * k, k, dots);
                for (int r = 0; r < rows; ++r) {
                    const float* xs_r = xs + (r0 + r) * nb;
                    out[(r0 + r) * ldo + o] = dots[r] + block_terms(-16.0f, ws, wm, whole, xs_r)
                                              + tail_dot(wq, ws, wm, whole, nb, x + (r0 + r) * ldx)
                                              + (bias ? bias[o] : 0.0f);
                }
            }
        }
    }
    free(xp);
    return 0;
#else
    (void)x, (void)m, (void)ldx, (void)kind, (void)qs, (void)scales, (void)mins, (void)group, (void)n, (void)k;
    (void)bias, (void)out, (void)ldo;
    return -1;
#endif
}
