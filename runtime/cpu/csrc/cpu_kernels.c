/* bf16 CPU kernels: decode attention (one online-softmax pass per (request, KV head),
 * the KV head's query group sharing every key load), a row softmax, silu*mul, RMSNorm, the
 * log-sum-exp merge of two partial attentions, rotary embedding, an fp32 row argmax, the KV pool
 * write, and attention with bf16-pair dot products for a shared prefix and a causal prefill. Built
 * and called by runtime/cpu/kernels.py (which documents the layouts and why each exists). */
#include "common.h"

/* Prefetch cursor over the next (request, KV head)'s keys and values: each step() brings one
 * more cache line toward L2 while this one computes (the kernel is otherwise latency-bound on
 * the cold mirror buffers: memory and compute would not overlap). */
typedef struct {
    const char* k; const char* v;  /* next K^T block, next V block (NULL: nothing to fetch) */
    int64_t k_row_bytes, k_stride, k_lines, v_lines, t;
} Prefetch;

static inline void pf_step(Prefetch* pf) {
    if (!pf->k) return;
    const int64_t per_row = (pf->k_row_bytes + 63) / 64;
    if (pf->t < pf->k_lines) {
        _mm_prefetch(pf->k + (pf->t / per_row) * pf->k_stride + (pf->t % per_row) * 64, _MM_HINT_T1);
    } else if (pf->t < pf->k_lines + pf->v_lines) {
        _mm_prefetch(pf->v + (pf->t - pf->k_lines) * 64, _MM_HINT_T1);
    } else {
        pf->k = 0;
        return;
    }
    pf->t++;
}

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
        for (; j + 16 <= jn; j += 16) {
            __m512 acc[8];
            for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_loadu_ps(s + g * BLOCK + j);
            for (int64_t i = 0; i < d; ++i) {
                pf_step(pf);
                const __m512 k = load_bf16x16(kt + i * cap + j);
                for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * d + i]), k, acc[g]);
            }
            for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(s + g * BLOCK + j, acc[g]);
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
 * lse is not NULL, lse [n, hkv, group] fp32. Returns 0, or -1 when group or d exceed the kernel's
 * bounds (nothing written). */
int decode_attention_bf16(
    const uint16_t* q, int64_t q_stride,
    uint16_t* kt, uint16_t* v, const float* bias, int64_t cap, int64_t width,
    uint16_t* out, float* lse, int64_t n, int64_t hkv, int64_t group, int64_t d, float scale,
    const uint16_t* k_new, int64_t k_new_stride, const uint16_t* v_new, int64_t v_new_stride, const int64_t* pos,
    const float* init_o, const float* init_lse)
{
    if (group > MAX_G || d > MAX_D || group * d > MAX_G * 128) return -1;
    if (k_new) {
        for (int64_t b = 0; b < n; ++b)
            if (pos[b] < 0 || pos[b] >= cap) return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < n * hkv; ++bh) {
        const int64_t b = bh / hkv, h = bh % hkv;
        if (k_new) {
            const uint16_t* kn = k_new + b * k_new_stride + h * d;
            uint16_t* kcol = kt + bh * d * cap + pos[b];
            for (int64_t i = 0; i < d; ++i) kcol[i * cap] = kn[i];
            memcpy(v + (bh * cap + pos[b]) * d, v_new + b * v_new_stride + h * d, (size_t)d * sizeof(uint16_t));
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
        Prefetch pf = {0, 0, width * 2, cap * 2, 0, 0, 0};
        if (bh + 1 < n * hkv) {
            pf.k = (const char*)(kt + (bh + 1) * d * cap);
            pf.v = (const char*)(v + (bh + 1) * cap * d);
            pf.k_lines = d * ((width * 2 + 63) / 64);
            pf.v_lines = (width * d * 2 + 63) / 64;
        }
        if (width > 0)
            attend_segment(qf, kt + bh * d * cap, v + bh * cap * d, bias ? bias + b * cap : 0, cap, width,
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
        for (int64_t j = 0; j < inter; ++j) {
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
        if (residual) {
            uint16_t* res = residual + r * hidden;
            for (int64_t j = 0; j < hidden; ++j) {
                const uint16_t s = f32_to_bf16(bf16_to_f32(res[j]) + bf16_to_f32(xr[j]));
                res[j] = s;
                v[j] = bf16_to_f32(s);
            }
        } else {
            for (int64_t j = 0; j < hidden; ++j) v[j] = bf16_to_f32(xr[j]);
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < hidden; ++j) ss += v[j] * v[j];
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; ++j) o[j] = f32_to_bf16(bf16_to_f32(w[j]) * round_bf16(v[j] * inv));
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
#endif
        for (; at < 0 && j < cols; ++j) {
            const float v = row[j];
            if (nan_seen ? v != v : v == best) at = j;
        }
        out[r] = at < 0 ? 0 : at;
    }
}


/* ---- a shared prefix's attention for every decode query, with bf16-pair dot products ---- */

#define PREFIX_ROWS 16   /* query rows (of one KV head) per work item */
#define PREFIX_KEYS 256  /* keys per online-softmax block */

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
/* 16 probabilities (finite, >= 0) rounded to bf16, nearest-even. */
static inline __m256i probs_to_bf16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16));
#endif
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
}

