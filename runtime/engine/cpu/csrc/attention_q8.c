/* Decode attention over a quantized decode-key mirror (decode_attention_q8): the contract of
 * decode_attention_bf16 / _f32 (one online-softmax pass per (request, KV head), the step's new keys
 * stored first, a shared prefix's result continued, verify rows sharing mirror rows), with the
 * mirror's keys and values one byte each (kv_codes.h: int8 with a scale per key, fp8 e4m3 / e5m2
 * with one scale per layer), widened to fp32 in registers as they are read: never a dequantized
 * copy. Written over lanes_f32.h's vector (16 lanes with AVX-512, 8 with AVX2 + F16C, one float in
 * plain C), so every build level has it. Called through runtime/engine/cpu/attention_kernels_q8.py,
 * which documents the layouts and why the mirror is kept quantized, and by decode_layers.c.
 *
 * The widening, per format (a "raw" value; the factor to the real value is folded elsewhere):
 * - int8: sign-extend, convert (raw = the code); the key's scale multiplies its score after the
 *   dot product, the value's scale its probability before the value product;
 * - e4m3: the code's bits placed in an fp16 (sign << 15 | (x & 0x7f) << 7) and converted (raw =
 *   value * 2^-8, subnormals included: e4m3's are fp16 subnormals); the 2^8 and the layer's K scale
 *   fold into the queries, the layer's V scale and the 2^8 into the probabilities;
 * - e5m2: the code is an fp16's top byte (raw = value).
 * Scores, softmax and accumulation are fp32. */
#include "lanes_f32.h"
#include "entry_points.h"
#include "kv_codes.h"

#define Q8_INLINE static inline __attribute__((always_inline))
#if AV_W == 16
#define Q8_ROWS 8
#elif AV_W == 8
#define Q8_ROWS 6
#else
#define Q8_ROWS 4
#endif
/* vectors of keys (scores) or of dims (values) per register tile of R rows */
#if AV_W == 16
#define Q8_NV(R) ((R) <= 4 ? 4 : 2)
#else
#define Q8_NV(R) 2
#endif
#define Q8_MAX_NV 4
#define Q8_AHEAD 2  /* key blocks between a block and the one its prefetches bring in */

/* ---- a vector of codes as fp32 raw values ---- */
#if AV_W == 16
Q8_INLINE av q8_widen(__m128i b, const int FMT) {
    if (FMT == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    if (FMT == KV_FP8_E4M3)  /* (sign-extended, so the sign lands on bit 15 too; bit 14 cleared) */
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                                _mm256_set1_epi16((short)0xbf80)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}
Q8_INLINE av q8_load(const uint8_t* p, const int FMT, const float* lut) {
    (void)lut;
    return q8_widen(_mm_loadu_si128((const __m128i*)p), FMT);
}
Q8_INLINE av q8_load_n(const uint8_t* p, int64_t m, const int FMT, const float* lut) {
    (void)lut;
    return q8_widen(_mm_maskz_loadu_epi8((__mmask16)((1u << m) - 1u), p), FMT);
}
#elif AV_W == 8
#ifndef __F16C__
#error "the AVX2 build of attention_q8.c widens fp8 codes with F16C (x86-64-v3 has it)"
#endif
Q8_INLINE av q8_widen(__m128i b, const int FMT) {  /* the low 8 bytes of b */
    if (FMT == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    if (FMT == KV_FP8_E4M3)
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xbf80)));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}
Q8_INLINE av q8_load(const uint8_t* p, const int FMT, const float* lut) {
    (void)lut;
    return q8_widen(_mm_loadl_epi64((const __m128i*)p), FMT);
}
Q8_INLINE av q8_load_n(const uint8_t* p, int64_t m, const int FMT, const float* lut) {
    (void)lut;
    uint64_t bytes = 0;
    memcpy(&bytes, p, (size_t)m);
    return q8_widen(_mm_cvtsi64_si128((long long)bytes), FMT);
}
#else
Q8_INLINE av q8_load(const uint8_t* p, const int FMT, const float* lut) { (void)FMT; return lut[*p]; }
Q8_INLINE av q8_load_n(const uint8_t* p, int64_t m, const int FMT, const float* lut) {
    (void)m; (void)FMT; return lut[*p];
}
#endif

