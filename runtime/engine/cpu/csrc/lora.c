/* Multi-LoRA's adapter product on CPU (runtime/engine/cpu/lora_kernels.py, DeviceOps.lora_add): for
 * each run of tokens that uses an adapter slot, out[run] += expand(shrink(x[run])), where the shrink
 * is h = x a_s^T ([L, P*R], kept in fp32) and the expand adds, part by part, h's R columns of the
 * part times b_s's rows of that part. The meaning is runtime/engine/ops/lora.py's
 * reference_lora_add; this computes it in fp32 and rounds once per output on the store. A plain C
 * entry point per type (entry_points.h): decode_layers.c can call it as the Python wrapper does.
 *
 * Why tokens are grouped by slot, not by run: a decode batch has many short runs (one to a few
 * tokens each) and only a few slots. However the runs interleave, each slot's A rows are read once
 * per 4 of its tokens and its B once per 16.
 *
 * The shrink is dot products (a's rows and x's rows are both contiguous in K): blocks of 16 sums
 * over K, 4 tokens x 4 rows of a (a slot's last 1 or 2 tokens: 1 x 16 or 2 x 8, not repeated
 * tokens), in plain C that the compiler vectorises at every build level (with AVX512-BF16, bf16
 * pairs go through VDPBF16PS instead: half the instructions, no widening). The threads split
 * (tile, 16 rows of a) items; each writes its own entries of h. A decode batch of a few tokens
 * per slot is bound by reading a and b (fp32, 8 slots of K = 576, N = 960, R = 16, P = 3: 1.4 MB
 * a call), not by the products.
 *
 * The expand is vectorised over output rows n. b is [N, R] (R contiguous), so an item, a chunk of
 * up to 16 tokens of one slot times a block of NB rows of one part, first copies its block of b
 * transposed ([R][NB], fp32), then adds R broadcasts of h times those rows, 4 tokens and two
 * vectors at a time (8 accumulators in registers: the compiler kept plain-C accumulators of this
 * loop in memory, hence the lane vectors of lanes_f32.h). The 8 x 8 transposes are AVX shuffles
 * (plain C moved ~1 element per cycle: as long as the products themselves in a decode batch).
 * Items are chunk-major, so a thread works along its chunk's rows of out; threads own disjoint
 * tiles of out: no races, no reduction. Every output's sums run in one order whatever the thread
 * count and whichever other tokens share the call (it depends on K, R and the build level only).
 *
 * A call with little work runs on the calling thread (PAR_MIN_FMAS). */
#include <omp.h>
#include "lanes_f32.h"
#include "entry_points.h"

#define AI static inline __attribute__((always_inline))

#define SHRINK_T 4            /* tokens per shrink tile */
#define SHRINK_J 16           /* rows of a per shrink item */
#if AV_W > 1
#define EXPAND_V 2            /* lane vectors per expand block row */
#define NB (EXPAND_V * AV_W)  /* output rows per expand block */
#else
#define NB 8                  /* plain C: two SSE2 or NEON vectors the compiler makes of each row */
#endif
#define EXPAND_T 4            /* tokens per expand step */
#define EXPAND_CHUNK 16       /* tokens per expand item: their rows of out (up to 16 x 9000 fp32) fit in L2 */
#define PAR_MIN_FMAS (1 << 17)  /* below: the calling thread alone (a fork costs ~ that many FMAs) */

