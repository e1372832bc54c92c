/* A bf16 linear layer for a few rows (a decode batch) on AMX tiles, reading the weight copy that
 * oneDNN packed for itself (runtime/cpu/prepacked.py), and the switch that turns AMX on for every
 * kernel (tinyserve_amx).
 *
 * Why not oneDNN's own call for those rows: with few rows a linear layer streams its weight from
 * memory once and does little else, and oneDNN's kernel left part of the bandwidth unused (plus
 * a setup cost in every call; docs/benchmarks.md has the figures). This kernel walks the packed weight in address order, prefetches it
 * a few blocks ahead, and keeps each block's products on tiles.
 *
 * The weight layout is oneDNN's AB16b32a2b for an [n, k] weight: [n / 32][k / 32][16][32][2], a
 * 32-column by 32-deep block as 16 rows of (32 columns x 2 adjacent k), 2 KiB contiguous; the
 * caller checks that the copy has it. Each half of a block row (16 columns) is an AMX B tile
 * with a 128-byte row stride. */
#include "common.h"
#include "entry_points.h"
#include "amx.h"
#include <sys/syscall.h>
#include <unistd.h>

int tinyserve_amx_on = 0;

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* request 1: use AMX tiles in the kernels (the first time, asks the OS for the tile state:
 * arch_prctl fails on a CPU without AMX, and then they stay off); 0: do not; -1: only ask.
 * Returns 1 when AMX is now in use, 0 when not, -1 when this build cannot use AMX. Callers switch
 * it only while no kernel runs. */
int tinyserve_amx(int request)
{
#if AMX_COMPILED
    static int granted = 0;
    if (request == 1 && !granted)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    if (request >= 0) tinyserve_amx_on = request == 1 && granted;
    return tinyserve_amx_on;
#else
    (void)request;
    return -1;
#endif
}

#define LINEAR_PREFETCH_BLOCKS 6  /* blocks (2 KiB each) ahead of the one being multiplied */

#if AMX_COMPILED
/* The rows of one call: x [m, k] (rows ldx apart), m <= AMX_LINEAR_MAX_ROWS; rows from `full` on
 * (past the last multiple of 16) come from `tail`, a zero-padded copy 16 rows of k. */
typedef struct {
    const uint16_t* x;
    int64_t m, ldx, k, full;
    uint16_t* tail;
} Rows;

#define AMX_LINEAR_MAX_ROWS 64

/* Rows whose count is not a multiple of 16 get their last rows copied into a zero-padded tile
 * (a tile load reads 16 rows). Returns 0, or -1 when the copy cannot be allocated. */
static int rows_init(Rows* rows, const uint16_t* x, int64_t m, int64_t ldx, int64_t k)
{
    rows->x = x; rows->m = m; rows->ldx = ldx; rows->k = k;
    rows->full = m / 16 * 16;
    rows->tail = NULL;
    if (rows->full < m) {
        rows->tail = (uint16_t*)calloc((size_t)(16 * k), sizeof(uint16_t));
        if (!rows->tail) return -1;
        for (int64_t r = rows->full; r < m; ++r)
            memcpy(rows->tail + (r - rows->full) * k, x + r * ldx, (size_t)k * sizeof(uint16_t));
    }
    return 0;
}

/* c[r][j] = sum over k of x[r][k] * w[k][32 cb + j] for every row r (fp32, unrounded): the column
 * block at wb (k / 32 blocks of 2 KiB). Rows 32 at a time (four accumulator tiles: two row halves
 * by two column halves); the first pass reads the weight from memory, fetching ahead of itself,
 * later passes from cache. */
static void column_block(const Rows* rows, const uint16_t* wb, float c[AMX_LINEAR_MAX_ROWS][32])
{
    const int64_t k_blocks = rows->k / 32;
    for (int64_t r0 = 0; r0 < rows->m; r0 += 32) {
        const int two = rows->m - r0 > 16;  /* a second row half */
        const uint16_t* a0 = r0 < rows->full ? rows->x + r0 * rows->ldx : rows->tail;
        const int64_t lda0 = r0 < rows->full ? rows->ldx : rows->k;
        const uint16_t* a1 = r0 + 16 < rows->full ? rows->x + (r0 + 16) * rows->ldx : rows->tail;
        const int64_t lda1 = r0 + 16 < rows->full ? rows->ldx : rows->k;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
            const uint16_t* blk = wb + kb * 1024;
            if (r0 == 0) {  /* the first pass streams the weight: fetch ahead of it */
                const char* ahead = (const char*)(blk + LINEAR_PREFETCH_BLOCKS * 1024);
                _mm_prefetch(ahead, _MM_HINT_T0); _mm_prefetch(ahead + 512, _MM_HINT_T0);
                _mm_prefetch(ahead + 1024, _MM_HINT_T0); _mm_prefetch(ahead + 1536, _MM_HINT_T0);
            }
            _tile_loadd(6, blk, 128);
            _tile_loadd(7, blk + 32, 128);
            _tile_loadd(4, a0 + kb * 32, lda0 * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, a1 + kb * 32, lda1 * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, &c[r0][0], 128);
        _tile_stored(1, &c[r0][16], 128);
        if (two) { _tile_stored(2, &c[r0 + 16][0], 128); _tile_stored(3, &c[r0 + 16][16], 128); }
    }
}
#endif