/* The raw value of each code (the plain C build's widening; the vector builds' lanes agree). */
static float q8_raw(uint8_t c, int fmt) {
    if (fmt == KV_INT8) return (float)(int8_t)c;
    const uint16_t h = fmt == KV_FP8_E4M3 ? (uint16_t)(((c & 0x80u) << 8) | ((c & 0x7fu) << 7)) : (uint16_t)(c << 8);
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const float mag = e == 31 ? (m ? NAN : INFINITY) : e ? ldexpf((float)(1024 + m), e - 25) : ldexpf((float)m, -24);
    return h & 0x8000u ? -mag : mag;
}

/* Prefetch cursor over the lines a later key block reads (K^T rows of rb bytes, kstride apart;
 * then V bytes; then the scale bytes), `rate` lines per step, brought toward L2 while this block
 * computes (the mirror's K^T rows are d streams a cap apart: too many for the hardware prefetcher). */
typedef struct {
    const char *k, *k_row, *v, *v_end, *ks, *ks_end, *vs, *vs_end;
    int64_t kstride, rb, k_rows_left, rate;
} Q8Ahead;

Q8_INLINE void q8_ahead(Q8Ahead* a) {
    for (int64_t u = 0; u < a->rate; ++u) {
        if (a->k_rows_left > 0) {
            _mm_prefetch(a->k, _MM_HINT_T1);
            a->k += 64;
            if (a->k >= a->k_row + a->rb) { a->k_row += a->kstride; a->k = a->k_row; a->k_rows_left--; }
        } else if (a->v < a->v_end) {
            _mm_prefetch(a->v, _MM_HINT_T1); a->v += 64;
        } else if (a->ks < a->ks_end) {
            _mm_prefetch(a->ks, _MM_HINT_T1); a->ks += 64;
        } else if (a->vs < a->vs_end) {
            _mm_prefetch(a->vs, _MM_HINT_T1); a->vs += 64;
        } else {
            return;
        }
    }
}

/* s[r * ss + j + ...] = (sum_i q[r * d + i] * k[i * cap + j + ...]) (* ks[j + ...]) (+ bias[j + ...]) for
 * R rows and NV vectors of keys from j (m < AV_W: one masked vector of m keys, NV == 1). */
Q8_INLINE void q8_scores_tile(const int R, const int NV, const int FMT, const float* q, int64_t d, const uint8_t* k,
                              int64_t cap, int64_t j, int64_t m, const float* ks, const float* bias, float* s,
                              int64_t ss, const float* lut, Q8Ahead* pf) {
    av acc[Q8_ROWS][Q8_MAX_NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) acc[r][u] = av_set1(0.0f);
    for (int64_t i = 0; i < d; ++i) {
        q8_ahead(pf);
        av kv[Q8_MAX_NV];
        const uint8_t* ki = k + i * cap + j;
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) kv[u] = m < AV_W ? q8_load_n(ki, m, FMT, lut) : q8_load(ki + u * AV_W, FMT, lut);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const av qb = av_set1(q[r * d + i]);
#pragma GCC unroll 4
            for (int u = 0; u < NV; ++u) acc[r][u] = av_fma(qb, kv[u], acc[r][u]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) {
            const int64_t jj = j + u * AV_W;
            av x = acc[r][u];
            if (FMT == KV_INT8) x = av_mul(x, av_load_n(ks + jj, m < AV_W ? m : AV_W));
            if (bias) x = av_add(x, av_load_n(bias + jj, m < AV_W ? m : AV_W));
            av_store_n(s + r * ss + jj, x, m < AV_W ? m : AV_W);
        }
}