/* element i of an fp32 or bf16 array as fp32 (bf16 is a constant in every caller) */
AI float ld(const int bf16, const void* p, int64_t i)
{
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

/* ---- bf16 lanes: load widened, store rounded to nearest even ---- */
#if AV_W == 16
AI av av_load_bf16(const uint16_t* p) { return load_bf16x16(p); }
AI void av_store_bf16(uint16_t* p, av x) { _mm256_storeu_si256((__m256i*)p, f32x16_to_bf16(x)); }
#elif AV_W == 8
AI av av_load_bf16(const uint16_t* p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
AI void av_store_bf16(uint16_t* p, av x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    /* every lane is below 2^16: the unsigned saturating pack keeps it */
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#else
AI av av_load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
AI void av_store_bf16(uint16_t* p, av x) { *p = f32_to_bf16(x); }
#endif

/* o[0..m) = round(o + d), m <= AV_W lanes of an fp32 or bf16 row */
AI void add_store(const int bf16, void* o, av d, int64_t m)
{
    if (!bf16) {
        av_store_n((float*)o, av_add(av_load_n((const float*)o, m), d), m);
    } else if (m == AV_W) {
        av_store_bf16((uint16_t*)o, av_add(av_load_bf16((const uint16_t*)o), d));
    } else {  /* a row's last lanes: through a buffer, so nothing past them is read or written */
        uint16_t buf[AV_W] = {0};
        memcpy(buf, o, (size_t)m * 2);
        av_store_bf16(buf, av_add(av_load_bf16(buf), d));
        memcpy(o, buf, (size_t)m * 2);
    }
}

/* ---- shrink: h[i][j] = x_i . a_j over K, tb tokens x jb rows (16 sums) ---- */
#if defined(__AVX512BF16__)
/* The 16 sums as one vector, lane q = the sum of acc[q]'s lanes: 256-bit halves, then 128-bit
 * quarters of pairs of vectors added, then lanes (15 combines of two shuffles and an add, where a
 * reduction per sum costs 8 instructions: at K = 576 a third of the dot products' 18 steps). Each
 * sum's lanes are added in the same pattern, whatever its place. */
AI __m512 reduce_16(const __m512 acc[16])
{
    __m512 v[16], w[8], x[4];
    for (int q = 0; q < 16; ++q) v[4 * (q % 4) + q / 4] = acc[q];
    for (int k = 0; k < 8; ++k)  /* w[k]: v[2k]'s 8 partial sums, then v[2k + 1]'s */
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));
    for (int m = 0; m < 4; ++m)  /* 128-bit block c of x[m]: v[4m + c]'s 4 partial sums */
        x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xdd));
    const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(y0), _mm512_castps_pd(y1));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(y0), _mm512_castps_pd(y1));
    return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  /* lane 4c + p: v[4p + c] */
}

/* bf16 with AVX512-BF16: 32 depths a step, VDPBF16PS adding each pair's two products into a lane
 * (half the instructions of widening to fp32, none of the widening), the last step masked (zeros
 * add nothing). */
AI void shrink_block_dp(const int tb, const int jb, const uint16_t* const* x, const uint16_t* const* a, int64_t K,
                        float h[16])
{
    __m512 acc[16];
    for (int q = 0; q < 16; ++q) acc[q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (K - k)) - 1);
        __m512i xv[4], wv[16];
        for (int i = 0; i < tb; ++i) xv[i] = _mm512_maskz_loadu_epi16(mask, x[i] + k);
        for (int j = 0; j < jb; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, a[j] + k);
        for (int i = 0; i < tb; ++i)
            for (int j = 0; j < jb; ++j)
                acc[i * jb + j] = _mm512_dpbf16_ps(acc[i * jb + j], (__m512bh)xv[i], (__m512bh)wv[j]);
    }
    _mm512_storeu_ps(h, reduce_16(acc));
}
#endif

/* h[i * jb + j] for tb x jb <= 16 (a tile of fewer tokens takes more rows of a rather than repeating
 * a token). Plain C: the sums the compiler keeps in vector registers (each split into lanes by
 * -fassociative-math) and adds up after the loop; within a few percent of the FMA units' rate with
 * AVX-512 (hand-written, with the reduction above: +4%). */
AI void shrink_block(const int bf16, const int tb, const int jb, const void* const* x, const void* const* a,
                     int64_t K, float h[16])
{
#if defined(__AVX512BF16__)
    if (bf16) {
        shrink_block_dp(tb, jb, (const uint16_t* const*)x, (const uint16_t* const*)a, K, h);
        return;
    }
#endif
    float s[16] = {0};
    for (int64_t k = 0; k < K; ++k) {
        float xv[4], wv[16];
        for (int i = 0; i < tb; ++i) xv[i] = ld(bf16, x[i], k);
        for (int j = 0; j < jb; ++j) wv[j] = ld(bf16, a[j], k);
        for (int i = 0; i < tb; ++i)
            for (int j = 0; j < jb; ++j) s[i * jb + j] += xv[i] * wv[j];
    }
    for (int q = 0; q < tb * jb; ++q) h[q] = s[q];
}

/* The tile's tokens (x rows xr[0..tokens)) times a's rows ar[0..rows), into h[i * 16 + j] (ar holds
 * 16 rows, the last repeated past `rows`; blocks wholly past it are skipped). AVX-512: 4 x 4
 * blocks (3 tokens: the last repeated), 2 x 8, 1 x 16 or 1 x 8. With 16 vector registers (AVX2,
 * plain C) 16 sums and their operands spill: 2 x 4 or 1 x 8 (AVX2 at K = 576: 41 GFMA/s a core
 * against 24 for 4 x 4). */