/* out [m, n] (contiguous) = x [m, k] (rows ldx apart) times the packed weight w (see above),
 * plus bias [n] when not NULL, in bf16 with fp32 sums; with float_out, out is fp32 and holds those
 * bf16 values widened (what .float() of the bf16 result would hold). Columns are split between
 * the threads by 32-column blocks. Returns 0, or -1 (nothing written) when AMX is off or not
 * built, m is outside [1, 64], or n or k is not a multiple of 32. */
int amx_linear_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t n, int64_t k,
                    const uint16_t* bias, int float_out, void* out)
{
#if AMX_COMPILED
    if (!tinyserve_amx_on || n % 32 || k % 32 || m < 1 || m > AMX_LINEAR_MAX_ROWS || ldx < k) return -1;
    Rows rows;
    if (rows_init(&rows, x, m, ldx, k)) return -1;
#pragma omp parallel
    {
        amx_configure();
        float c[AMX_LINEAR_MAX_ROWS][32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < n / 32; ++cb) {
            column_block(&rows, w + cb * (k / 32) * 1024, c);
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            if (bias) { b0 = load_bf16x16(bias + cb * 32); b1 = load_bf16x16(bias + cb * 32 + 16); }
            for (int64_t r = 0; r < m; ++r) {
                const __m512 lo = _mm512_add_ps(_mm512_load_ps(c[r]), b0);
                const __m512 hi = _mm512_add_ps(_mm512_load_ps(c[r] + 16), b1);
                if (float_out) {
                    float* o = (float*)out + r * n + cb * 32;
                    _mm512_storeu_ps(o, round_bf16x16(lo));
                    _mm512_storeu_ps(o + 16, round_bf16x16(hi));
                } else {
                    uint16_t* o = (uint16_t*)out + r * n + cb * 32;
                    _mm256_storeu_si256((__m256i*)o, f32x16_to_bf16(lo));
                    _mm256_storeu_si256((__m256i*)(o + 16), f32x16_to_bf16(hi));
                }
            }
        }
        _tile_release();
    }
    free(rows.tail);
    return 0;
#else
    (void)x; (void)m; (void)ldx; (void)w; (void)n; (void)k; (void)bias; (void)float_out; (void)out;
    return -1;
#endif
}

/* The gated MLP's first half in one pass: out [m, inter] (contiguous) = silu(gate) * up, where
 * [gate | up] = x [m, k] times the packed merged weight w ([2 * inter, k], gate rows first), each
 * rounded to bf16 as the linear's own output would be, then silu_mul16 (the silu_mul_bf16
 * kernel's rounding). A thread takes gate column block cb and up block cb + inter / 32 together,
 * so the [m, 2 * inter] intermediate is never written. Returns 0, or -1 (nothing written) when AMX
 * is off or not built, m is outside [1, 64], or inter or k is not a multiple of 32. */
int amx_linear_silu_mul_bf16(const uint16_t* x, int64_t m, int64_t ldx, const uint16_t* w, int64_t inter,
                             int64_t k, uint16_t* out)
{
#if AMX_COMPILED
    if (!tinyserve_amx_on || inter % 32 || k % 32 || m < 1 || m > AMX_LINEAR_MAX_ROWS || ldx < k) return -1;
    Rows rows;
    if (rows_init(&rows, x, m, ldx, k)) return -1;
    const int64_t block_elems = (k / 32) * 1024, up_first = inter / 32;
#pragma omp parallel
    {
        amx_configure();
        float gate[AMX_LINEAR_MAX_ROWS][32] __attribute__((aligned(64)));
        float up[AMX_LINEAR_MAX_ROWS][32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < inter / 32; ++cb) {
            column_block(&rows, w + cb * block_elems, gate);
            column_block(&rows, w + (up_first + cb) * block_elems, up);
            for (int64_t r = 0; r < m; ++r)
                for (int h = 0; h < 2; ++h) {
                    const __m512 g = round_bf16x16(_mm512_load_ps(gate[r] + 16 * h));
                    const __m512 u = round_bf16x16(_mm512_load_ps(up[r] + 16 * h));
                    _mm256_storeu_si256((__m256i*)(out + r * inter + cb * 32 + 16 * h), silu_mul16(g, u));
                }
        }
        _tile_release();
    }
    free(rows.tail);
    return 0;
#else
    (void)x; (void)m; (void)ldx; (void)w; (void)inter; (void)k; (void)out;
    return -1;
#endif
}