/* o[r * os + i0 + ...] += sum_{j < jn} p[r * ps + j] * v[j * d + i0 + ...] for R rows and NV vectors
 * of dims from i0 (m < AV_W: one masked vector of m dims, NV == 1). */
Q8_INLINE void q8_values_tile(const int R, const int NV, const int FMT, const float* p, int64_t ps, int64_t jn,
                              const uint8_t* v, int64_t d, int64_t i0, int64_t m, float* o, int64_t os,
                              const float* lut, Q8Ahead* pf) {
    av acc[Q8_ROWS][Q8_MAX_NV];
    const int64_t w = m < AV_W ? m : AV_W;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) acc[r][u] = av_load_n(o + r * os + i0 + u * AV_W, w);
    for (int64_t j = 0; j < jn; ++j) {
        q8_ahead(pf);
        av vv[Q8_MAX_NV];
        const uint8_t* vj = v + j * d + i0;
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) vv[u] = m < AV_W ? q8_load_n(vj, m, FMT, lut) : q8_load(vj + u * AV_W, FMT, lut);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const av pb = av_set1(p[r * ps + j]);
#pragma GCC unroll 4
            for (int u = 0; u < NV; ++u) acc[r][u] = av_fma(pb, vv[u], acc[r][u]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) av_store_n(o + r * os + i0 + u * AV_W, acc[r][u], w);
}

/* Scores of R rows for keys [0, jn) of a block, then (after the caller's softmax) the values. */
Q8_INLINE void q8_scores(const int R, const int FMT, const float* q, int64_t d, const uint8_t* k, int64_t cap,
                         int64_t jn, const float* ks, const float* bias, float* s, int64_t ss, const float* lut,
                         Q8Ahead* pf) {
    const int NV = Q8_NV(R);
    int64_t j = 0;
    for (; j + NV * AV_W <= jn; j += NV * AV_W) q8_scores_tile(R, NV, FMT, q, d, k, cap, j, AV_W, ks, bias, s, ss, lut, pf);
    for (; j + AV_W <= jn; j += AV_W) q8_scores_tile(R, 1, FMT, q, d, k, cap, j, AV_W, ks, bias, s, ss, lut, pf);
    if (j < jn) q8_scores_tile(R, 1, FMT, q, d, k, cap, j, jn - j, ks, bias, s, ss, lut, pf);
}

Q8_INLINE void q8_values(const int R, const int FMT, const float* p, int64_t ps, int64_t jn, const uint8_t* v,
                         int64_t d, float* o, int64_t os, const float* lut, Q8Ahead* pf) {
    const int NV = Q8_NV(R);
    int64_t i0 = 0;
    for (; i0 + NV * AV_W <= d; i0 += NV * AV_W) q8_values_tile(R, NV, FMT, p, ps, jn, v, d, i0, AV_W, o, os, lut, pf);
    for (; i0 + AV_W <= d; i0 += AV_W) q8_values_tile(R, 1, FMT, p, ps, jn, v, d, i0, AV_W, o, os, lut, pf);
    if (i0 < d) q8_values_tile(R, 1, FMT, p, ps, jn, v, d, i0, d - i0, o, os, lut, pf);
}

/* Online-softmax update of one row (m, l, o [d]) with scores s[0, jn): s becomes the probabilities.
 * A row gives the same bits whatever the call's width (a verify step's longest request, or a batch's):
 * the scores' last partial vector is a masked one computed lane for lane as a whole one, the sums add
 * its lanes as a wider block would (its masked keys add 0), and masked keys add 0 to the values. */
