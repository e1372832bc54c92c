/* Attention with bf16-pair dot products for many query rows per key load: a shared prefix
 * against every decode query (prefix_attention_bf16) and a causal prefill (causal_attention_bf16).
 * Both take 16 query rows of one KV head at a time (RowBlock) against keys packed as bf16 pairs;
 * the products run on AMX tiles where the CPU has them and the caller enabled them
 * (tinyserve_amx, amx.h), else on AVX512-BF16 (or AVX-512 FMAs). Built and called through
 * runtime/cpu/kernel_library.py and runtime/cpu/attention_kernels.py. */
#include "common.h"
#include "entry_points.h"
#include "amx.h"

/* ---- a shared prefix's attention for every decode query, with bf16-pair dot products ---- */

#define PREFIX_ROWS 16   /* query rows (of one KV head) per work item */
#define PREFIX_KEYS 512  /* keys per online-softmax block */

/* 1 when prefix_attention_bf16 is compiled in (the CPU has AVX-512), else 0. */
int prefix_attention_available(void)
{
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
/* 2^t on 16 lanes for t <= 0, relative error < 3e-6: the probabilities are rounded to bf16
 * (8 bits) for the value products, so fast_exp16's degree-6 polynomial is more than they keep.
 * A degree-4 minimax of 2^f on f in [-1/2, 1/2] (p(0) = 1: a row's maximum gets exactly 1) and
 * the exponent applied by scalef; t is clamped at -125 so no result is a denormal (2^-125 is
 * as good as 0 next to a row maximum of 1). */
static inline __m512 exp2_probs16(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.582818386e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.590637020e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402409887e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241998e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* acc[l] += a[2l] * b[2l] + a[2l+1] * b[2l+1] over 16 lanes of bf16 pairs: one AVX512-BF16
 * instruction where the CPU has it, else the pairs widened to fp32 and two FMAs. */
static inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 a_lo = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), b_lo = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    const __m512 a_hi = _mm512_castsi512_ps(_mm512_and_si512(a, hi)), b_hi = _mm512_castsi512_ps(_mm512_and_si512(b, hi));
    return _mm512_fmadd_ps(a_hi, b_hi, _mm512_fmadd_ps(a_lo, b_lo, acc));
#endif
}

/* ---- 16 query rows of one KV head against pair-packed keys (the prefix and prefill kernels) ----
 * Keys are stored as bf16 pairs: K [keys_pad / 16, d / 2, 16, 2] (two adjacent dims of a key
 * together, 16 keys per 64-byte line, a 16-key block's lines contiguous) and V [keys_pad / 2, d, 2]
 * (two adjacent keys of a dim together), keys_pad a multiple of 32, padding keys zero. Scores
 * are fp32 dot products of bf16 pairs; probabilities are rounded to bf16 for the value products
 * (as a bf16 GEMM of probabilities would); the softmax is online over PREFIX_KEYS-key blocks. */

typedef struct {
    uint32_t q[MAX_D / 2][PREFIX_ROWS];  /* bf16 pairs of each row's query, row-minor */
    uint16_t qa[PREFIX_ROWS][MAX_D];     /* the same queries row-major (AMX's A tiles) */
    float s[PREFIX_ROWS][PREFIX_KEYS];
    uint16_t pb[PREFIX_ROWS][PREFIX_KEYS];
    float acc[PREFIX_ROWS][MAX_D];
    float m[PREFIX_ROWS], l[PREFIX_ROWS];
} RowBlock;

/* Lanes 0..seen-1 of a 16-lane block (seen may be <= 0 or >= 16). */
static inline __mmask16 seen_lanes(int64_t seen)
{
    return seen <= 0 ? 0 : (seen >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << seen) - 1));
}

static inline void rows_start(RowBlock* rb, int64_t d)
{
    for (int r = 0; r < PREFIX_ROWS; ++r) {
        rb->m[r] = -INFINITY;
        rb->l[r] = 0.0f;
        for (int64_t i = 0; i < d; ++i) rb->acc[r][i] = 0.0f;
    }
}

