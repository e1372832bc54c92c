/* A bf16 linear layer for a few rows (a decode batch) on AVX512-BF16 dot products, for CPUs that
 * have them without AMX tiles (or with AMX switched off), reading the copy oneDNN packed for itself
 * there (runtime/cpu/prepacked.py checks its layout).
 *
 * Why: without AMX a decode batch's bf16 linears are bound by the dot-product units, and oneDNN's
 * call ran well below their rate while the weight streamed in from memory, as its fp32 kernel did
 * (linear_f32.c tells that story; this is the same design on bf16 pairs).
 *
 * Layout: oneDNN's packing for its AVX512-BF16 kernel, [n / 64][k / 2][64][2]: per 64-column block,
 * each pair of depths is 64 columns x 2 bf16 (256 bytes, four 16-column vectors, the form
 * VDPBF16PS multiplies). A register block is ROWS rows by one 64-column block: 24 fp32
 * accumulators, four weight vectors, one broadcast pair of x.
 *
 * Prefetching: with many rows each block is read once per 6-row block and its compute is long, so the
 * next block is fetched into L1 a few lines at a time meanwhile. With few rows (a decode step of a
 * few requests) the weight streams through once at memory speed: fetching a whole 32 KiB block ahead
 * into L1 evicted the lines about to be read, and the kernel ran at 26-29 GB/s of the host's ~33
 * (two cores of an AVX-512 EPYC); a fixed distance ahead into L2 (FETCH_AHEAD bytes of the thread's
 * own stream: the blocks a thread reads lie end to end) reaches 31-34 GB/s.
 *
 * Each output sums the products of each KP-pair block in order (VDPBF16PS adds a pair's two
 * products to its accumulator lane), adds the blocks' sums in order, then the bias, and rounds
 * once to bf16: a row's result does not depend on the other rows. */
#include "common.h"
#include "entry_points.h"

#define DP_COLS 64     /* columns per block of the layout */
#define KP 128         /* depth pairs per block: a column block's 32 KiB stays in cache */
#define ROWS 6
#define K_CHUNK 8      /* depth pairs between two rounds of prefetching */
#define DP_LINEAR_MAX_ROWS 64
#define FETCH_AHEAD 6144         /* bytes ahead of the weight pair being read (few rows) */
#define FETCH_AHEAD_MAX_ROWS 24  /* up to here the distance prefetch, above it the next block's */

#if defined(__AVX512BF16__)
/* always inlined: a function that only prefetches has no effect the compiler can see, so a call
 * to it is dropped as dead code */
static inline __attribute__((always_inline)) void dp_fetch(const uint16_t* next, int64_t from, int64_t to)
{
    for (int64_t l = from; l < to; ++l) _mm_prefetch((const char*)(next + l * 32), _MM_HINT_T0);
}

/* c[r][0..64) (fp32, rows 64 apart) = (first ? 0 : c) + sum over pairs p < kp of x pair p of row
 * r times the weight pair row p, for r < rows; meanwhile fetches lines [fetch_from, fetch_to) of
 * the next block (`next`, 64-byte lines), and with `ahead` the lines FETCH_AHEAD bytes past each
 * pair read. `rows` is a constant in each caller. */
static inline __attribute__((always_inline)) void dp_row_block(
    const int rows, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kp, float* c, int first,
    const uint16_t* next, int64_t fetch_from, int64_t fetch_to, int ahead)
{
    __m512 acc[ROWS][4];
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    FetchShare share = fetch_share(fetch_from, fetch_to, K_CHUNK, kp);
    for (int64_t p0 = 0; p0 < kp; p0 += K_CHUNK) {
        const int64_t p1 = p0 + K_CHUNK < kp ? p0 + K_CHUNK : kp;
        const int64_t fetch_start = fetch_share_next(&share);
        dp_fetch(next, fetch_start, share.at);
        for (int64_t p = p0; p < p1; ++p) {
            const uint16_t* wp = b + p * DP_COLS * 2;
            if (ahead)
                for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)wp + FETCH_AHEAD + 64 * l, _MM_HINT_T1);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
            for (int r = 0; r < rows; ++r) {
                int32_t pair;
                memcpy(&pair, a + r * lda + 2 * p, sizeof(pair));
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < 4; ++v) {
            float* o = c + r * DP_COLS + 16 * v;
            _mm512_store_ps(o, first ? acc[r][v] : _mm512_add_ps(_mm512_load_ps(o), acc[r][v]));
        }
}

