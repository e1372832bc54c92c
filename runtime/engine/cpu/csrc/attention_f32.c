/* fp32 attention kernels: the decode step over the decode-key mirror, a shared prefix for every
 * decode query (cascade), and a causal prefill. The same code serves every build level: it is
 * written over the vector of AV_W fp32 lanes of lanes_f32.h (16 with AVX-512, 8 with AVX2 + FMA,
 * 1 in plain C), so an AVX2-only host, where bf16 matmuls are emulated and the server runs in
 * fp32, gets the fused paths too. Scores, softmax and accumulation are fp32 throughout. Called through
 * runtime/cpu/attention_kernels_f32.py, which documents the layouts and why each path exists. */
#include "lanes_f32.h"
#include "entry_points.h"

/* Query rows per register tile (each row holds AV_TILE vectors of accumulators): as many as the
 * vector registers allow with the operand loads (32 zmm, 16 ymm). */
#if AV_W == 16
#define AV_ROWS 8
#elif AV_W == 8
#define AV_ROWS 6
#else
#define AV_ROWS 4
#endif
#define AV_TILE 2
#define AV_INLINE static inline __attribute__((always_inline))
#define F32_PACK 16    /* keys per block of a packed K (one 64-byte line per dim) */
#define F32_KEYS 256   /* keys per online-softmax block of the prefix and prefill kernels */

/* 1 when the build has vector lanes (AVX2 or AVX-512), 0 in plain C. */
int attention_f32_vectorised(void) { return AV_W > 1; }

/* Prefetch cursor: the next work item's K rows (rows of row_bytes, k_stride bytes apart) and V
 * bytes (contiguous), `rate` cache lines per step, brought toward L2 while this item computes
 * (the decode kernel is otherwise latency-bound on the cold mirror). */
typedef struct {
    const char* k; const char* k_row; const char* v; const char* v_end;  /* k: next line (NULL: none) */
    int64_t k_stride, row_bytes, k_rows_left, rate;
} Ahead;

AV_INLINE void ahead_step(Ahead* a) {
    for (int64_t u = 0; u < a->rate; ++u) {
        if (a->k_rows_left > 0) {
            _mm_prefetch(a->k, _MM_HINT_T1);
            a->k += 64;
            if (a->k >= a->k_row + a->row_bytes) {
                a->k_row += a->k_stride;
                a->k = a->k_row;
                a->k_rows_left--;
            }
        } else if (a->v < a->v_end) {
            _mm_prefetch(a->v, _MM_HINT_T1);
            a->v += 64;
        } else {
            return;
        }
    }
}

/* ---- register tiles; R and NV are constants at every call (the dispatch switches below) ----
 * K is addressed as key j, dim i at k[(j / F32_PACK) * kblk + j % F32_PACK + i * ks]: the mirror's
 * K^T rows (kblk = F32_PACK, ks = cap) and the packed layout (kblk = d * F32_PACK, ks = F32_PACK)
 * alike. Scores of R query rows (q rows d apart, pre-scaled) for keys [j, j + NV * AV_W) go to
 * s[r * ss + j], plus bias[j] when given. */
AV_INLINE void scores_tile(const int R, const int NV, const float* q, int64_t d, const float* k, int64_t ks,
                           int64_t kblk, int64_t j, const float* bias, float* s, int64_t ss, Ahead* pf) {
    av acc[AV_ROWS][AV_TILE];
    const float* kp[AV_TILE];
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) {
        const int64_t jj = j + u * AV_W;
        kp[u] = k + (jj / F32_PACK) * kblk + jj % F32_PACK;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) acc[r][u] = av_set1(0.0f);
    for (int64_t i = 0; i < d; ++i) {
        if (pf) ahead_step(pf);
        av kv[AV_TILE];
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) kv[u] = av_load(kp[u] + i * ks);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const av qb = av_set1(q[r * d + i]);
#pragma GCC unroll 8
            for (int u = 0; u < NV; ++u) acc[r][u] = av_fma(qb, kv[u], acc[r][u]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) {
            const int64_t jj = j + u * AV_W;
            av x = acc[r][u];
            if (bias) x = av_add(x, av_load(bias + jj));
            av_store(s + r * ss + jj, x);
        }
}

