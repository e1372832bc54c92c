/* bf16 CPU kernels: decode attention (one online-softmax pass per (request, KV head),
 * the KV head's query group sharing every key load), a row softmax, silu*mul, RMSNorm, the
 * log-sum-exp merge of two partial attentions, rotary embedding, an fp32 row argmax, the KV pool
 * write, and attention with bf16-pair dot products for a shared prefix and a causal prefill. Built
 * and called by runtime/cpu/kernels.py (which documents the layouts and why each exists). */
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

#define MAX_COLS 8192

/* Row softmax of bf16 scores, in place: x [rows, cols] (rows `cols` apart) becomes
 * softmax(scale * x) in bf16, computed in fp32. period > 0 (causal): rows come in blocks of
 * `period` (a request's queries, or a run of them); row r of a block is the query at position
 * first_pos + (r % period) / rows_per_pos and sees keys j <= that position (the rest of the
 * row is written 0). lse (optional, fp32 [rows]) gets each row's log-sum-exp of the scaled
 * scores. Returns 0, or -1 when cols exceeds MAX_COLS (nothing written). */
int softmax_rows_bf16(uint16_t* x, int64_t rows, int64_t cols, float scale, int64_t period, int64_t rows_per_pos,
                      int64_t first_pos, float* lse)
{
    if (cols > MAX_COLS || (period > 0 && rows_per_pos < 1)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* row = x + r * cols;
        int64_t n = period > 0 ? first_pos + (r % period) / rows_per_pos + 1 : cols;
        if (n > cols) n = cols;
        float buf[MAX_COLS];
        for (int64_t j = 0; j < n; ++j) buf[j] = bf16_to_f32(row[j]) * scale;
        const float mx = row_max(buf, n);
        int64_t j;
        for (j = 0; j < n; ++j) buf[j] = fast_exp(buf[j] - mx);
        float sum = 0.0f;
        for (j = 0; j < n; ++j) sum += buf[j];
        const float inv = 1.0f / sum;
        for (j = 0; j < n; ++j) row[j] = f32_to_bf16(buf[j] * inv);
        for (j = n; j < cols; ++j) row[j] = 0;
        if (lse) lse[r] = mx + logf(sum);
    }
    return 0;
}

/* ---- elementwise kernels of the decoder layer (bf16), each rounding where torch's bf16 ops do ---- */


/* out [rows, inter] = bf16(bf16(silu(gate)) * up), gate_up [rows, 2 * inter] (gate first). */
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* g = gate_up + r * 2 * inter;
        const uint16_t* u = g + inter;
        uint16_t* o = out + r * inter;
        int64_t j = 0;
#ifdef __AVX512F__
        for (; j + 16 <= inter; j += 16)  /* the loop below on 16 lanes, the same operations */
            _mm256_storeu_si256((__m256i*)(o + j), silu_mul16(load_bf16x16(g + j), load_bf16x16(u + j)));
#endif
        for (; j < inter; ++j) {
            const float x = bf16_to_f32(g[j]);
            const float e = fast_exp(-fabsf(x));  /* in (0, 1]: no overflow for either sign */
            const float sig = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[j] = f32_to_bf16(round_bf16(x * sig) * bf16_to_f32(u[j]));
        }
    }
}

/* The pool write of a forward's new K and V: row i of k and v (row_bytes each, rows
 * k_stride / v_stride bytes apart) to slot loc[i] of k_buf / v_buf (packed rows of row_bytes).
 * Returns -1, writing nothing, when a slot is outside [0, slots). torch's index_put takes
 * ~200 ns per row here (~3 ms per layer on an 8192-token prefill); this is a memcpy per row. */
int store_kv_rows(const char* k, int64_t k_stride, const char* v, int64_t v_stride, const int64_t* loc,
                  int64_t n, int64_t row_bytes, char* k_buf, char* v_buf, int64_t slots)
{
    for (int64_t i = 0; i < n; ++i)
        if (loc[i] < 0 || loc[i] >= slots) return -1;
#pragma omp parallel for schedule(static) if (n >= 256)
    for (int64_t i = 0; i < n; ++i) {
        memcpy(k_buf + loc[i] * row_bytes, k + i * k_stride, (size_t)row_bytes);
        memcpy(v_buf + loc[i] * row_bytes, v + i * v_stride, (size_t)row_bytes);
    }
    return 0;
}

/* The decode mirror's rebuild (runtime/cpu/decode_mirror.py): for request b and KV head h, the pool
 * rows at slots loc[b * w + j], j < w (rows of hkv * d elements of elem bytes, 2 or 4), go to key j
 * of kt [n, hkv, d, cap] (transposed: 16 keys' values of one dim are written together) and of
 * v [n, hkv, cap, d]; keys from w on are left as they are. Returns -1, writing nothing, when a slot
 * is outside [0, slots), w > cap or elem is neither 2 nor 4. (torch needs an index_select, then a
 * permuted copy into the transposed layout: twice the memory traffic.) */
