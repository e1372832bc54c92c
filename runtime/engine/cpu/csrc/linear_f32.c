/* An fp32 linear layer for a few rows (a decode batch), on a copy of the weight laid out in
 * column panels (runtime/cpu/prepacked.py packs it once, after loading).
 *
 * Why not oneDNN's or MKL's call for those rows: at a decode batch's row count a linear layer
 * is still bound by the FMA units, but the weight arrives from memory, once per step, and the
 * libraries' kernels ran well below their rate on a weight already in cache. This kernel keeps a
 * block of the weight in cache while every row passes over it, and spreads the fetch of the next
 * block across the passes of the current one, one cache line every few steps (a burst of
 * prefetches at the start of a block was no better than none; docs/benchmarks.md has the figures).
 *
 * Layout: an [n, k] weight as [n / 16][k][16]: panel p holds columns 16p..16p+15, k-major, so
 * the 16 weights of one depth are one cache line. A register block is ROWS rows by one column
 * group: two vectors (AVX2: one panel, 2 x 8 lanes; AVX-512: two panels, 2 x 16 lanes, or one
 * vector for a last panel on its own).
 *
 * Every output is a chain of FMAs over each block of KC depths in order, the blocks' sums added
 * in order (two levels: the rounding error grows with KC + k / KC terms, not k), then the bias: a
 * row's result depends neither on the other rows nor on how many there are, and is the same at
 * every build level that runs it. Plain C builds decline (-1): F.linear serves there. */
/* The order of the sums is the contract above: no reassociation (the library builds with
 * -fassociative-math, which let the compiler split a short row block's chain into partial sums),
 * in this file only. Set before the includes so that the intrinsics inline with the same options. */
#if defined(__clang__)
#pragma clang fp reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math")
#endif
#include "lanes_f32.h"
#include "entry_points.h"

#define PANEL 16      /* columns per panel */
#define KC 256        /* depth per block: a column group's block (16 or 32 KiB) stays in cache */
#define ROWS 6        /* rows per register block: 12 accumulators, two weight vectors, one broadcast */
#define K_CHUNK 16    /* depths between two rounds of prefetching */

#if AV_W > 1
#define GROUP_PANELS (2 * AV_W / PANEL)  /* panels per column group (AVX-512: the last may have one) */

/* The next block of the weight that the calling thread multiplies: its lines are fetched by the
 * row blocks of the current one, each taking an equal share. */
typedef struct {
    const float* panel[2];  /* the block's start in each panel of its group (panels of them) */
    int64_t lines;          /* lines per panel (one per depth) */
    int64_t panels;         /* 0 when nothing follows */
} NextBlock;

/* always inlined: a function that only prefetches has no effect GCC can see, so a call to it is
 * dropped as dead code */
static inline __attribute__((always_inline)) void fetch_lines(const NextBlock* next, int64_t from, int64_t to)
{
    for (int64_t l = from; l < to; ++l) {
        const int64_t j = l >= next->lines;  /* at most two panels */
        _mm_prefetch((const char*)(next->panel[j] + (l - j * next->lines) * PANEL), _MM_HINT_T0);
    }
}

