/* bf16 decode attention over the decode-key mirror: one online-softmax pass per (request, KV head),
 * the KV head's query group sharing every key load, the next item's keys and values prefetched
 * while this one computes, the step's new keys stored first and a shared prefix's result continued
 * (decode_attention_bf16; its fp32 twin is attention_f32.c). Called through
 * runtime/engine/cpu/attention_kernels.py, which documents the layouts and why the kernel exists,
 * and by decode_layers.c (entry_points.h). */
#include "common.h"
#include "entry_points.h"

/* Prefetch cursor over the next (request, KV head)'s keys and values: each step() brings one
 * more cache line toward L2 while this one computes (the kernel is otherwise latency-bound on
 * the cold mirror buffers: memory and compute would not overlap). */
typedef struct {
    const char* k; const char* v;  /* next K^T block, next V block (NULL: nothing to fetch) */
    int64_t k_stride;              /* bytes between K^T rows */
    int64_t row_lines, k_rows;     /* lines per K^T row (the keys read), K^T rows (d) */
    int64_t v_lines;               /* lines of V */
    int64_t row, col, t;           /* the cursor: K^T row and line in it, then V line t */
} Prefetch;

/* (The cursor is counted, not divided: a 64-bit division per line was a large share of the kernel.) */
static inline void pf_line(Prefetch* pf) {
    if (!pf->k) return;
    if (pf->row < pf->k_rows) {
        _mm_prefetch(pf->k + pf->row * pf->k_stride + pf->col * 64, _MM_HINT_T1);
        if (++pf->col == pf->row_lines) { pf->col = 0; pf->row++; }
    } else if (pf->t < pf->v_lines) {
        _mm_prefetch(pf->v + pf->t * 64, _MM_HINT_T1);
        pf->t++;
    } else {
        pf->k = 0;
    }
}

/* Two lines per call: the kernel makes fewer calls than the next item has lines
 * (d + jn per 32 keys, against 2 * d lines of K and V per 32 keys). */
static inline void pf_step(Prefetch* pf) { pf_line(pf); pf_line(pf); }

/* scores s[g][j] (g < group, j < jn) += sum_i qf[g][i] * kt[i][j]; kt rows are `cap` apart. */
static void block_scores(const float* qf, const uint16_t* kt, int64_t cap, int64_t group, int64_t d,
                         int64_t jn, float* s, Prefetch* pf) {
    int64_t j = 0;
#ifdef __AVX512F__
    if (group <= 4) {
        /* two 16-key columns at a time: 2 * group independent FMA chains */
        for (; j + 32 <= jn; j += 32) {
            __m512 a0[4], a1[4];
            for (int64_t g = 0; g < group; ++g) {
                a0[g] = _mm512_loadu_ps(s + g * BLOCK + j);
                a1[g] = _mm512_loadu_ps(s + g * BLOCK + j + 16);
            }
            for (int64_t i = 0; i < d; ++i) {
                pf_step(pf);
                const __m512 k0 = load_bf16x16(kt + i * cap + j), k1 = load_bf16x16(kt + i * cap + j + 16);
                for (int64_t g = 0; g < group; ++g) {
                    const __m512 qb = _mm512_set1_ps(qf[g * d + i]);
                    a0[g] = _mm512_fmadd_ps(qb, k0, a0[g]);
                    a1[g] = _mm512_fmadd_ps(qb, k1, a1[g]);
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                _mm512_storeu_ps(s + g * BLOCK + j, a0[g]);
                _mm512_storeu_ps(s + g * BLOCK + j + 16, a1[g]);
            }
        }
    }
    if (group <= 8) {
        for (; j < jn; j += 16) {  /* the last block masked: a K^T row may end at key jn */
            const __mmask16 lanes = jn - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (jn - j)) - 1);
            __m512 acc[8];
            for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_maskz_loadu_ps(lanes, s + g * BLOCK + j);
            for (int64_t i = 0; i < d; ++i) {
                pf_step(pf);
                const __m512 k = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, kt + i * cap + j)), 16));
                for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * d + i]), k, acc[g]);
            }
            for (int64_t g = 0; g < group; ++g) _mm512_mask_storeu_ps(s + g * BLOCK + j, lanes, acc[g]);
        }
    }
#endif
    for (; j < jn; ++j)
        for (int64_t g = 0; g < group; ++g) {
            float a = s[g * BLOCK + j];
            for (int64_t i = 0; i < d; ++i) a += qf[g * d + i] * bf16_to_f32(kt[i * cap + j]);
            s[g * BLOCK + j] = a;
        }
}