AI void shrink_tile(const int bf16, int64_t tokens, const void* const xr[4], const void* const ar[16], int64_t rows,
                    int64_t K, float h[4 * 16])
{
    float hb[16];
#if AV_W == 16
    if (tokens >= 3) {
        const void* const x4[4] = {xr[0], xr[1], xr[2], xr[tokens - 1]};
        for (int j0 = 0; j0 < rows; j0 += 4) {
            shrink_block(bf16, 4, 4, x4, ar + j0, K, hb);
            for (int q = 0; q < 16; ++q) h[(q / 4) * 16 + j0 + q % 4] = hb[q];
        }
        return;
    }
    if (tokens == 2) {
        for (int j0 = 0; j0 < rows; j0 += 8) {
            shrink_block(bf16, 2, 8, xr, ar + j0, K, hb);
            for (int q = 0; q < 16; ++q) h[(q / 8) * 16 + j0 + q % 8] = hb[q];
        }
        return;
    }
    if (rows > 8) {
        shrink_block(bf16, 1, 16, xr, ar, K, hb);
        for (int q = 0; q < 16; ++q) h[q] = hb[q];
        return;
    }
#else
    if (tokens >= 2) {
        for (int64_t i0 = 0; i0 < tokens; i0 += 2) {
            const void* const x2[2] = {xr[i0], xr[i0 + 1 < tokens ? i0 + 1 : i0]};
            for (int j0 = 0; j0 < rows; j0 += 4) {
                shrink_block(bf16, 2, 4, x2, ar + j0, K, hb);
                for (int q = 0; q < 8; ++q) h[(i0 + q / 4) * 16 + j0 + q % 4] = hb[q];
            }
        }
        return;
    }
#endif
    for (int j0 = 0; j0 < rows; j0 += 8) {  /* one token */
        shrink_block(bf16, 1, 8, xr, ar + j0, K, hb);
        for (int q = 0; q < 8; ++q) h[j0 + q] = hb[q];
    }
}

/* ---- expand ---- */
/* bt[r][i] (NB floats a row) = b[i][r] (rows R apart) for i < m <= NB, r < R; columns m..NB zero. */
AI void transpose_block(const int bf16, const void* b, int64_t R, int64_t m, float* bt)
{
    int64_t i0 = 0;
#if AV_W > 1
    /* 8 x 8 tiles: eight rows of b loaded as vectors, transposed with 24 shuffles */
    for (; i0 + 8 <= m; i0 += 8) {
        int64_t r0 = 0;
        for (; r0 + 8 <= R; r0 += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; ++i) {
                const int64_t at = (i0 + i) * R + r0;
                v[i] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)b + at))), 16))
                            : _mm256_loadu_ps((const float*)b + at);
            }
            const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
            const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
            const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
            const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
            const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
            const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
            const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
            const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
            float* d = bt + r0 * NB + i0;
            _mm256_storeu_ps(d + 0 * NB, _mm256_permute2f128_ps(s0, s4, 0x20));
            _mm256_storeu_ps(d + 1 * NB, _mm256_permute2f128_ps(s1, s5, 0x20));
            _mm256_storeu_ps(d + 2 * NB, _mm256_permute2f128_ps(s2, s6, 0x20));
            _mm256_storeu_ps(d + 3 * NB, _mm256_permute2f128_ps(s3, s7, 0x20));
            _mm256_storeu_ps(d + 4 * NB, _mm256_permute2f128_ps(s0, s4, 0x31));
            _mm256_storeu_ps(d + 5 * NB, _mm256_permute2f128_ps(s1, s5, 0x31));
            _mm256_storeu_ps(d + 6 * NB, _mm256_permute2f128_ps(s2, s6, 0x31));
            _mm256_storeu_ps(d + 7 * NB, _mm256_permute2f128_ps(s3, s7, 0x31));
        }
        for (; r0 < R; ++r0)
            for (int64_t i = i0; i < i0 + 8; ++i) bt[r0 * NB + i] = ld(bf16, b, i * R + r0);
    }
#endif
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t i = i0; i < m; ++i) bt[r * NB + i] = ld(bf16, b, i * R + r);
        for (int64_t i = m; i < NB; ++i) bt[r * NB + i] = 0.0f;
    }
}

/* out rows o[0..tokens) columns [0, m) += h rows hr[0..tokens) (R values each) times bt; tokens
 * is a constant in each caller (expand_n), so the accumulators are registers. */