/* c[r][0..vecs AV_W) (rows ldc apart) = (first ? 0 : c) + (sum over d < kc of a[r][d] * b at depth
 * d), for r < rows, plus the bias on the last block; meanwhile fetches lines [fetch_from,
 * fetch_to) of `next`. `rows` and `vecs` (1 or 2 weight vectors per depth) are constants in each
 * caller (row_block_n), so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_block(
    const int rows, const int vecs, const float* a, int64_t lda, const float* b, int64_t b_vec_stride, int64_t kc,
    float* c, int64_t ldc, int first, const float* bias, const NextBlock* next, int64_t fetch_from, int64_t fetch_to)
{
    av acc[ROWS][2];
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < vecs; ++v)
            acc[r][v] = av_set1(0.0f);
    FetchShare share = fetch_share(fetch_from, fetch_to, K_CHUNK, kc);
    for (int64_t d0 = 0; d0 < kc; d0 += K_CHUNK) {
        const int64_t d1 = d0 + K_CHUNK < kc ? d0 + K_CHUNK : kc;
        const int64_t fetch_start = fetch_share_next(&share);
        fetch_lines(next, fetch_start, share.at);
        for (int64_t d = d0; d < d1; ++d) {
            const av b0 = av_load(b + d * PANEL);
            const av b1 = vecs == 2 ? av_load(b + d * PANEL + b_vec_stride) : b0;
            for (int r = 0; r < rows; ++r) {
                const av x = av_set1(a[r * lda + d]);
                acc[r][0] = av_fma(x, b0, acc[r][0]);
                if (vecs == 2) acc[r][1] = av_fma(x, b1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < vecs; ++v) {
            av out = first ? acc[r][v] : av_add(av_load(c + r * ldc + v * AV_W), acc[r][v]);
            if (bias) out = av_add(out, av_load(bias + v * AV_W));
            av_store(c + r * ldc + v * AV_W, out);
        }
}

static void row_block_n(int rows, int vecs, const float* a, int64_t lda, const float* b, int64_t b_vec_stride,
                        int64_t kc, float* c, int64_t ldc, int first, const float* bias, const NextBlock* next,
                        int64_t fetch_from, int64_t fetch_to)
{
    /* one unrolled copy per row count and vector count */
#define ROW_CASE(R, V) case R: row_block(R, V, a, lda, b, b_vec_stride, kc, c, ldc, first, bias, next, fetch_from, fetch_to); break;
    if (vecs == 2) {
        switch (rows) { ROW_CASE(1, 2) ROW_CASE(2, 2) ROW_CASE(3, 2) ROW_CASE(4, 2) ROW_CASE(5, 2) ROW_CASE(6, 2) }
    } else {
        switch (rows) { ROW_CASE(1, 1) ROW_CASE(2, 1) ROW_CASE(3, 1) ROW_CASE(4, 1) ROW_CASE(5, 1) ROW_CASE(6, 1) }
    }
#undef ROW_CASE
}

/* The panels of block b when blocks of `per` panels split `panels` (fewer for the last block when
 * they do not divide evenly): the column groups of row_block, the gemv and streaming blocks. */
static inline int block_panels(int64_t b, int64_t per, int64_t panels)
{
    const int64_t left = panels - b * per;
    return (int)(left < per ? left : per);
}

/* One row (a matrix-vector product): the row blocks above keep two accumulators per row, so with
 * a single row each FMA waits for the one before it in its chain and the FMA units idle; here
 * GEMV_PANELS panels are multiplied at once (eight accumulators, eight independent chains), their
 * lines streamed side by side. Each output's chain is the same as in row_block (the depths of a
 * KC block in order from zero, the blocks added in order, then the bias), so a row's result is the
 * same bits as in a batch of any size. The hardware prefetcher follows the GEMV_PANELS streams (a
 * software prefetch a few lines ahead of each measured no faster). */
#define GEMV_ACC 8                                  /* accumulators: enough chains to cover the FMA latency */
#define GEMV_PANELS (GEMV_ACC * AV_W / PANEL)       /* AVX2: 4 panels of 2 vectors; AVX-512: 8 of 1 */

/* out[0..16 np) = x[0..k) times panels [0, np) of the copy starting at w (k lines each), plus
 * bias; np is a constant in each caller (gemv_panels_n), so the loops unroll. */