/* acc[g][:] += sum_j p[g][j] * v[j][:] for j < jn; v rows are d apart. */
static void block_values(const float* s, const uint16_t* v, int64_t group, int64_t d, int64_t jn, float* acc,
                         Prefetch* pf) {
    int64_t i0 = 0;
#ifdef __AVX512F__
    if (group <= 4) {
        for (; i0 + 64 <= d; i0 += 64) {
            __m512 a[4][4];
            for (int64_t g = 0; g < group; ++g)
                for (int u = 0; u < 4; ++u) a[g][u] = _mm512_loadu_ps(acc + g * d + i0 + 16 * u);
            for (int64_t j = 0; j < jn; ++j) {
                pf_step(pf);
                const uint16_t* vr = v + j * d + i0;
                const __m512 v0 = load_bf16x16(vr), v1 = load_bf16x16(vr + 16);
                const __m512 v2 = load_bf16x16(vr + 32), v3 = load_bf16x16(vr + 48);
                for (int64_t g = 0; g < group; ++g) {
                    const __m512 p = _mm512_set1_ps(s[g * BLOCK + j]);
                    a[g][0] = _mm512_fmadd_ps(p, v0, a[g][0]);
                    a[g][1] = _mm512_fmadd_ps(p, v1, a[g][1]);
                    a[g][2] = _mm512_fmadd_ps(p, v2, a[g][2]);
                    a[g][3] = _mm512_fmadd_ps(p, v3, a[g][3]);
                }
            }
            for (int64_t g = 0; g < group; ++g)
                for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc + g * d + i0 + 16 * u, a[g][u]);
        }
    } else {
        for (; i0 + 64 <= d; i0 += 64)
            for (int64_t g = 0; g < group; ++g) {
                float* ag = acc + g * d + i0;
                __m512 a0 = _mm512_loadu_ps(ag), a1 = _mm512_loadu_ps(ag + 16);
                __m512 a2 = _mm512_loadu_ps(ag + 32), a3 = _mm512_loadu_ps(ag + 48);
                const float* sg = s + g * BLOCK;
                for (int64_t j = 0; j < jn; ++j) {
                    const uint16_t* vr = v + j * d + i0;
                    const __m512 p = _mm512_set1_ps(sg[j]);
                    a0 = _mm512_fmadd_ps(p, load_bf16x16(vr), a0);
                    a1 = _mm512_fmadd_ps(p, load_bf16x16(vr + 16), a1);
                    a2 = _mm512_fmadd_ps(p, load_bf16x16(vr + 32), a2);
                    a3 = _mm512_fmadd_ps(p, load_bf16x16(vr + 48), a3);
                }
                _mm512_storeu_ps(ag, a0); _mm512_storeu_ps(ag + 16, a1);
                _mm512_storeu_ps(ag + 32, a2); _mm512_storeu_ps(ag + 48, a3);
            }
    }
#endif
    for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < jn; ++j) {
            const float p = s[g * BLOCK + j];
            for (int64_t i = i0; i < d; ++i) acc[g * d + i] += p * bf16_to_f32(v[j * d + i]);
        }
}

/* Keys [0, width) of one (request, KV head) into its online-softmax state: m, l per query,
 * acc [group, d]. */
static void attend_segment(const float* qf, const uint16_t* ktp, const uint16_t* vp, const float* bp,
                           int64_t cap, int64_t width, int64_t group, int64_t d,
                           float* s, float* m, float* l, float* acc, Prefetch* pf) {
    for (int64_t j0 = 0; j0 < width; j0 += BLOCK) {
        const int64_t jn = width - j0 < BLOCK ? width - j0 : BLOCK;
        for (int64_t g = 0; g < group; ++g)
            for (int64_t j = 0; j < jn; ++j) s[g * BLOCK + j] = bp ? bp[j0 + j] : 0.0f;
        block_scores(qf, ktp + j0, cap, group, d, jn, s, pf);
        for (int64_t g = 0; g < group; ++g) {
            float* sg = s + g * BLOCK;
            const float mx = row_max(sg, jn);
            const float m_new = mx > m[g] ? mx : m[g];
            if (m_new == -INFINITY) { for (int64_t j = 0; j < jn; ++j) sg[j] = 0.0f; continue; }
            const float corr = fast_exp(m[g] - m_new);
            for (int64_t j = 0; j < jn; ++j) sg[j] = fast_exp(sg[j] - m_new);
            float sum = 0.0f;
            for (int64_t j = 0; j < jn; ++j) sum += sg[j];
            l[g] = l[g] * corr + sum;
            m[g] = m_new;
            if (corr != 1.0f) for (int64_t i = 0; i < d; ++i) acc[g * d + i] *= corr;
        }
        block_values(s, vp + j0 * d, group, d, jn, acc, pf);
    }
}