/* o[r * os + i0 + ...] += sum_{j < jn} p[r * ps + j] * v[j * vs + i0 + ...] for NV vectors of dims. */
AV_INLINE void values_tile(const int R, const int NV, const float* p, int64_t ps, int64_t jn, const float* v,
                           int64_t vs, int64_t i0, float* o, int64_t os, Ahead* pf) {
    av acc[AV_ROWS][AV_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) acc[r][u] = av_load(o + r * os + i0 + u * AV_W);
    for (int64_t j = 0; j < jn; ++j) {
        if (pf) ahead_step(pf);
        av vv[AV_TILE];
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) vv[u] = av_load(v + j * vs + i0 + u * AV_W);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const av pb = av_set1(p[r * ps + j]);
#pragma GCC unroll 8
            for (int u = 0; u < NV; ++u) acc[r][u] = av_fma(pb, vv[u], acc[r][u]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int u = 0; u < NV; ++u) av_store(o + r * os + i0 + u * AV_W, acc[r][u]);
}

#if AV_W > 1
/* Scores of R rows for the `rem` (< AV_W) keys at k (K^T rows ks apart): scores_tile's chain for one
 * vector of keys, lane for lane, on a masked load (the lanes past rem read nothing and are not stored). */
AV_INLINE void scores_tail(const int R, const float* q, int64_t d, const float* k, int64_t ks, int64_t rem,
                           const float* bias, float* s, int64_t ss) {
    av acc[AV_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = av_set1(0.0f);
    for (int64_t i = 0; i < d; ++i) {
        const av kv = av_load_n(k + i * ks, rem);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r] = av_fma(av_set1(q[r * d + i]), kv, acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        av x = acc[r];
        if (bias) x = av_add(x, av_load_n(bias, rem));
        av_store_n(s + r * ss, x, rem);
    }
}
#endif

/* Scores of R rows for keys [0, jn), then the products with values [0, jn) into o. */
AV_INLINE void scores_rows(const int R, const float* q, int64_t d, const float* k, int64_t ks, int64_t kblk,
                           int64_t jn, const float* bias, float* s, int64_t ss, Ahead* pf) {
    int64_t j = 0;
    for (; j + AV_TILE * AV_W <= jn; j += AV_TILE * AV_W) scores_tile(R, AV_TILE, q, d, k, ks, kblk, j, bias, s, ss, pf);
    for (; j + AV_W <= jn; j += AV_W) scores_tile(R, 1, q, d, k, ks, kblk, j, bias, s, ss, pf);
#if AV_W > 1
    if (j < jn && kblk == F32_PACK) {  /* the mirror's K^T rows: the last keys as one masked vector */
        scores_tail(R, q, d, k + j, ks, jn - j, bias ? bias + j : 0, s + j, ss);
        j = jn;
    }
#endif
    for (; j < jn; ++j) {
        const float* kj = k + (j / F32_PACK) * kblk + j % F32_PACK;
        for (int r = 0; r < R; ++r) {
            float a = 0.0f;
            for (int64_t i = 0; i < d; ++i) a += q[r * d + i] * kj[i * ks];
            s[r * ss + j] = bias ? a + bias[j] : a;
        }
    }
}

AV_INLINE void values_rows(const int R, const float* p, int64_t ps, int64_t jn, const float* v, int64_t vs,
                           int64_t d, float* o, int64_t os, Ahead* pf) {
    int64_t i0 = 0;
    for (; i0 + AV_TILE * AV_W <= d; i0 += AV_TILE * AV_W) values_tile(R, AV_TILE, p, ps, jn, v, vs, i0, o, os, pf);
    for (; i0 + AV_W <= d; i0 += AV_W) values_tile(R, 1, p, ps, jn, v, vs, i0, o, os, pf);
    for (; i0 < d; ++i0)
        for (int r = 0; r < R; ++r) {
            float a = o[r * os + i0];
            for (int64_t j = 0; j < jn; ++j) a += p[r * ps + j] * v[j * vs + i0];
            o[r * os + i0] = a;
        }
}

/* CALL(R) with R a constant in [1, AV_ROWS] (the cases above AV_ROWS are never taken). */
#define AV_CAP(R) ((R) < AV_ROWS ? (R) : AV_ROWS)
#define AV_DISPATCH(R, CALL) \
    switch (R) { case 1: CALL(1); break; case 2: CALL(AV_CAP(2)); break; case 3: CALL(AV_CAP(3)); break; \
                 case 4: CALL(AV_CAP(4)); break; case 5: CALL(AV_CAP(5)); break; case 6: CALL(AV_CAP(6)); break; \
                 case 7: CALL(AV_CAP(7)); break; default: CALL(AV_CAP(8)); break; }

static void scores_any(int R, const float* q, int64_t d, const float* k, int64_t ks, int64_t kblk, int64_t jn,
                       const float* bias, float* s, int64_t ss, Ahead* pf) {
#define SCORES(RR) scores_rows(RR, q, d, k, ks, kblk, jn, bias, s, ss, pf)
    AV_DISPATCH(R, SCORES)
#undef SCORES
}

static void values_any(int R, const float* p, int64_t ps, int64_t jn, const float* v, int64_t vs, int64_t d,
                       float* o, int64_t os, Ahead* pf) {
#define VALUES(RR) values_rows(RR, p, ps, jn, v, vs, d, o, os, pf)
    AV_DISPATCH(R, VALUES)
#undef VALUES
}

/* Online-softmax update of row state (m, l, o [d]) with scores s[0, jn), of which the first
 * `seen` count (the rest become probability 0); s becomes the probabilities. */
static inline void softmax_update(float* s, int64_t jn, int64_t seen, float* m, float* l, float* o, int64_t d) {
    if (seen > jn) seen = jn;
    if (seen < 0) seen = 0;
    float mx = -INFINITY;
    int64_t j = 0;
    if (seen >= AV_W) {
        av vm = av_load(s);
        for (j = AV_W; j + AV_W <= seen; j += AV_W) vm = av_max(vm, av_load(s + j));
        mx = av_hmax(vm);
    }
    for (; j < seen; ++j) mx = s[j] > mx ? s[j] : mx;
    const float m_new = mx > *m ? mx : *m;
    if (m_new == -INFINITY) {  /* nothing seen yet */
        memset(s, 0, (size_t)jn * sizeof(float));
        return;
    }
    const float corr = fast_exp(*m - m_new);
    const av vmn = av_set1(m_new);
    av vs = av_set1(0.0f);
    for (j = 0; j + AV_W <= seen; j += AV_W) {
        const av e = av_exp_neg(av_sub(av_load(s + j), vmn));
        vs = av_add(vs, e);
        av_store(s + j, e);
    }
#if AV_W > 1
    if (j < seen) {  /* the last keys as one masked vector: the same lane sums as inside a wider block */
        const int64_t rem = seen - j;
        av_store_n(s + j, av_exp_neg(av_sub(av_load_n(s + j, rem), vmn)), rem);
        vs = av_add(vs, av_load_n(s + j, rem));
        j = seen;
    }
#endif
    float sum = av_hsum(vs);
    for (; j < seen; ++j) { s[j] = fast_exp(s[j] - m_new); sum += s[j]; }
    for (; j < jn; ++j) s[j] = 0.0f;
    if (corr != 1.0f && *l != 0.0f) {
        const av vc = av_set1(corr);
        int64_t i = 0;
        for (; i + AV_W <= d; i += AV_W) av_store(o + i, av_mul(av_load(o + i), vc));
        for (; i < d; ++i) o[i] *= corr;
    }
    *l = *l * corr + sum;
    *m = m_new;
}

/* Row state -> normalised output (out, d values) and the log-sum-exp (returned). */
static inline float finish_row(float m, float l, const float* o, int64_t d, float* out) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t i = 0; i < d; ++i) out[i] = o[i] * inv;
    return l > 0.0f ? m + logf(l) : -INFINITY;
}