static inline __attribute__((always_inline)) void gemv_panels(const int np, const float* x, const float* w,
                                                               int64_t k, const float* bias, float* out)
{
    enum { VECS = PANEL / AV_W };
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        av acc[GEMV_PANELS][VECS];
        for (int p = 0; p < np; ++p)
            for (int v = 0; v < VECS; ++v)
                acc[p][v] = av_set1(0.0f);
        for (int64_t d = k0; d < k0 + kc; ++d) {
            const av xd = av_set1(x[d]);
            for (int p = 0; p < np; ++p) {
                const float* line = w + (p * k + d) * PANEL;
                for (int v = 0; v < VECS; ++v)
                    acc[p][v] = av_fma(xd, av_load(line + v * AV_W), acc[p][v]);
            }
        }
        for (int p = 0; p < np; ++p)
            for (int v = 0; v < VECS; ++v) {
                float* o = out + p * PANEL + v * AV_W;
                av sum = k0 == 0 ? acc[p][v] : av_add(av_load(o), acc[p][v]);
                if (bias && k0 + kc >= k) sum = av_add(sum, av_load(bias + p * PANEL + v * AV_W));
                av_store(o, sum);
            }
    }
}

static void gemv_panels_n(int np, const float* x, const float* w, int64_t k, const float* bias, float* out)
{
    switch (np) {  /* one unrolled copy per panel count */
#define GEMV_CASE(P) case P: gemv_panels(P, x, w, k, bias, out); break;
    GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4)
#if GEMV_PANELS > 4
    GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
#endif
#undef GEMV_CASE
    }
}

/* out[0, n) = x[0, k) times the panel copy w of an [n, k] weight, plus bias: blocks of GEMV_PANELS
 * panels shared among the threads. */
static void gemv_f32(const float* x, const float* w, int64_t n, int64_t k, const float* bias, float* out)
{
    const int64_t panels = n / PANEL;
    const int64_t blocks = (panels + GEMV_PANELS - 1) / GEMV_PANELS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t p0 = b * GEMV_PANELS;
        gemv_panels_n(block_panels(b, GEMV_PANELS, panels), x, w + p0 * k * PANEL, k, bias ? bias + p0 * PANEL : NULL,
                      out + p0 * PANEL);
    }
}
#endif

#if AV_W == 8
/* Two or three rows (AVX2): as in the one-row path, STREAM_PANELS panels are read side by side (the
 * memory system keeps a stream per panel in flight; row_block's one panel at a time streamed at
 * ~2/3 of the rate), half a line (8 columns) of each per pass so that R rows x STREAM_PANELS
 * accumulators fit the 16 registers; the other half comes from cache in a second pass. Each
 * output's chain is row_block's (a KC block's depths in order from zero, added to the previous
 * blocks' sum, then the bias), so a row has the same bits here as alone or in any batch. */
#define STREAM_PANELS 4
#define STREAM_ROWS 3

static inline __attribute__((always_inline)) void stream_rows(const int R, const int np, const float* x, int64_t ldx,
                                                               const float* w, int64_t k, int64_t k0, int64_t kc,
                                                               const float* bias, float* out, int64_t ldo)
{
    for (int half = 0; half < 2; ++half) {
        av acc[STREAM_ROWS][STREAM_PANELS];
        for (int r = 0; r < R; ++r)
            for (int p = 0; p < np; ++p) acc[r][p] = av_set1(0.0f);
        for (int64_t d = k0; d < k0 + kc; ++d) {
            av xv[STREAM_ROWS];
            for (int r = 0; r < R; ++r) xv[r] = av_set1(x[r * ldx + d]);
            for (int p = 0; p < np; ++p) {
                const av wv = av_load(w + (p * k + d) * PANEL + half * AV_W);
                for (int r = 0; r < R; ++r) acc[r][p] = av_fma(xv[r], wv, acc[r][p]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int p = 0; p < np; ++p) {
                float* o = out + r * ldo + p * PANEL + half * AV_W;
                av sum = k0 == 0 ? acc[r][p] : av_add(av_load(o), acc[r][p]);
                if (bias && k0 + kc >= k) sum = av_add(sum, av_load(bias + p * PANEL + half * AV_W));
                av_store(o, sum);
            }
    }
}

static void stream_rows_n(int R, int np, const float* x, int64_t ldx, const float* w, int64_t k, int64_t k0,
                          int64_t kc, const float* bias, float* out, int64_t ldo)
{
#define STREAM_CASE(RR, P) \
    if (R == RR && np == P) { stream_rows(RR, P, x, ldx, w, k, k0, kc, bias, out, ldo); return; }
    STREAM_CASE(2, 4) STREAM_CASE(3, 4) STREAM_CASE(2, 3) STREAM_CASE(3, 3) STREAM_CASE(2, 2) STREAM_CASE(3, 2)
    STREAM_CASE(2, 1) STREAM_CASE(3, 1)
#undef STREAM_CASE
}

/* 2 or 3 rows: blocks of STREAM_PANELS panels shared among the threads, each a KC block at a time.
 * (From 4 rows on row_block keeps up: its single stream measured no slower than two passes.) */
static void stream_linear(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t k,
                          const float* bias, float* out)
{
    const int64_t panels = n / PANEL;
    const int64_t blocks = (panels + STREAM_PANELS - 1) / STREAM_PANELS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t p0 = b * STREAM_PANELS;
        const int np = block_panels(b, STREAM_PANELS, panels);
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            stream_rows_n((int)m, np, x, ldx, w + p0 * k * PANEL, k, k0, kc, bias ? bias + p0 * PANEL : NULL,
                          out + p0 * PANEL, n);
        }
    }
}
#endif