/* One decode step: q [n, hkv, group, d] (request rows q_stride apart) attends to its own keys
 * kt [n, hkv, d, cap], v [n, hkv, cap, d], bias [n, cap] fp32 or NULL (0 / -inf), keys [0, width)
 * read. With k_new != NULL, first stores each request's new key and value (k_new, v_new
 * [n, hkv, d], request rows *_stride apart) at key index pos[b] of kt and v: the mirror's append,
 * done here while the lines are brought in anyway. With init_o != NULL the softmax continues from
 * an attention over earlier keys (fp32 output init_o [n, hkv, group, d] and log-sum-exp init_lse
 * [n, hkv, group], from prefix_attention_bf16), so the result covers both. Writes out [n, hkv, group, d] bf16 and, when
 * lse is not NULL, lse [n, hkv, group] fp32. kv_row (NULL: query row b reads mirror row b) maps
 * query rows to mirror rows in [0, kv_rows), as decode_attention_f32's does (a verify step's
 * tokens share their request's row; appends are all stored first). Returns 0, or -1 when group or
 * d exceed the kernel's bounds or a position or row is out of range (nothing written). */
int decode_attention_bf16(
    const uint16_t* q, int64_t q_stride,
    uint16_t* kt, uint16_t* v, const float* bias, int64_t cap, int64_t width,
    uint16_t* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const uint16_t* k_new, int64_t k_new_stride, const uint16_t* v_new, int64_t v_new_stride, const int64_t* pos,
    const float* init_o, const float* init_lse, const int64_t* kv_row, int64_t kv_rows)
{
    if (group > MAX_G || d > MAX_D || group * d > MAX_G * 128) return -1;
    if (k_new) {
        for (int64_t b = 0; b < n; ++b)
            if (pos[b] < 0 || pos[b] >= cap) return -1;
    }
    if (kv_row)
        for (int64_t b = 0; b < n; ++b)
            if (kv_row[b] < 0 || kv_row[b] >= kv_rows) return -1;
    if (k_new && kv_row) {  /* rows share mirror rows: every new key lands before any row reads them */
#pragma omp parallel for schedule(static)
        for (int64_t bh = 0; bh < n * hkv; ++bh) {
            const int64_t b = bh / hkv, h = bh % hkv, mh = kv_row[b] * hkv + h;
            const uint16_t* kn = k_new + b * k_new_stride + h * d;
            uint16_t* kcol = kt + mh * d * cap + pos[b];
            for (int64_t i = 0; i < d; ++i) kcol[i * cap] = kn[i];
            memcpy(v + (mh * cap + pos[b]) * d, v_new + b * v_new_stride + h * d, (size_t)d * sizeof(uint16_t));
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < n * hkv; ++bh) {
        const int64_t b = bh / hkv, h = bh % hkv;
        const int64_t mh = (kv_row ? kv_row[b] : b) * hkv + h;  /* the mirror's (row, head) */
        if (k_new && !kv_row) {
            const uint16_t* kn = k_new + b * k_new_stride + h * d;
            uint16_t* kcol = kt + mh * d * cap + pos[b];
            for (int64_t i = 0; i < d; ++i) kcol[i * cap] = kn[i];
            memcpy(v + (mh * cap + pos[b]) * d, v_new + b * v_new_stride + h * d, (size_t)d * sizeof(uint16_t));
        }
        const uint16_t* qp = q + b * q_stride + h * group * d;
        float qf[MAX_G * 128], acc[MAX_G * 128], s[MAX_G * BLOCK];
        float m[MAX_G], l[MAX_G];
        for (int64_t i = 0; i < group * d; ++i) { qf[i] = bf16_to_f32(qp[i]) * scale; acc[i] = 0.0f; }
        for (int64_t g = 0; g < group; ++g) { m[g] = -INFINITY; l[g] = 0.0f; }
        if (init_o) {  /* continue a softmax over earlier keys (a shared prefix): its output and lse */
            for (int64_t i = 0; i < group * d; ++i) acc[i] = init_o[bh * group * d + i];
            for (int64_t g = 0; g < group; ++g) {
                m[g] = init_lse[bh * group + g];
                l[g] = m[g] == -INFINITY ? 0.0f : 1.0f;
            }
        }
        Prefetch pf = {0, 0, cap * 2, (width * 2 + 63) / 64, d, (width * d * 2 + 63) / 64, 0, 0, 0};
        if (bh + 1 < n * hkv) {
            const int64_t next = (kv_row ? kv_row[(bh + 1) / hkv] : (bh + 1) / hkv) * hkv + (bh + 1) % hkv;
            pf.k = (const char*)(kt + next * d * cap);
            pf.v = (const char*)(v + next * cap * d);
        }
        if (width > 0)
            attend_segment(qf, kt + mh * d * cap, v + mh * cap * d, bias ? bias + b * cap : 0, cap, width,
                           group, d, s, m, l, acc, &pf);
        uint16_t* op = out + bh * group * d;
        for (int64_t g = 0; g < group; ++g) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int64_t i = 0; i < d; ++i) op[g * d + i] = f32_to_bf16(acc[g * d + i] * inv);
            if (lse) lse[bh * group + g] = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
        }
    }
    return 0;
}