static void dp_row_block_n(int rows, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kp, float* c,
                           int first, const uint16_t* next, int64_t fetch_from, int64_t fetch_to, int ahead)
{
    switch (rows) {  /* one unrolled copy per row count */
#define ROW_CASE(R) case R: dp_row_block(R, a, lda, b, kp, c, first, next, fetch_from, fetch_to, ahead); break;
        ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) ROW_CASE(5) ROW_CASE(6)
#undef ROW_CASE
    }
}
#endif

/* out [m, n] (contiguous) = x [m, k] (rows ldx apart) times the packed weight w (see above), plus
 * bias [n] when not NULL, in bf16 with fp32 sums; with float_out, out is fp32 and holds those bf16
 * values widened. Returns 0, or -1 (nothing written) when the build has no AVX512-BF16, m is
 * outside [1, 64], n is not a multiple of 64 or k not even. */
int dp_linear_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t n, int64_t k,
                   const uint16_t* bias, int float_out, void* out)
{
#if defined(__AVX512BF16__)
    if (n % DP_COLS || k % 2 || k < 2 || m < 1 || m > DP_LINEAR_MAX_ROWS || ldx < k) return -1;
    const int64_t pairs = k / 2, blocks = n / DP_COLS, row_blocks = (m + ROWS - 1) / ROWS;
    const int64_t block_elems = pairs * DP_COLS * 2;
    const int ahead = m <= FETCH_AHEAD_MAX_ROWS;
#pragma omp parallel
    {
        float c[DP_LINEAR_MAX_ROWS * DP_COLS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < blocks; ++cb) {
            const uint16_t* wb = w + cb * block_elems;
            for (int64_t p0 = 0; p0 < pairs; p0 += KP) {
                const int64_t kp = pairs - p0 < KP ? pairs - p0 : KP;
                /* the next block: this column block's next pairs, else the next column block's first */
                const uint16_t* next = p0 + kp < pairs ? wb + (p0 + kp) * DP_COLS * 2 : wb + block_elems;
                int64_t next_pairs = p0 + kp < pairs ? pairs - p0 - kp : (cb + 1 < blocks ? pairs : 0);
                if (next_pairs > KP) next_pairs = KP;
                const int64_t lines = ahead ? 0 : next_pairs * 4;  /* 256 bytes a pair */
                for (int64_t rb = 0; rb < row_blocks; ++rb) {
                    const int64_t r0 = rb * ROWS;
                    dp_row_block_n((int)(m - r0 < ROWS ? m - r0 : ROWS), x + r0 * ldx + 2 * p0, ldx,
                                   wb + p0 * DP_COLS * 2, kp, c + r0 * DP_COLS, p0 == 0, next,
                                   lines * rb / row_blocks, lines * (rb + 1) / row_blocks, ahead);
                }
            }
            for (int64_t r = 0; r < m; ++r)
                for (int v = 0; v < 4; ++v) {
                    __m512 s = _mm512_load_ps(c + r * DP_COLS + 16 * v);
                    if (bias) s = _mm512_add_ps(s, load_bf16x16(bias + cb * DP_COLS + 16 * v));
                    if (float_out)
                        _mm512_storeu_ps((float*)out + r * n + cb * DP_COLS + 16 * v, round_bf16x16(s));
                    else
                        _mm256_storeu_si256((__m256i*)((uint16_t*)out + r * n + cb * DP_COLS + 16 * v), f32x16_to_bf16(s));
                }
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)ldx; (void)w; (void)n; (void)k; (void)bias; (void)float_out; (void)out;
    return -1;
#endif
}