/* Row r's query: the d bf16 values at src (pairs copied as they are). */
static inline void rows_load_query(RowBlock* rb, int r, const uint16_t* src, int64_t d)
{
    const uint32_t* pairs = (const uint32_t*)src;
    for (int64_t ip = 0; ip < d / 2; ++ip) rb->q[ip][r] = pairs[ip];
    memcpy(rb->qa[r], src, (size_t)d * sizeof(uint16_t));
}


/* ---- AMX: the same block products on tiles (16 x 32 bf16 times 32 x 16 bf16 per instruction) ----
 * Off unless tinyserve_amx() switched them on (the CPU has AMX and the OS granted the tile state).
 * Tiles: 0-3 fp32 accumulators (16 x 16), 4 an A operand (16 rows x 32 bf16), 5 and 6 B operands
 * (16 pair rows x 16 columns), alternated so a load need not wait for the previous product. */

#if AMX_COMPILED
/* Unscaled scores of keys [j0 + j, +16 * blocks) (blocks 1 or 4) for the block's 16 rows into
 * rb->s: one accumulator tile per 16 keys, so four blocks' products are independent (a single
 * tile's products would wait on each other), and each query tile is loaded once for them. */
static inline void amx_scores(RowBlock* rb, const uint16_t* kh, int64_t j0, int64_t j, int64_t d, int blocks)
{
    const uint16_t* kb = kh + ((j0 + j) / 16) * (d / 2) * 32;  /* 16-key blocks are (d / 2) * 32 apart */
    const int64_t block = (d / 2) * 32;
    _tile_zero(0);
    if (blocks == 4) { _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    for (int64_t kc = 0; kc < d / 32; ++kc) {
        _tile_loadd(4, &rb->qa[0][kc * 32], MAX_D * sizeof(uint16_t));
        _tile_loadd(5, kb + kc * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (blocks == 4) {
            _tile_loadd(6, kb + block + kc * 16 * 32, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, kb + 2 * block + kc * 16 * 32, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, kb + 3 * block + kc * 16 * 32, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    _tile_stored(0, &rb->s[0][j], PREFIX_KEYS * sizeof(float));
    if (blocks == 4) {
        _tile_stored(1, &rb->s[0][j + 16], PREFIX_KEYS * sizeof(float));
        _tile_stored(2, &rb->s[0][j + 32], PREFIX_KEYS * sizeof(float));
        _tile_stored(3, &rb->s[0][j + 48], PREFIX_KEYS * sizeof(float));
    }
}

/* acc[r][:] += sum over keys [j0, j0 + jn) of pb[r][j] * v[j][:], through rb->s as scratch. 32 keys
 * per product: a 16-key tail (jn an odd multiple of 16) reads 16 more keys of V, which the packed
 * layout has (its key count is a multiple of 32), against probabilities zeroed here. */
static inline void amx_values(RowBlock* rb, const uint16_t* vh, int64_t j0, int64_t jn, int64_t d)
{
    const int64_t v_stride = d * 2 * sizeof(uint16_t);  /* bytes between pair rows */
    if (jn % 32)
        for (int r = 0; r < PREFIX_ROWS; ++r) memset(&rb->pb[r][jn], 0, 16 * sizeof(uint16_t));
    for (int64_t dg = 0; dg < d; dg += 64) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kk = 0; kk < jn; kk += 32) {
            const uint16_t* vr = vh + ((j0 + kk) / 2 * d + dg) * 2;
            _tile_loadd(4, &rb->pb[0][kk], PREFIX_KEYS * sizeof(uint16_t));
            _tile_loadd(5, vr, v_stride);      _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vr + 32, v_stride); _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, vr + 64, v_stride); _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, vr + 96, v_stride); _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, &rb->s[0][0], PREFIX_KEYS * sizeof(float));
        _tile_stored(1, &rb->s[0][16], PREFIX_KEYS * sizeof(float));
        _tile_stored(2, &rb->s[0][32], PREFIX_KEYS * sizeof(float));
        _tile_stored(3, &rb->s[0][48], PREFIX_KEYS * sizeof(float));
        for (int r = 0; r < PREFIX_ROWS; ++r)
            for (int u = 0; u < 4; ++u) {
                float* a = &rb->acc[r][dg + 16 * u];
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(&rb->s[r][16 * u])));
            }
    }
}
#endif