/* Rows per chunk when `rows` rows are cut into the fewest chunks of at most AV_ROWS, evenly. */
static inline int64_t chunk_rows(int64_t rows) {
    const int64_t chunks = (rows + AV_ROWS - 1) / AV_ROWS;
    return (rows + chunks - 1) / chunks;
}

/* decode_attention_bf16's contract in fp32 (see attention_bf16.c): q [n, hkv, group, d] (request
 * rows q_stride apart), kt [n, hkv, d, cap], v [n, hkv, cap, d], bias [n, cap] or NULL, keys
 * [0, width); k_new / v_new [n, hkv, d] (rows *_stride apart) stored first at key pos[b]; init_o
 * [n, hkv, group, d] and init_lse [n, hkv, group] continue an earlier softmax. Writes out
 * [n, hkv, group, d] and, when lse != NULL, lse [n, hkv, group]. kv_row (NULL: row b reads
 * mirror row b) maps query row b to its mirror row in [0, kv_rows): several query rows of one
 * request (a verify step's input token and drafts) then share it, each with its own bias row and
 * append position; every append is stored before any row attends. Returns 0, or -1 (nothing
 * written) when group or d exceed the bounds or an append position or mirror row is outside its range.
 *
 * A row gives the same bits whatever the batch's longest request (the width) is: a last partial
 * vector of keys is computed as a masked vector (never reading past width), lane for lane as a
 * whole one, and its softmax sum adds zeros in the masked lanes, so keys past a row's own length
 * (bias -inf) change nothing in its result however many there are. */