/* out[m, n] (row stride n) = x[m, k] (rows ldx apart) times the panel copy w of an [n, k] weight,
 * transposed, plus bias[n] (or NULL). Returns 0, or -1 where this build has no vector kernel or
 * n is not a whole number of panels: the caller runs F.linear then. */
int linear_f32(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t k,
               const float* bias, float* out)
{
#if AV_W > 1
    if (m <= 0 || k <= 0 || n <= 0 || n % PANEL) return -1;
    if (m == 1) {
        gemv_f32(x, w, n, k, bias, out);
        return 0;
    }
#if AV_W == 8
    if (m <= STREAM_ROWS) {
        stream_linear(x, m, ldx, w, n, k, bias, out);
        return 0;
    }
#endif
    const int64_t panels = n / PANEL;
    const int64_t groups = (panels + GROUP_PANELS - 1) / GROUP_PANELS;
    /* vector 1 of a group at one depth: the next 8 lanes of the panel (AVX2), or the next panel */
    const int64_t b_vec_stride = GROUP_PANELS == 2 ? k * PANEL : AV_W;
    const int64_t row_blocks = (m + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const float* group = w + g * GROUP_PANELS * k * PANEL;
        const int64_t own_panels = block_panels(g, GROUP_PANELS, panels);
        const int vecs = (int)(own_panels * PANEL / AV_W);
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            NextBlock next;  /* this group's next block, else the next group's first (the same thread's, mostly) */
            if (k0 + kc < k) {
                next.panel[0] = group + (k0 + kc) * PANEL;
                next.panels = own_panels;
                next.lines = k - k0 - kc < KC ? k - k0 - kc : KC;
            } else if (g + 1 < groups) {
                next.panel[0] = group + GROUP_PANELS * k * PANEL;
                next.panels = block_panels(g + 1, GROUP_PANELS, panels);
                next.lines = k < KC ? k : KC;
            } else {  /* nothing follows the last block */
                next.panel[0] = group;
                next.panels = next.lines = 0;
            }
            next.panel[1] = next.panels == 2 ? next.panel[0] + k * PANEL : next.panel[0];
            const int64_t total_lines = next.lines * next.panels;
            for (int64_t rb = 0; rb < row_blocks; ++rb) {
                const int64_t r0 = rb * ROWS;
                const int rows = (int)(m - r0 < ROWS ? m - r0 : ROWS);
                const int64_t col = g * GROUP_PANELS * PANEL;
                row_block_n(rows, vecs, x + r0 * ldx + k0, ldx, group + k0 * PANEL, b_vec_stride, kc,
                            out + r0 * n + col, n, k0 == 0, k0 + kc >= k && bias ? bias + col : NULL,
                            &next, total_lines * rb / row_blocks, total_lines * (rb + 1) / row_blocks);
            }
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)ldx; (void)w; (void)n; (void)k; (void)bias; (void)out;
    return -1;
#endif
}