static inline void q8_softmax(float* s, int64_t jn, float* m, float* l, float* o, int64_t d) {
    float mx = -INFINITY;
    int64_t j = 0;
    if (jn >= AV_W) {
        av vm = av_load(s);
        for (j = AV_W; j + AV_W <= jn; j += AV_W) vm = av_max(vm, av_load(s + j));
        mx = av_hmax(vm);
    }
    for (; j < jn; ++j) mx = s[j] > mx ? s[j] : mx;
    const float m_new = mx > *m ? mx : *m;
    if (m_new == -INFINITY) {  /* nothing seen yet */
        memset(s, 0, (size_t)jn * sizeof(float));
        return;
    }
    const float corr = fast_exp(*m - m_new);
    const av vmn = av_set1(m_new);
    av vsum = av_set1(0.0f);
    for (j = 0; j + AV_W <= jn; j += AV_W) {
        const av e = av_exp_neg(av_sub(av_load(s + j), vmn));
        vsum = av_add(vsum, e);
        av_store(s + j, e);
    }
#if AV_W > 1
    if (j < jn) {  /* the last keys as one masked vector: the lane sums of a wider block (masked lanes add 0) */
        const int64_t rem = jn - j;
        const av e = av_exp_neg(av_sub(av_load_n(s + j, rem), vmn));
        av_store_n(s + j, e, rem);
        vsum = av_add(vsum, av_load_n(s + j, rem));
        j = jn;
    }
#endif
    float sum = av_hsum(vsum);
    for (; j < jn; ++j) { s[j] = fast_exp(s[j] - m_new); sum += s[j]; }
    if (corr != 1.0f && *l != 0.0f) {
        const av vc = av_set1(corr);
        int64_t i = 0;
        for (; i + AV_W <= d; i += AV_W) av_store(o + i, av_mul(av_load(o + i), vc));
        for (; i < d; ++i) o[i] *= corr;
    }
    *l = *l * corr + sum;
    *m = m_new;
}

/* CALL(R) with R a constant in [1, Q8_ROWS]. */
#define Q8_CAP(R) ((R) < Q8_ROWS ? (R) : Q8_ROWS)
#define Q8_DISPATCH(R, CALL) \
    switch (R) { case 1: CALL(1); break; case 2: CALL(Q8_CAP(2)); break; case 3: CALL(Q8_CAP(3)); break; \
                 case 4: CALL(Q8_CAP(4)); break; case 5: CALL(Q8_CAP(5)); break; case 6: CALL(Q8_CAP(6)); break; \
                 case 7: CALL(Q8_CAP(7)); break; default: CALL(Q8_CAP(8)); break; }

/* The copies one call reads, and the step's new rows (kv_codes.h formats). */
typedef struct {
    int fmt;
    uint8_t *kt, *v;          /* [rows, hkv, d, cap], [rows, hkv, cap, d] */
    float *ks, *vs;           /* int8: [rows, hkv, cap] */
    float kfac, vfac;         /* raw value -> real: fp8's layer scale (times 2^8 for e4m3); 1 for int8 */
    const char *k_pool, *v_pool;  /* the pool's rows of the new tokens (NULL: no append) */
    const int64_t *loc, *pos;
} Q8Cache;

/* The pool row of query row b's new token (KV head h) into mirror (row, head) mh at key pos[b]. */
static void q8_append(const Q8Cache* c, int64_t b, int64_t h, int64_t mh, int64_t hkv, int64_t d, int64_t cap) {
    const int64_t rowb = kv_row_bytes(c->fmt, d), at = c->pos[b];
    const uint8_t* kr = (const uint8_t*)c->k_pool + (c->loc[b] * hkv + h) * rowb;
    const uint8_t* vr = (const uint8_t*)c->v_pool + (c->loc[b] * hkv + h) * rowb;
    uint8_t* kcol = c->kt + mh * d * cap + at;
    for (int64_t i = 0; i < d; ++i) kcol[i * cap] = kr[i];
    memcpy(c->v + (mh * cap + at) * d, vr, (size_t)d);
    if (c->fmt == KV_INT8) {
        memcpy(c->ks + mh * cap + at, kr + d, KV_SCALE_BYTES);
        memcpy(c->vs + mh * cap + at, vr + d, KV_SCALE_BYTES);
    }
}