int decode_attention_f32(
    const float* q, int64_t q_stride,
    float* kt, float* v, const float* bias, int64_t cap, int64_t width,
    float* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const float* k_new, int64_t k_new_stride, const float* v_new, int64_t v_new_stride, const int64_t* pos,
    const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows)
{
    if (group < 1 || group > MAX_G || d < 1 || d > MAX_D) return -1;
    if (k_new)
        for (int64_t b = 0; b < n; ++b)
            if (pos[b] < 0 || pos[b] >= cap) return -1;
    if (kv_row)
        for (int64_t b = 0; b < n; ++b)
            if (kv_row[b] < 0 || kv_row[b] >= kv_rows) return -1;
    if (k_new && kv_row) {  /* rows share mirror rows: every new key lands before any row reads them */
#pragma omp parallel for schedule(static)
        for (int64_t bh = 0; bh < n * hkv; ++bh) {
            const int64_t b = bh / hkv, mh = kv_row[b] * hkv + bh % hkv;
            const float* kn = k_new + b * k_new_stride + (bh % hkv) * d;
            for (int64_t i = 0; i < d; ++i) kt[mh * d * cap + i * cap + pos[b]] = kn[i];
            memcpy(v + (mh * cap + pos[b]) * d, v_new + b * v_new_stride + (bh % hkv) * d, (size_t)d * sizeof(float));
        }
    }
    const int64_t per = chunk_rows(group);
    const int64_t chunks = (group + per - 1) / per;
    /* steps of the tile loops per item, to spread the next item's lines over them */
    const int64_t steps = chunks * (((width + AV_TILE * AV_W - 1) / (AV_TILE * AV_W)) * d
                                    + ((d + AV_TILE * AV_W - 1) / (AV_TILE * AV_W)) * width);
    const int64_t lines = d * ((width * 4 + 63) / 64) + (width * d * 4 + 63) / 64;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < n * hkv; ++bh) {
        const int64_t b = bh / hkv, h = bh % hkv;
        const int64_t mh = (kv_row ? kv_row[b] : b) * hkv + h;  /* the mirror's (row, head) */
        float* ktp = kt + mh * d * cap;
        float* vp = v + mh * cap * d;
        if (k_new && !kv_row) {
            const float* kn = k_new + b * k_new_stride + h * d;
            for (int64_t i = 0; i < d; ++i) ktp[i * cap + pos[b]] = kn[i];
            memcpy(vp + pos[b] * d, v_new + b * v_new_stride + h * d, (size_t)d * sizeof(float));
        }
        const float* qp = q + b * q_stride + h * group * d;
        float qf[MAX_G * MAX_D], acc[MAX_G * MAX_D], s[AV_ROWS * BLOCK];
        float m[MAX_G], l[MAX_G];
        for (int64_t i = 0; i < group * d; ++i) { qf[i] = qp[i] * scale; acc[i] = 0.0f; }
        for (int64_t g = 0; g < group; ++g) { m[g] = -INFINITY; l[g] = 0.0f; }
        if (init_o) {
            memcpy(acc, init_o + bh * group * d, (size_t)(group * d) * sizeof(float));
            for (int64_t g = 0; g < group; ++g) {
                m[g] = init_lse[bh * group + g];
                l[g] = m[g] == -INFINITY ? 0.0f : 1.0f;
            }
        }
        Ahead pf = {0, 0, 0, 0, cap * 4, width * 4, 0, steps > 0 ? (lines + steps - 1) / steps : 1};
        if (bh + 1 < n * hkv) {
            const int64_t next = (kv_row ? kv_row[(bh + 1) / hkv] : (bh + 1) / hkv) * hkv + (bh + 1) % hkv;
            pf.k = pf.k_row = (const char*)(kt + next * d * cap);
            pf.k_rows_left = d;
            pf.v = (const char*)(v + next * cap * d);
            pf.v_end = pf.v + width * d * 4;
        }
        const float* bp = bias ? bias + b * cap : 0;
        for (int64_t j0 = 0; j0 < width; j0 += BLOCK) {
            const int64_t jn = width - j0 < BLOCK ? width - j0 : BLOCK;
            for (int64_t g0 = 0; g0 < group; g0 += per) {
                const int64_t r = group - g0 < per ? group - g0 : per;
                scores_any((int)r, qf + g0 * d, d, ktp + j0, cap, F32_PACK, jn, bp ? bp + j0 : 0, s, BLOCK, &pf);
                for (int64_t g = 0; g < r; ++g)
                    softmax_update(s + g * BLOCK, jn, jn, &m[g0 + g], &l[g0 + g], acc + (g0 + g) * d, d);
                values_any((int)r, s, BLOCK, jn, vp + j0 * d, d, d, acc + g0 * d, d, &pf);
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            const float row_lse = finish_row(m[g], l[g], acc + g * d, d, out + (bh * group + g) * d);
            if (lse) lse[bh * group + g] = row_lse;
        }
    }
    return 0;
}