#define GATHER_T(T)                                                                              \
    do {                                                                                         \
        T* kb = (T*)kt + bh * d * cap;                                                           \
        for (int64_t j0 = 0; j0 < w; j0 += 16) {                                                 \
            const int64_t jn = w - j0 < 16 ? w - j0 : 16;                                        \
            const T* src[16];                                                                    \
            for (int64_t jj = 0; jj < jn; ++jj) src[jj] = (const T*)(k_pool + lb[j0 + jj] * row) + h * d; \
            for (int64_t i = 0; i < d; ++i) {                                                    \
                T* dst = kb + i * cap + j0;                                                      \
                for (int64_t jj = 0; jj < jn; ++jj) dst[jj] = src[jj][i];                        \
            }                                                                                    \
        }                                                                                        \
    } while (0)

int mirror_gather(const char* k_pool, const char* v_pool, int64_t slots, const int64_t* loc, int64_t n, int64_t w,
                  int64_t hkv, int64_t d, int64_t cap, int64_t elem, char* kt, char* v)
{
    if ((elem != 2 && elem != 4) || w > cap) return -1;
    for (int64_t i = 0; i < n * w; ++i)
        if (loc[i] < 0 || loc[i] >= slots) return -1;
    const int64_t row = hkv * d * elem, head = d * elem;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < n * hkv; ++bh) {
        const int64_t b = bh / hkv, h = bh % hkv;
        const int64_t* lb = loc + b * w;
        char* vb = v + bh * cap * head;
        for (int64_t j = 0; j < w; ++j) memcpy(vb + j * head, v_pool + lb[j] * row + h * head, (size_t)head);
        if (elem == 2) GATHER_T(uint16_t);
        else GATHER_T(float);
    }
    return 0;
}
#undef GATHER_T

/* RMSNorm over rows of `hidden`: with residual != NULL, first residual = bf16(residual + x) and
 * the norm reads the sum; out = bf16(w * bf16(v * rsqrt(mean(v^2) + eps))), v in fp32. */
void rmsnorm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, int64_t rows, int64_t hidden,
                  float eps, uint16_t* out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * hidden;
        uint16_t* o = out + r * hidden;
        float v[8192];
        uint16_t* res = residual ? residual + r * hidden : NULL;
        float ss = 0.0f;
        int64_t j = 0;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= hidden; j += 16) {
            __m512 vj = load_bf16x16(xr + j);
            if (res) {
                const __m256i sum = f32x16_to_bf16(_mm512_add_ps(load_bf16x16(res + j), vj));
                _mm256_storeu_si256((__m256i*)(res + j), sum);
                vj = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sum), 16));
            }
            _mm512_storeu_ps(v + j, vj);
            acc = _mm512_fmadd_ps(vj, vj, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; j < hidden; ++j) {
            if (res) res[j] = f32_to_bf16(bf16_to_f32(res[j]) + bf16_to_f32(xr[j]));
            v[j] = bf16_to_f32(res ? res[j] : xr[j]);
            ss += v[j] * v[j];
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        j = 0;
#ifdef __AVX512F__
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; j + 16 <= hidden; j += 16) {
            const __m512 normed = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(v + j), vinv));
            _mm256_storeu_si256((__m256i*)(o + j), f32x16_to_bf16(_mm512_mul_ps(load_bf16x16(w + j), normed)));
        }
#endif
        for (; j < hidden; ++j) o[j] = f32_to_bf16(bf16_to_f32(w[j]) * round_bf16(v[j] * inv));
    }
}

/* Softmax over the union of two key sets, from each set's attention output and log-sum-exp:
 * out[t][a][b][:] = bf16(o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)), lse = logaddexp(lse_a,
 * lse_b), in fp32. o_* are bf16 [T, A, B, D] with element strides (t, a, b) given and unit stride
 * along D; lse_* fp32 [T, A, B] with strides; out is contiguous [T, A, B, D]. Rows where both
 * sets are empty (-inf, -inf) become 0. */