/* Point the cursor at the key block from j0 (jn keys) of mirror (row, head) mh. */
static inline void q8_ahead_block(Q8Ahead* a, const Q8Cache* c, int64_t mh, int64_t j0, int64_t jn, int64_t d,
                                  int64_t cap, int64_t steps) {
    a->k = a->k_row = (const char*)(c->kt + mh * d * cap + j0);
    a->kstride = cap;
    a->rb = jn;
    a->k_rows_left = d;
    a->v = (const char*)(c->v + (mh * cap + j0) * d);
    a->v_end = a->v + jn * d;
    const int scaled = c->fmt == KV_INT8;
    a->ks = scaled ? (const char*)(c->ks + mh * cap + j0) : 0;
    a->ks_end = scaled ? a->ks + jn * 4 : 0;
    a->vs = scaled ? (const char*)(c->vs + mh * cap + j0) : 0;
    a->vs_end = scaled ? a->vs + jn * 4 : 0;
    const int64_t lines = d * ((jn + 63) / 64 + 1) + (jn * d + 63) / 64 + (scaled ? 2 * ((jn * 4 + 63) / 64) : 0);
    a->rate = steps > 0 ? (lines + steps - 1) / steps : lines;
}

/* One (query row b, KV head h) against mirror (row, head) mh: keys [0, width), R-row chunks of per. */
Q8_INLINE void q8_item(const int FMT, const Q8Cache* c, const float* qf, const float* bp, int64_t mh, int64_t width,
                       int64_t cap, int64_t group, int64_t d, int64_t per, float* acc, float* m, float* l,
                       const float* lut) {
    const uint8_t* ktp = c->kt + mh * d * cap;
    const uint8_t* vp = c->v + mh * cap * d;
    const float* ksp = FMT == KV_INT8 ? c->ks + mh * cap : 0;
    const float* vsp = FMT == KV_INT8 ? c->vs + mh * cap : 0;
    float s[Q8_ROWS * BLOCK];
    const int64_t chunks = (group + per - 1) / per;
    const int64_t steps = chunks * (((BLOCK + AV_W - 1) / AV_W) * d / Q8_NV(per) + BLOCK * ((d + AV_W - 1) / AV_W) / Q8_NV(per));
    Q8Ahead pf = {0};
    for (int64_t j0 = 0; j0 < width; j0 += BLOCK) {
        const int64_t jn = width - j0 < BLOCK ? width - j0 : BLOCK;
        const int64_t next = j0 + Q8_AHEAD * BLOCK;
        if (next < width) q8_ahead_block(&pf, c, mh, next, width - next < BLOCK ? width - next : BLOCK, d, cap, steps);
        for (int64_t g0 = 0; g0 < group; g0 += per) {
            const int64_t r = group - g0 < per ? group - g0 : per;
#define SCORES(RR) q8_scores(RR, FMT, qf + g0 * d, d, ktp + j0, cap, jn, ksp ? ksp + j0 : 0, bp ? bp + j0 : 0, s, BLOCK, lut, &pf)
            Q8_DISPATCH(r, SCORES)
#undef SCORES
            for (int64_t g = 0; g < r; ++g) {
                float* sg = s + g * BLOCK;
                q8_softmax(sg, jn, &m[g0 + g], &l[g0 + g], acc + (g0 + g) * d, d);
                /* the values' factor on the probabilities: each key's scale (int8), the layer's (fp8) */
                if (FMT == KV_INT8)
                    for (int64_t j = 0; j < jn; ++j) sg[j] *= vsp[j0 + j];
                else if (c->vfac != 1.0f)
                    for (int64_t j = 0; j < jn; ++j) sg[j] *= c->vfac;
            }
#define VALUES(RR) q8_values(RR, FMT, s, BLOCK, jn, vp + j0 * d, d, acc + g0 * d, d, lut, &pf)
            Q8_DISPATCH(r, VALUES)
#undef VALUES
        }
    }
}