#if AV_W > 1
AI void expand_tokens(const int bf16, const int tokens, const float* const hr[EXPAND_T], const float* bt, int64_t R,
                      void* const o[EXPAND_T], int64_t m)
{
    av acc[EXPAND_T][EXPAND_V];
    for (int t = 0; t < tokens; ++t)
        for (int v = 0; v < EXPAND_V; ++v) acc[t][v] = av_set1(0.0f);
    for (int64_t r = 0; r < R; ++r) {
        av w[EXPAND_V];
        for (int v = 0; v < EXPAND_V; ++v) w[v] = av_load(bt + r * NB + v * AV_W);
        for (int t = 0; t < tokens; ++t) {
            const av u = av_set1(hr[t][r]);
            for (int v = 0; v < EXPAND_V; ++v) acc[t][v] = av_fma(u, w[v], acc[t][v]);
        }
    }
    const size_t es = bf16 ? 2 : 4;
    for (int t = 0; t < tokens; ++t)
        for (int v = 0; v < EXPAND_V && v * AV_W < m; ++v) {
            const int64_t left = m - v * AV_W;
            add_store(bf16, (char*)o[t] + v * AV_W * es, acc[t][v], left < AV_W ? left : AV_W);
        }
}
#else
/* The baseline build (every non-x86 host): GCC's portable vectors of 4 floats (SSE2, NEON), 2 a
 * row; plain arrays of accumulators stayed in memory here too. */
typedef float f32x4 __attribute__((vector_size(16)));
AI f32x4 load4(const float* p) { f32x4 v; memcpy(&v, p, sizeof v); return v; }
AI void expand_tokens(const int bf16, const int tokens, const float* const hr[EXPAND_T], const float* bt, int64_t R,
                      void* const o[EXPAND_T], int64_t m)
{
    f32x4 acc[EXPAND_T][2];
    for (int t = 0; t < tokens; ++t) acc[t][0] = acc[t][1] = (f32x4){0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t r = 0; r < R; ++r) {
        const f32x4 w0 = load4(bt + r * NB), w1 = load4(bt + r * NB + 4);
        for (int t = 0; t < tokens; ++t) {
            const float u = hr[t][r];
            acc[t][0] += u * w0;
            acc[t][1] += u * w1;
        }
    }
    for (int t = 0; t < tokens; ++t) {
        float sum[NB];
        memcpy(sum, acc[t], sizeof sum);
        for (int64_t i = 0; i < m; ++i) {
            if (bf16) ((uint16_t*)o[t])[i] = f32_to_bf16(bf16_to_f32(((uint16_t*)o[t])[i]) + sum[i]);
            else ((float*)o[t])[i] += sum[i];
        }
    }
}
#endif

AI void expand_n(const int bf16, int tokens, const float* const hr[EXPAND_T], const float* bt, int64_t R,
                 void* const o[EXPAND_T], int64_t m)
{
    switch (tokens) {
    case 4: expand_tokens(bf16, 4, hr, bt, R, o, m); break;
    case 3: expand_tokens(bf16, 3, hr, bt, R, o, m); break;
    case 2: expand_tokens(bf16, 2, hr, bt, R, o, m); break;
    default: expand_tokens(bf16, 1, hr, bt, R, o, m); break;
    }
}

/* ---- the call ---- */
typedef struct { int64_t slot, from, count; } Group;  /* a slot's tokens: order[from .. from + count) */
typedef struct { int64_t slot, first, tokens; } Span;  /* up to a tile's or chunk's tokens of one slot */
typedef struct { int64_t part, n0, m; } Block;        /* an expand block: rows n0 .. n0 + m of a part */

static int check(int64_t T, int64_t K, int64_t N, int64_t ldx, int64_t ldo, int64_t S, int64_t R, int64_t P,
                 const int64_t* part_rows, const int32_t* starts, const int32_t* slots, int64_t n)
{
    if (T < 0 || K < 1 || N < 1 || ldx < K || ldo < N || S < 0 || R < 1 || P < 1 || n < 0 || !part_rows
        || (n > 0 && (!starts || !slots)))
        return -1;
    if (part_rows[0] != 0 || part_rows[P] != N) return -2;
    for (int64_t p = 0; p < P; ++p)
        if (part_rows[p + 1] < part_rows[p]) return -2;
    if (n > 0 && (starts[0] < 0 || starts[n] > T)) return -3;
    for (int64_t i = 0; i < n; ++i) {
        if (starts[i + 1] < starts[i]) return -3;
        if (slots[i] >= S) return -4;
    }
    return 0;
}