void merge_attn_bf16(int64_t T, int64_t A, int64_t B, int64_t D,
                     const uint16_t* oa, int64_t oa_t, int64_t oa_a, int64_t oa_b,
                     const float* la, int64_t la_t, int64_t la_a, int64_t la_b,
                     const uint16_t* ob, int64_t ob_t, int64_t ob_a, int64_t ob_b,
                     const float* lb, int64_t lb_t, int64_t lb_a, int64_t lb_b,
                     uint16_t* out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < T * A * B; ++r) {
        const int64_t t = r / (A * B), a = (r / B) % A, b = r % B;
        const float xa = la[t * la_t + a * la_a + b * la_b], xb = lb[t * lb_t + a * lb_a + b * lb_b];
        const float mx = xa > xb ? xa : xb;
        float wa = 0.0f, wb = 0.0f;
        if (mx != -INFINITY) {
            const float ea = expf(xa - mx), eb = expf(xb - mx), inv = 1.0f / (ea + eb);
            wa = ea * inv;
            wb = eb * inv;
        }
        const uint16_t* pa = oa + t * oa_t + a * oa_a + b * oa_b;
        const uint16_t* pb = ob + t * ob_t + a * ob_a + b * ob_b;
        uint16_t* po = out + r * D;
        for (int64_t i = 0; i < D; ++i) po[i] = f32_to_bf16(bf16_to_f32(pa[i]) * wa + bf16_to_f32(pb[i]) * wb);
    }
}

/* Rotary embedding (neox halves) in place on bf16 rows: x[t][h][:] for h < heads, rows
 * `row_stride` apart (the q and k heads of a fused qkv output, D apart), the first rot_dim
 * dims rotated by cos/sin [T, rot_dim / 2] (bf16): (x1 c - x2 s, x2 c + x1 s), each product
 * and the sum rounded to bf16, as torch's bf16 ops round. */
void rotary_bf16(uint16_t* x, int64_t T, int64_t row_stride, int64_t heads, int64_t d, int64_t rot_dim,
                 const uint16_t* cos, const uint16_t* sin)
{
    const int64_t half = rot_dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* ct = cos + t * half;
        const uint16_t* st = sin + t * half;
        for (int64_t h = 0; h < heads; ++h) {
            uint16_t* x1 = x + t * row_stride + h * d;
            uint16_t* x2 = x1 + half;
            for (int64_t j = 0; j < half; ++j) {
                const float a = bf16_to_f32(x1[j]), b = bf16_to_f32(x2[j]);
                const float c = bf16_to_f32(ct[j]), s = bf16_to_f32(st[j]);
                x1[j] = f32_to_bf16(round_bf16(a * c) - round_bf16(b * s));
                x2[j] = f32_to_bf16(round_bf16(b * c) + round_bf16(a * s));
            }
        }
    }
}

/* out[r] = index of the largest of x[r][0..cols) (fp32 rows `stride` apart), the first one on
 * ties, or of the first NaN when the row has one (torch.argmax's answer). */
void argmax_rows_f32(const float* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = x + r * stride;
        float best = -INFINITY;
        int nan_seen = 0;
        int64_t j = 0;
#ifdef __AVX512F__
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __mmask16 nan_mask = 0;
        for (; j + 16 <= cols; j += 16) {
            const __m512 v = _mm512_loadu_ps(row + j);
            nan_mask |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vmax = _mm512_max_ps(vmax, v);
        }
        nan_seen = nan_mask != 0;
        best = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__)
        __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
        for (; j + 8 <= cols; j += 8) {
            const __m256 v = _mm256_loadu_ps(row + j);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vmax = _mm256_max_ps(vmax, v);
        }
        nan_seen = _mm256_movemask_ps(vnan) != 0;
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        best = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
        for (; j < cols; ++j) {
            if (row[j] != row[j]) nan_seen = 1;
            else if (row[j] > best) best = row[j];
        }
        int64_t at = -1;
        j = 0;
#ifdef __AVX512F__
        const __m512 vbest = _mm512_set1_ps(best);
        for (; at < 0 && j + 16 <= cols; j += 16) {
            const __m512 v = _mm512_loadu_ps(row + j);
            const __mmask16 hit = nan_seen ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                           : _mm512_cmp_ps_mask(v, vbest, _CMP_EQ_OQ);
            if (hit) at = j + __builtin_ctz((unsigned)hit);
        }
#elif defined(__AVX2__)
        const __m256 vbest = _mm256_set1_ps(best);
        for (; at < 0 && j + 8 <= cols; j += 8) {
            const __m256 v = _mm256_loadu_ps(row + j);
            const int hit = _mm256_movemask_ps(nan_seen ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                        : _mm256_cmp_ps(v, vbest, _CMP_EQ_OQ));
            if (hit) at = j + __builtin_ctz((unsigned)hit);
        }
#endif
        for (; at < 0 && j < cols; ++j) {
            const float v = row[j];
            if (nan_seen ? v != v : v == best) at = j;
        }
        out[r] = at < 0 ? 0 : at;
    }
}