/* Rows per chunk when `rows` rows are cut into the fewest chunks of at most Q8_ROWS, evenly. */
static inline int64_t q8_chunk_rows(int64_t rows) {
    const int64_t chunks = (rows + Q8_ROWS - 1) / Q8_ROWS;
    return (rows + chunks - 1) / chunks;
}

/* One call's operands (decode_attention_q8's, checked). */
typedef struct {
    const void* q;
    int64_t q_stride;
    int q_bf16;
    const Q8Cache* c;
    const float* bias;
    int64_t cap, width;
    void* out;
    float* lse;
    int64_t n, hkv, group, d, per;
    float scale;
    const float *init_o, *init_lse;
    const int64_t* kv_row;
    const float* lut;
} Q8Run;

/* Work item bh = (query row b, KV head h): its append (without kv_row), its attention, its output. */
Q8_INLINE void q8_one(const int FMT, const Q8Run* r, int64_t bh) {
    const Q8Cache* c = r->c;
    const int64_t hkv = r->hkv, group = r->group, d = r->d, b = bh / hkv, h = bh % hkv;
    const int64_t mh = (r->kv_row ? r->kv_row[b] : b) * hkv + h;  /* the mirror's (row, head) */
    if (c->k_pool && !r->kv_row) q8_append(c, b, h, mh, hkv, d, r->cap);
    float qf[MAX_G * MAX_D], acc[MAX_G * MAX_D];
    float m[MAX_G], l[MAX_G];
    const float qs = r->scale * c->kfac;
    if (r->q_bf16) {
        const uint16_t* qp = (const uint16_t*)r->q + b * r->q_stride + h * group * d;
        for (int64_t i = 0; i < group * d; ++i) qf[i] = bf16_to_f32(qp[i]) * qs;
    } else {
        const float* qp = (const float*)r->q + b * r->q_stride + h * group * d;
        for (int64_t i = 0; i < group * d; ++i) qf[i] = qp[i] * qs;
    }
    for (int64_t g = 0; g < group; ++g) { m[g] = -INFINITY; l[g] = 0.0f; }
    if (r->init_o) {  /* continue a softmax over earlier keys (a shared prefix): its output and lse */
        memcpy(acc, r->init_o + bh * group * d, (size_t)(group * d) * sizeof(float));
        for (int64_t g = 0; g < group; ++g) {
            m[g] = r->init_lse[bh * group + g];
            l[g] = m[g] == -INFINITY ? 0.0f : 1.0f;
        }
    } else {
        memset(acc, 0, (size_t)(group * d) * sizeof(float));
    }
    q8_item(FMT, c, qf, r->bias ? r->bias + b * r->cap : 0, mh, r->width, r->cap, group, d, r->per, acc, m, l, r->lut);
    for (int64_t g = 0; g < group; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        const float* ag = acc + g * d;
        if (r->q_bf16) {
            uint16_t* op = (uint16_t*)r->out + (bh * group + g) * d;
            for (int64_t i = 0; i < d; ++i) op[i] = f32_to_bf16(ag[i] * inv);
        } else {
            float* op = (float*)r->out + (bh * group + g) * d;
            for (int64_t i = 0; i < d; ++i) op[i] = ag[i] * inv;
        }
        if (r->lse) r->lse[bh * group + g] = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
    }
}

/* The parallel loop once per format, so that each loop body is compiled for its format (a format
 * passed into one parallel region would reach its outlined body as a variable). */
#define Q8_RUN(NAME, FMT)                                                        \
    static void NAME(const Q8Run* r) {                                           \
        _Pragma("omp parallel for schedule(static)")                             \
        for (int64_t bh = 0; bh < r->n * r->hkv; ++bh) q8_one(FMT, r, bh);       \
    }
Q8_RUN(q8_run_int8, KV_INT8)
Q8_RUN(q8_run_e4m3, KV_FP8_E4M3)
Q8_RUN(q8_run_e5m2, KV_FP8_E5M2)
#undef Q8_RUN