/* Keys [j0, j0 + jn) (jn a multiple of 16, j0 of PREFIX_KEYS) of the packed kh / vh: row r sees
 * the first valid[r] of them (the rest count as -inf), folded into each row's online softmax. */
static inline void rows_attend(RowBlock* rb, const uint16_t* kh, const uint16_t* vh, int64_t j0, int64_t jn,
                               const int64_t* valid, int64_t d, float scale)
{
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < jn; j += 16) {
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
        for (int r = 0; r < PREFIX_ROWS; ++r) _mm512_storeu_ps(&rb->s[r][j], _mm512_mul_ps(a[r], vscale));
    }
    for (int r = 0; r < PREFIX_ROWS; ++r) {
        /* two passes over the row's scores: the max of its seen keys, then their exponentials
         * (0 for keys it does not see) summed and rounded to bf16 for the value products */
        const float* sr = rb->s[r];
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < jn; j += 16)
            vmx = _mm512_mask_max_ps(vmx, seen_lanes(valid[r] - j), vmx, _mm512_loadu_ps(sr + j));
        const float mx = _mm512_reduce_max_ps(vmx);
        const float m_new = mx > rb->m[r] ? mx : rb->m[r];
        if (m_new == -INFINITY) {  /* nothing seen yet: all probabilities 0 */
            memset(rb->pb[r], 0, (size_t)jn * sizeof(uint16_t));
            continue;
        }
        const float corr = fast_exp(rb->m[r] - m_new);
        const __m512 vm = _mm512_set1_ps(m_new);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < jn; j += 16) {
            const __m512 e = _mm512_maskz_mov_ps(seen_lanes(valid[r] - j),
                                                 fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vm)));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256((__m256i*)&rb->pb[r][j], probs_to_bf16(e));
        }
        if (corr != 1.0f && rb->l[r] != 0.0f) for (int64_t i = 0; i < d; ++i) rb->acc[r][i] *= corr;  /* (0 before any key) */
        rb->l[r] = rb->l[r] * corr + _mm512_reduce_add_ps(vsum);
        rb->m[r] = m_new;
    }
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
#pragma omp parallel for schedule(static)
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
            rows_attend(&rb, kh, vh, j0, jn, valid, d, scale);
        }
        for (int64_t r = 0; r < nr; ++r) {
            const int64_t b = (r0 + r) / group, g = (r0 + r) % group;
            const int64_t row = (b * hkv + h) * group + g;
            lse[row] = rows_result(&rb, (int)r, d, out + row * d);
        }
    }
    return 0;
#else
    (void)q; (void)q_stride; (void)kp; (void)vp; (void)p; (void)p_pad; (void)n; (void)hkv; (void)group; (void)d;
    (void)scale; (void)out; (void)lse;
    return -1;
#endif
}

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
                    rows_attend(rb, kp, vp, j0, jn, valid, d, scale);
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