/* Keys [j0, j0 + jn) (jn a multiple of 16, j0 of PREFIX_KEYS) of the packed kh / vh: row r sees
 * the first valid[r] of them (the rest count as -inf), folded into each row's online softmax. */
static inline void rows_attend(RowBlock* rb, const uint16_t* kh, const uint16_t* vh, int64_t j0, int64_t jn,
                               const int64_t* valid, int64_t d, float scale, int amx)
{
    const __m512 vscale2 = _mm512_set1_ps(scale * EXP_LOG2E);
#if AMX_COMPILED
    if (amx)
        for (int64_t j = 0; j < jn;) {
            const int blocks = jn - j >= 64 ? 4 : 1;
            amx_scores(rb, kh, j0, j, d, blocks);
            j += 16 * blocks;
        }
#endif
    for (int64_t j = 0; j < jn && !amx; j += 16) {
        __m512 a[PREFIX_ROWS];
#pragma GCC unroll 16
        for (int r = 0; r < PREFIX_ROWS; ++r) a[r] = _mm512_setzero_ps();
        for (int64_t ip = 0; ip < d / 2; ++ip) {
            const __m512i k = _mm512_loadu_si512((const void*)(kh + (((j0 + j) / 16) * (d / 2) + ip) * 32));
#pragma GCC unroll 16
            for (int r = 0; r < PREFIX_ROWS; ++r)
                a[r] = dot_bf16_pairs(a[r], k, _mm512_set1_epi32((int)rb->q[ip][r]));
        }
#pragma GCC unroll 16
        for (int r = 0; r < PREFIX_ROWS; ++r) _mm512_storeu_ps(&rb->s[r][j], a[r]);
    }
    for (int r = 0; r < PREFIX_ROWS; ++r) {
        /* two passes over the row's scores: the max of its seen keys, then their exponentials
         * (0 for keys it does not see) summed and rounded to bf16 for the value products */
        const float* sr = rb->s[r];
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < jn; j += 16)
            vmx = _mm512_mask_max_ps(vmx, seen_lanes(valid[r] - j), vmx, _mm512_loadu_ps(sr + j));
        const float mx = _mm512_reduce_max_ps(vmx) * scale;  /* scores are unscaled; scale > 0 */
        const float m_new = mx > rb->m[r] ? mx : rb->m[r];
        if (m_new == -INFINITY) {  /* nothing seen yet: all probabilities 0 */
            memset(rb->pb[r], 0, (size_t)jn * sizeof(uint16_t));
            continue;
        }
        const float corr = fast_exp(rb->m[r] - m_new);
        const __m512 vm2 = _mm512_set1_ps(m_new * EXP_LOG2E);  /* e^(x - m) = 2^(x log2 e - m log2 e) */
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < jn; j += 16) {
            const __m512 e = _mm512_maskz_mov_ps(seen_lanes(valid[r] - j),
                                                 exp2_probs16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vscale2, vm2)));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256((__m256i*)&rb->pb[r][j], f32x16_to_bf16(e));
        }
        if (corr != 1.0f && rb->l[r] != 0.0f) for (int64_t i = 0; i < d; ++i) rb->acc[r][i] *= corr;  /* (0 before any key) */
        rb->l[r] = rb->l[r] * corr + _mm512_reduce_add_ps(vsum);
        rb->m[r] = m_new;
    }
#if AMX_COMPILED
    if (amx) {
        amx_values(rb, vh, j0, jn, d);
        return;
    }