/* One decode step over a quantized mirror. q [n, hkv, group, d] (bf16 when q_bf16, else fp32; request
 * rows q_stride elements apart) attends to its mirror row's keys: codes kt [kv_rows, hkv, d, cap] and
 * v [kv_rows, hkv, cap, d] of format fmt (kv_codes.h), int8's per-key scales ks / vs [kv_rows, hkv,
 * cap] fp32 (NULL for fp8, whose layer scales are k_scale / v_scale), bias [n, cap] fp32 or NULL
 * (0 / -inf), keys [0, width) read. With k_pool != NULL, first copies each query row's new token from
 * the pool (k_pool / v_pool [pool_slots, hkv, kv_row_bytes(fmt, d)], its row at slot loc[b]: the bytes
 * the pool stored this step) to key pos[b] of its mirror row. init_o / init_lse (fp32 [n, hkv, group,
 * d] / [n, hkv, group]) continue a softmax over earlier keys (prefix_attention_*). kv_row (NULL: row
 * b reads mirror row b) maps query rows to mirror rows in [0, kv_rows): a verify step's tokens share
 * their request's row, every append stored before any row attends. Writes out [n, hkv, group, d] in
 * q's dtype and, when lse != NULL, lse [n, hkv, group] fp32. Returns 0, or -1 (nothing written) when
 * the format, group or d is outside the kernel's bounds, or a slot, position or row outside its range. */
int decode_attention_q8(
    const void* q, int64_t q_stride, int q_bf16, int fmt,
    uint8_t* kt, uint8_t* v, float* ks, float* vs, float k_scale, float v_scale,
    const float* bias, int64_t cap, int64_t width,
    void* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const char* k_pool, const char* v_pool, int64_t pool_slots, const int64_t* loc, const int64_t* pos,
    const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows)
{
    if (fmt < KV_INT8 || fmt > KV_FP8_E5M2 || (fmt == KV_INT8 && (!ks || !vs))) return -1;
    if (group < 1 || group > MAX_G || d < 1 || d > MAX_D || width < 0 || width > cap) return -1;
    if (k_pool)
        for (int64_t b = 0; b < n; ++b)
            if (pos[b] < 0 || pos[b] >= cap || loc[b] < 0 || loc[b] >= pool_slots) return -1;
    if (kv_row)
        for (int64_t b = 0; b < n; ++b)
            if (kv_row[b] < 0 || kv_row[b] >= kv_rows) return -1;
    const float raw = fmt == KV_FP8_E4M3 ? 256.0f : 1.0f;  /* e4m3's widening gives value * 2^-8 */
    const Q8Cache c = {fmt, kt, v, ks, vs, fmt == KV_INT8 ? 1.0f : k_scale * raw, fmt == KV_INT8 ? 1.0f : v_scale * raw,
                       k_pool, v_pool, loc, pos};
    float lut[256];
#if AV_W == 1
    for (int i = 0; i < 256; ++i) lut[i] = q8_raw((uint8_t)i, fmt);
#else
    (void)q8_raw;
    lut[0] = 0.0f;
#endif
    if (k_pool && kv_row) {  /* rows share mirror rows: every new key lands before any row reads them */
#pragma omp parallel for schedule(static)
        for (int64_t bh = 0; bh < n * hkv; ++bh) q8_append(&c, bh / hkv, bh % hkv, kv_row[bh / hkv] * hkv + bh % hkv, hkv, d, cap);
    }
    const Q8Run run = {q, q_stride, q_bf16, &c, bias, cap, width, out, lse, n, hkv, group, d, q8_chunk_rows(group),
                       scale, init_o, init_lse, kv_row, lut};
    if (fmt == KV_INT8) q8_run_int8(&run);
    else if (fmt == KV_FP8_E4M3) q8_run_e4m3(&run);
    else q8_run_e5m2(&run);
    return 0;
}