/* Up to AV_ROWS query rows of one KV head: pre-scaled queries, scores of one key block and the
 * online-softmax state. */
typedef struct {
    float q[AV_ROWS * MAX_D];
    float s[AV_ROWS * F32_KEYS];
    float o[AV_ROWS * MAX_D];
    float m[AV_ROWS], l[AV_ROWS];
} Rows;

static inline void rows_begin(Rows* rw, int64_t nr, int64_t d) {
    for (int64_t r = 0; r < nr; ++r) { rw->m[r] = -INFINITY; rw->l[r] = 0.0f; }
    memset(rw->o, 0, (size_t)(nr * d) * sizeof(float));
}

/* Rows [0, nr) against keys [0, keys) of a packed K (kp [keys_pad / 16, d, 16]) and V rows vs
 * apart; row r sees the keys below limit[r] (NULL: all). */
static void rows_attend(Rows* rw, int64_t nr, int64_t d, const float* kp, const float* v, int64_t vs, int64_t keys,
                        const int64_t* limit) {
    for (int64_t j0 = 0; j0 < keys; j0 += F32_KEYS) {
        const int64_t jn = keys - j0 < F32_KEYS ? keys - j0 : F32_KEYS;
        const int64_t jn_pad = (jn + F32_PACK - 1) / F32_PACK * F32_PACK;  /* packed zeros past keys */
        scores_any((int)nr, rw->q, d, kp + j0 * d, F32_PACK, d * F32_PACK, jn_pad, 0, rw->s, F32_KEYS, 0);
        for (int64_t r = 0; r < nr; ++r)
            softmax_update(rw->s + r * F32_KEYS, jn, limit ? limit[r] - j0 : jn, &rw->m[r], &rw->l[r], rw->o + r * d, d);
        values_any((int)nr, rw->s, F32_KEYS, jn, v + j0 * vs, vs, d, rw->o, d, 0);
    }
}