/* Each group's tokens cut into spans of at most `len`; returns how many. */
static int64_t split(const Group* groups, int64_t groups_n, int64_t len, Span* spans)
{
    int64_t k = 0;
    for (int64_t g = 0; g < groups_n; ++g)
        for (int64_t first = groups[g].from; first < groups[g].from + groups[g].count; first += len) {
            const int64_t left = groups[g].from + groups[g].count - first;
            spans[k++] = (Span){groups[g].slot, first, left < len ? left : len};
        }
    return k;
}

AI int lora_add(const int bf16, const void* x, int64_t ldx, void* out, int64_t ldo, int64_t T, int64_t K, int64_t N,
                const void* a, const void* b, int64_t S, int64_t R, int64_t P, const int64_t* part_rows,
                const int32_t* starts, const int32_t* slots, int64_t n)
{
    const int rc = check(T, K, N, ldx, ldo, S, R, P, part_rows, starts, slots, n);
    if (rc) return rc;
    int64_t adapted = 0;
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] >= 0) adapted += starts[i + 1] - starts[i];
    if (adapted == 0) return 0;
    if (!x || !out || !a || !b) return -1;
    const int64_t PR = P * R, es = bf16 ? 2 : 4;

    /* the tokens by slot (each slot's in token order), cut into shrink tiles and expand chunks */
    const int64_t groups_max = S < adapted ? S : adapted;
    int64_t blocks_n = 0;
    for (int64_t p = 0; p < P; ++p) blocks_n += (part_rows[p + 1] - part_rows[p] + NB - 1) / NB;
    int64_t* group_of = calloc((size_t)S, sizeof(int64_t));
    int64_t* order = malloc((size_t)adapted * sizeof(int64_t));
    Group* groups = malloc((size_t)groups_max * sizeof(Group));
    Span* tiles = malloc((size_t)(adapted / SHRINK_T + groups_max) * sizeof(Span));
    Span* chunks = malloc((size_t)(adapted / EXPAND_CHUNK + groups_max) * sizeof(Span));
    Block* blocks = malloc((size_t)blocks_n * sizeof(Block));
    float* h = malloc((size_t)(adapted * PR) * sizeof(float));
    float* bts = malloc((size_t)(omp_get_max_threads() * R * NB) * sizeof(float));  /* a block of b per thread */
    if (!group_of || !order || !groups || !tiles || !chunks || !blocks || !h || !bts) {
        free(group_of); free(order); free(groups); free(tiles); free(chunks); free(blocks); free(h); free(bts);
        return -5;
    }
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] >= 0) group_of[slots[i]] += starts[i + 1] - starts[i];  /* first: the slot's count */
    int64_t groups_n = 0;
    for (int64_t s = 0, from = 0; s < S; ++s)
        if (group_of[s]) {
            groups[groups_n] = (Group){s, from, 0};
            from += group_of[s];
            group_of[s] = groups_n++;
        }
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        Group* g = &groups[group_of[slots[i]]];
        for (int64_t t = starts[i]; t < starts[i + 1]; ++t) order[g->from + g->count++] = t;
    }
    const int64_t tiles_n = split(groups, groups_n, SHRINK_T, tiles);
    const int64_t chunks_n = split(groups, groups_n, EXPAND_CHUNK, chunks);
    for (int64_t p = 0, k = 0; p < P; ++p)
        for (int64_t n0 = part_rows[p]; n0 < part_rows[p + 1]; n0 += NB)
            blocks[k++] = (Block){p, n0, part_rows[p + 1] - n0 < NB ? part_rows[p + 1] - n0 : NB};

    const int64_t j_blocks = (PR + SHRINK_J - 1) / SHRINK_J;
    const int64_t fmas = adapted * (PR * K + N * R);