#endif
    for (int r4 = 0; r4 < PREFIX_ROWS; r4 += 4) {
        for (int64_t i0 = 0; i0 < d; i0 += 64) {
            __m512 o[4][4];
#pragma GCC unroll 4
            for (int rr = 0; rr < 4; ++rr)
#pragma GCC unroll 4
                for (int u = 0; u < 4; ++u) o[rr][u] = _mm512_loadu_ps(&rb->acc[r4 + rr][i0 + 16 * u]);
            for (int64_t jp = 0; jp < jn / 2; ++jp) {
                const uint16_t* vr = vh + ((j0 / 2 + jp) * d + i0) * 2;
                const __m512i v0 = _mm512_loadu_si512((const void*)vr);
                const __m512i v1 = _mm512_loadu_si512((const void*)(vr + 32));
                const __m512i v2 = _mm512_loadu_si512((const void*)(vr + 64));
                const __m512i v3 = _mm512_loadu_si512((const void*)(vr + 96));
#pragma GCC unroll 4
                for (int rr = 0; rr < 4; ++rr) {
                    uint32_t pair;
                    memcpy(&pair, &rb->pb[r4 + rr][2 * jp], 4);
                    const __m512i pp = _mm512_set1_epi32((int)pair);
                    o[rr][0] = dot_bf16_pairs(o[rr][0], v0, pp);
                    o[rr][1] = dot_bf16_pairs(o[rr][1], v1, pp);
                    o[rr][2] = dot_bf16_pairs(o[rr][2], v2, pp);
                    o[rr][3] = dot_bf16_pairs(o[rr][3], v3, pp);
                }
            }
#pragma GCC unroll 4
            for (int rr = 0; rr < 4; ++rr)
#pragma GCC unroll 4
                for (int u = 0; u < 4; ++u) _mm512_storeu_ps(&rb->acc[r4 + rr][i0 + 16 * u], o[rr][u]);
        }
    }
}

/* Row r's normalised output (d values) and the log-sum-exp of its scaled scores. */
static inline float rows_result(const RowBlock* rb, int r, int64_t d, float* out)
{
    const float inv = rb->l[r] > 0.0f ? 1.0f / rb->l[r] : 0.0f;
    for (int64_t i = 0; i < d; ++i) out[i] = rb->acc[r][i] * inv;
    return rb->l[r] > 0.0f ? rb->m[r] + logf(rb->l[r]) : -INFINITY;
}
#endif

/* Every query q [n, hkv, group, d] (request rows q_stride apart) against one shared key set of p
 * keys, packed as above: kp [hkv, p_pad / 16, d / 2, 16, 2], vp [hkv, p_pad / 2, d, 2]. For each
 * KV head, 16 query rows at a time (the group's heads of consecutive requests) share every key
 * load. Writes out [n, hkv, group, d] fp32 (normalised) and lse [n, hkv, group] fp32 of the
 * scaled scores. Returns 0, or -1 when the shapes are outside its bounds or it is not compiled
 * in (no AVX-512). */
int prefix_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp,
                          int64_t p, int64_t p_pad, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
                          float* out, float* lse)
{
#ifdef __AVX512F__
    if (d % 64 || d > MAX_D || p_pad % 32 || p < 1 || p > p_pad) return -1;
    const int64_t rows = n * group;  /* query rows per KV head */
    const int64_t blocks = (rows + PREFIX_ROWS - 1) / PREFIX_ROWS;
#pragma omp parallel
    {
    const int amx = amx_begin();
#pragma omp for schedule(static)
    for (int64_t w = 0; w < hkv * blocks; ++w) {
        /* Always PREFIX_ROWS rows (a short last block repeats its first row; those results are
         * dropped), so every row loop has a constant trip count and its accumulators stay in registers. */
        const int64_t h = w / blocks, r0 = (w % blocks) * PREFIX_ROWS;
        const int64_t nr = rows - r0 < PREFIX_ROWS ? rows - r0 : PREFIX_ROWS;
        RowBlock rb;
        for (int r = 0; r < PREFIX_ROWS; ++r) {
            const int64_t row = r0 + (r < nr ? r : 0), b = row / group, g = row % group;
            rows_load_query(&rb, r, q + b * q_stride + (h * group + g) * d, d);
        }
        rows_start(&rb, d);
        const uint16_t* kh = kp + h * (d / 2) * p_pad * 2;
        const uint16_t* vh = vp + h * (p_pad / 2) * d * 2;
        for (int64_t j0 = 0; j0 < p; j0 += PREFIX_KEYS) {
            const int64_t jn = p_pad - j0 < PREFIX_KEYS ? p_pad - j0 : PREFIX_KEYS;  /* a multiple of 32 */
            const int64_t seen = p - j0 < jn ? p - j0 : jn;
            int64_t valid[PREFIX_ROWS];
            for (int r = 0; r < PREFIX_ROWS; ++r) valid[r] = seen;
            rows_attend(&rb, kh, vh, j0, jn, valid, d, scale, amx);
        }
        for (int64_t r = 0; r < nr; ++r) {
            const int64_t b = (r0 + r) / group, g = (r0 + r) % group;
            const int64_t row = (b * hkv + h) * group + g;
            lse[row] = rows_result(&rb, (int)r, d, out + row * d);
        }
    }
    amx_end(amx);
    }
    return 0;
#else
    (void)q; (void)q_stride; (void)kp; (void)vp; (void)p; (void)p_pad; (void)n; (void)hkv; (void)group; (void)d;
    (void)scale; (void)out; (void)lse;
    return -1;
#endif
}