/* Every query q [n, hkv, group, d] (request rows q_stride apart) against one shared key set of p
 * keys: kp [hkv, p_pad / 16, d, 16] (packed, zeros past p), v [hkv, p, d]. AV_ROWS query rows of
 * a KV head share each key load. Writes out [n, hkv, group, d] (normalised) and lse
 * [n, hkv, group] of the scaled scores. Returns 0, or -1 when the shapes are outside its bounds. */
int prefix_attention_f32(const float* q, int64_t q_stride, const float* kp, const float* v, int64_t p,
                         int64_t p_pad, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
                         float* out, float* lse)
{
    if (d < 1 || d > MAX_D || p < 1 || p > p_pad || p_pad % F32_PACK || group < 1) return -1;
    const int64_t rows = n * group;
    const int64_t per = chunk_rows(rows < AV_ROWS ? rows : AV_ROWS);
    const int64_t blocks = (rows + per - 1) / per;
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < hkv * blocks; ++w) {
        const int64_t h = w / blocks, r0 = (w % blocks) * per;
        const int64_t nr = rows - r0 < per ? rows - r0 : per;
        Rows rw;
        for (int64_t r = 0; r < nr; ++r) {
            const int64_t b = (r0 + r) / group, g = (r0 + r) % group;
            const float* src = q + b * q_stride + (h * group + g) * d;
            for (int64_t i = 0; i < d; ++i) rw.q[r * d + i] = src[i] * scale;
        }
        rows_begin(&rw, nr, d);
        rows_attend(&rw, nr, d, kp + h * p_pad * d, v + h * p * d, d, p, 0);
        for (int64_t r = 0; r < nr; ++r) {
            const int64_t b = (r0 + r) / group, g = (r0 + r) % group, row = (b * hkv + h) * group + g;
            lse[row] = finish_row(rw.m[r], rw.l[r], rw.o + r * d, d, out + row * d);
        }
    }
    return 0;
}

static inline void prefetch_floats(const float* p, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) _mm_prefetch((const char*)(p + i), _MM_HINT_T0);
}

/* Keys of one KV head, rows k + j * k_stride (j < len, d each), into the packed layout
 * kp [len_pad / 16, d, 16], zeros past len. */
static void pack_keys(const float* k, int64_t k_stride, int64_t len, int64_t len_pad, int64_t d, float* kp) {
    for (int64_t j0 = 0; j0 < len_pad; j0 += F32_PACK) {
        float* dst = kp + j0 * d;
        for (int64_t jj = 0; jj < F32_PACK; ++jj) {
            const int64_t j = j0 + jj;
            if (j < len) {
                const float* src = k + j * k_stride;
                for (int64_t i = 0; i < d; ++i) dst[i * F32_PACK + jj] = src[i];
            } else {
                for (int64_t i = 0; i < d; ++i) dst[i * F32_PACK + jj] = 0.0f;
            }
        }
    }
}