#pragma omp parallel if (fmas >= PAR_MIN_FMAS)
    {
        /* shrink: item = (tile of up to 4 tokens of one slot, 16 rows of a); a block short of
         * rows repeats its last, and stores only its own */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tiles_n * j_blocks; ++item) {
            const Span tile = tiles[item / j_blocks];
            const int64_t j0 = item % j_blocks * SHRINK_J, rows = PR - j0 < SHRINK_J ? PR - j0 : SHRINK_J;
            const void* xr[SHRINK_T];
            const void* ar[SHRINK_J];
            for (int i = 0; i < SHRINK_T; ++i)
                xr[i] = (const char*)x + order[tile.first + (i < tile.tokens ? i : tile.tokens - 1)] * ldx * es;
            for (int j = 0; j < SHRINK_J; ++j)
                ar[j] = (const char*)a + (tile.slot * PR + j0 + (j < rows ? j : rows - 1)) * K * es;
            float hb[SHRINK_T * SHRINK_J];
            if (bf16) shrink_tile(1, tile.tokens, xr, ar, rows, K, hb);
            else shrink_tile(0, tile.tokens, xr, ar, rows, K, hb);
            for (int64_t i = 0; i < tile.tokens; ++i)
                for (int64_t j = 0; j < rows; ++j) h[(tile.first + i) * PR + j0 + j] = hb[i * SHRINK_J + j];
        }
        /* expand: item = (chunk, block of a part's rows), blocks inner: a chunk's rows of out stay
         * in cache and are read and written along each row (a long prefill's out is larger than the
         * cache); the block of b is transposed once per chunk */
        float* bt = bts + omp_get_thread_num() * R * NB;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks_n * blocks_n; ++item) {
            const Span chunk = chunks[item / blocks_n];
            const Block blk = blocks[item % blocks_n];
            if (item + 1 < chunks_n * blocks_n) {
                /* the next item's rows of out, a few hundred bytes on each of up to 16 rows: too
                 * many streams for the hardware prefetcher (a long prefill's expand ran 35%
                 * slower without) */
                const Span next = chunks[(item + 1) / blocks_n];
                const Block next_blk = blocks[(item + 1) % blocks_n];
                for (int64_t q = next.first; q < next.first + next.tokens; ++q) {
                    const char* row = (const char*)out + (order[q] * ldo + next_blk.n0) * es;
                    for (int64_t l = 0; l < next_blk.m * es; l += 64) __builtin_prefetch(row + l, 1, 3);
                }
            }
            const void* bs = (const char*)b + (chunk.slot * N + blk.n0) * R * es;
            if (bf16) transpose_block(1, bs, R, blk.m, bt);
            else transpose_block(0, bs, R, blk.m, bt);
            for (int64_t q = chunk.first; q < chunk.first + chunk.tokens; q += EXPAND_T) {
                const int64_t left = chunk.first + chunk.tokens - q;
                const int tokens = (int)(left < EXPAND_T ? left : EXPAND_T);
                const float* hr[EXPAND_T];
                void* o[EXPAND_T];
                for (int t = 0; t < tokens; ++t) {
                    hr[t] = h + (q + t) * PR + blk.part * R;
                    o[t] = (char*)out + (order[q + t] * ldo + blk.n0) * es;
                }
                if (bf16) expand_n(1, tokens, hr, bt, R, o, blk.m);
                else expand_n(0, tokens, hr, bt, R, o, blk.m);
            }
        }
    }
    free(group_of); free(order); free(groups); free(tiles); free(chunks); free(blocks); free(h); free(bts);
    return 0;
}

/* out[t, :] (rows ldo apart, N wide) += the adapter product of x[t, :] (rows ldx apart, K wide) for
 * t in each run i (starts[i] .. starts[i + 1], T tokens in all) whose slot s = slots[i] is >= 0:
 * a [S, P*R, K] and b [S, N, R] contiguous, part p of out's rows part_rows[p] .. part_rows[p + 1]
 * (P + 1 boundaries, 0 to N). Returns 0, or, having read none of x, out, a and b: -1 sizes or
 * strides that do not fit, -2 part_rows that do not split 0 .. N, -3 runs outside 0 .. T or out of
 * order, -4 a slot >= S; -5 out of memory (out unchanged). */
int lora_add_f32(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t T, int64_t K, int64_t N,
                 const float* a, const float* b, int64_t S, int64_t R, int64_t P, const int64_t* part_rows,
                 const int32_t* starts, const int32_t* slots, int64_t n)
{
    return lora_add(0, x, ldx, out, ldo, T, K, N, a, b, S, R, P, part_rows, starts, slots, n);
}

int lora_add_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t ldo, int64_t T, int64_t K, int64_t N,
                  const uint16_t* a, const uint16_t* b, int64_t S, int64_t R, int64_t P, const int64_t* part_rows,
                  const int32_t* starts, const int32_t* slots, int64_t n)
{
    return lora_add(1, x, ldx, out, ldo, T, K, N, a, b, S, R, P, part_rows, starts, slots, n);
}