#ifdef __AVX512F__
static inline void prefetch_row(const uint16_t* p, int64_t d)
{
    for (int64_t i = 0; i < d; i += 32) _mm_prefetch((const char*)(p + i), _MM_HINT_T0);
}

/* Keys and values of one KV head, rows k / v + j * stride for j < len (bf16, d each), into the
 * pair layouts above: kp [len_pad / 16, d / 2, 16, 2], vp [len_pad / 2, d, 2], zero past len. */
static void pack_pairs(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t len,
                       int64_t len_pad, int64_t d, uint16_t* kp, uint16_t* vp)
{
    /* K: per 16-key block, the 16 keys' pair ip side by side (a gather of 16 strided pairs) */
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i key_offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)(k_stride * 2)));
    for (int64_t j0 = 0; j0 < len_pad; j0 += 16) {
        const __mmask16 real = seen_lanes(len - j0);
        uint32_t* dst = (uint32_t*)kp + (j0 / 16) * (d / 2) * 16;
        const char* base = (const char*)(k + (j0 < len ? j0 : 0) * k_stride);
        for (int64_t ip = 0; ip < d / 2; ++ip)
            _mm512_storeu_si512((void*)(dst + ip * 16),
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, key_offsets, base + ip * 4, 1));
    }
    /* V: two keys' rows interleaved dim by dim */
#ifdef __AVX512BW__
    /* 16 dims (32 values) per register */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                        55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t j = 0; j < len_pad; j += 2) {
        uint16_t* dst = vp + (j / 2) * d * 2;
        for (int64_t i0 = 0; i0 < d; i0 += 32) {
            const __m512i a = j < len ? _mm512_loadu_si512((const void*)(v + j * v_stride + i0)) : _mm512_setzero_si512();
            const __m512i c = j + 1 < len ? _mm512_loadu_si512((const void*)(v + (j + 1) * v_stride + i0))
                                          : _mm512_setzero_si512();
            _mm512_storeu_si512((void*)(dst + i0 * 2), _mm512_permutex2var_epi16(a, lo, c));
            _mm512_storeu_si512((void*)(dst + i0 * 2 + 32), _mm512_permutex2var_epi16(a, hi, c));
        }
    }
#else
    for (int64_t j = 0; j < len_pad; ++j) {
        uint16_t* dst = vp + (j / 2) * d * 2 + j % 2;
        for (int64_t i = 0; i < d; ++i) dst[i * 2] = j < len ? v[j * v_stride + i] : 0;
    }
#endif
}

#endif

/* Causal self-attention of n prompts of len new tokens each (a prefill with no cached keys):
 * token t = b * len + pos of request b has its query heads at q + t * q_stride (query head
 * h * group + g of KV head h), its key and value heads at k + t * k_stride + h * d (likewise v).
 * Each (request, KV head) packs its keys and values as above once, then takes its query rows
 * position-major (row = pos * group + g) 16 at a time, each block reading only the keys up to its
 * last position. Writes out [n * len, hkv * group, d] bf16 and, when lse != NULL, lse
 * [n * len, hkv * group] fp32 of the scaled scores. Returns 0, or -1 (nothing usable written)
 * when the shapes are outside its bounds, memory runs out, or it is not compiled in. */