/* Causal self-attention of n prompts of len new tokens each, no cached keys: token
 * t = b * len + pos has its query heads at q + t * q_stride (head h * group + g of KV head h),
 * its key and value heads at k + t * k_stride + h * d (likewise v). Each (request, KV head)
 * packs its keys once; its query rows, position-major (row = pos * group + g), go AV_ROWS at a
 * time, reading only the keys up to their last position. Writes out [n * len, hkv * group, d]
 * and, when lse != NULL, lse [n * len, hkv * group]. Returns 0, or -1 (nothing usable written)
 * when the shapes are outside its bounds or memory runs out. */
int causal_attention_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                         int64_t v_stride, int64_t n, int64_t len, int64_t hkv, int64_t group, int64_t d, float scale,
                         float* out, float* lse)
{
    if (d < 1 || d > MAX_D || len < 1 || group < 1) return -1;
    const int64_t len_pad = (len + F32_PACK - 1) / F32_PACK * F32_PACK, rows = len * group, heads = hkv * group;
    const int64_t per = chunk_rows(rows < AV_ROWS ? rows : AV_ROWS);
    int failed = 0;
#pragma omp parallel
    {
        float* kp = malloc((size_t)(len_pad * d) * sizeof(float));
        Rows* rw = malloc(sizeof(Rows));
        if (!kp || !rw) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * hkv; ++w) {
            if (!kp || !rw) continue;
            const int64_t b = w / hkv, h = w % hkv;
            pack_keys(k + b * len * k_stride + h * d, k_stride, len, len_pad, d, kp);
            const float* vh = v + b * len * v_stride + h * d;
            const int64_t blocks = (rows + per - 1) / per, share = (len + blocks - 1) / blocks;
            for (int64_t r0 = 0; r0 < rows; r0 += per) {
                const int64_t nr = rows - r0 < per ? rows - r0 : per, blk = r0 / per;
                /* The rows come from DRAM a few hundred bytes apart (too sparse for the hardware
                 * prefetcher): fetch the next block's queries, and a share of the next item's keys
                 * and values, while this block computes. */
                for (int64_t row = r0 + per; row < r0 + 2 * per && row < rows; ++row)
                    prefetch_floats(q + (b * len + row / group) * q_stride + (h * group + row % group) * d, d);
                if (w + 1 < n * hkv) {
                    const int64_t b1 = (w + 1) / hkv, h1 = (w + 1) % hkv;
                    for (int64_t j = blk * share; j < (blk + 1) * share && j < len; ++j) {
                        prefetch_floats(k + (b1 * len + j) * k_stride + h1 * d, d);
                        prefetch_floats(v + (b1 * len + j) * v_stride + h1 * d, d);
                    }
                    if (r0 + per >= rows)
                        for (int64_t row = 0; row < per && row < rows; ++row)
                            prefetch_floats(q + (b1 * len + row / group) * q_stride + (h1 * group + row % group) * d, d);
                }
                int64_t limit[AV_ROWS];
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t row = r0 + r, ps = row / group;
                    const float* src = q + (b * len + ps) * q_stride + (h * group + row % group) * d;
                    for (int64_t i = 0; i < d; ++i) rw->q[r * d + i] = src[i] * scale;
                    limit[r] = ps + 1;
                }
                rows_begin(rw, nr, d);
                rows_attend(rw, nr, d, kp, vh, v_stride, limit[nr - 1], limit);
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t row = r0 + r, t = b * len + row / group, head = h * group + row % group;
                    const float row_lse = finish_row(rw->m[r], rw->l[r], rw->o + r * d, d, out + (t * heads + head) * d);
                    if (lse) lse[t * heads + head] = row_lse;
                }
            }
        }
        free(kp);
        free(rw);
    }
    return failed ? -1 : 0;
}