int causal_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                          const uint16_t* v, int64_t v_stride, int64_t n, int64_t len, int64_t hkv, int64_t group,
                          int64_t d, float scale, uint16_t* out, float* lse)
{
#ifdef __AVX512F__
    if (d % 64 || d > MAX_D || len < 1 || group < 1) return -1;
    const int64_t len_pad = (len + 31) / 32 * 32;
    const int64_t rows = len * group, blocks = (rows + PREFIX_ROWS - 1) / PREFIX_ROWS, heads = hkv * group;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t* kp = malloc((size_t)(len_pad * d) * sizeof(uint16_t));
        uint16_t* vp = malloc((size_t)(len_pad * d) * sizeof(uint16_t));
        RowBlock* rb = malloc(sizeof(RowBlock));
        const int amx = amx_begin();
        if (!kp || !vp || !rb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * hkv; ++w) {
            if (!kp || !vp || !rb) continue;
            const int64_t b = w / hkv, h = w % hkv;
            pack_pairs(k + b * len * k_stride + h * d, k_stride, v + b * len * v_stride + h * d, v_stride,
                       len, len_pad, d, kp, vp);
            for (int64_t blk = 0; blk < blocks; ++blk) {
                const int64_t r0 = blk * PREFIX_ROWS;
                const int64_t nr = rows - r0 < PREFIX_ROWS ? rows - r0 : PREFIX_ROWS;
                /* The rows come from DRAM a few hundred bytes apart (too sparse for the hardware
                 * prefetcher): fetch the next block's queries, and a share of the next work
                 * item's keys and values, while this block computes. */
                for (int64_t row = r0 + PREFIX_ROWS; row < r0 + 2 * PREFIX_ROWS && row < rows; ++row)
                    prefetch_row(q + (b * len + row / group) * q_stride + (h * group + row % group) * d, d);
                if (w + 1 < n * hkv) {
                    const int64_t b1 = (w + 1) / hkv, h1 = (w + 1) % hkv, per = (len + blocks - 1) / blocks;
                    for (int64_t j = blk * per; j < (blk + 1) * per && j < len; ++j) {
                        prefetch_row(k + (b1 * len + j) * k_stride + h1 * d, d);
                        prefetch_row(v + (b1 * len + j) * v_stride + h1 * d, d);
                    }
                    if (blk == blocks - 1)
                        for (int64_t row = 0; row < PREFIX_ROWS && row < rows; ++row)
                            prefetch_row(q + (b1 * len + row / group) * q_stride + (h1 * group + row % group) * d, d);
                }
                int64_t pos[PREFIX_ROWS];
                for (int r = 0; r < PREFIX_ROWS; ++r) {
                    const int64_t row = r0 + (r < nr ? r : 0);
                    pos[r] = row / group;
                    rows_load_query(rb, r, q + (b * len + pos[r]) * q_stride + (h * group + row % group) * d, d);
                }
                rows_start(rb, d);
                const int64_t keys = (r0 + nr - 1) / group + 1;  /* up to the block's last position */
                const int64_t keys16 = (keys + 15) / 16 * 16;
                for (int64_t j0 = 0; j0 < keys; j0 += PREFIX_KEYS) {
                    const int64_t jn = keys16 - j0 < PREFIX_KEYS ? keys16 - j0 : PREFIX_KEYS;
                    int64_t valid[PREFIX_ROWS];
                    for (int r = 0; r < PREFIX_ROWS; ++r) {
                        const int64_t seen = pos[r] + 1 - j0;
                        valid[r] = seen < 0 ? 0 : (seen > jn ? jn : seen);
                    }
                    rows_attend(rb, kp, vp, j0, jn, valid, d, scale, amx);
                }
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t row = r0 + r, head = h * group + row % group;
                    const int64_t t = b * len + pos[r];
                    float o[MAX_D];
                    const float row_lse = rows_result(rb, (int)r, d, o);
                    uint16_t* dst = out + (t * heads + head) * d;
                    for (int64_t i = 0; i < d; ++i) dst[i] = f32_to_bf16(o[i]);
                    if (lse) lse[t * heads + head] = row_lse;
                }
            }
        }
        amx_end(amx);
        free(kp);
        free(vp);
        free(rb);
    }
    return failed ? -1 : 0;
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)n; (void)len; (void)hkv;
    (void)group; (void)d; (void)scale; (void)out; (void)lse;
    return -1;
#endif
}
