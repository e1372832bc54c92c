/* bf16 CPU kernels: a row softmax (the matmul prefill's scores), silu*mul, RMSNorm, the
 * log-sum-exp merge of two partial attentions, rotary embedding, an fp32 row argmax, the KV pool
 * write and the decode mirror's gather. (Decode attention is attention_bf16.c; a shared prefix's
 * and a causal prefill's, pair_attention.c.) Built by runtime/engine/cpu/kernel_library.py and
 * called through runtime/engine/cpu/kernels.py (which documents the layouts and why each exists). */
#include "common.h"
#include "entry_points.h"

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

/* out [rows, inter] = bf16(bf16(gelu_tanh(gate)) * up), gate_up [rows, 2 * inter] (gate first):
 * torch's bf16 F.gelu(gate, approximate="tanh").mul_(up), gelu_tanh as x * sigmoid(z) (common.h). */
void gelu_tanh_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* g = gate_up + r * 2 * inter;
        const uint16_t* u = g + inter;
        uint16_t* o = out + r * inter;
        int64_t j = 0;
#ifdef __AVX512F__
        for (; j + 16 <= inter; j += 16)  /* the loop below on 16 lanes, the same operations */
            _mm256_storeu_si256((__m256i*)(o + j), gelu_tanh_mul16(load_bf16x16(g + j), load_bf16x16(u + j)));
#endif
        for (; j < inter; ++j) {
            const float x = bf16_to_f32(g[j]);
            const float z = x * (GELU_2K + GELU_2KC * (x * x));
            const float e = fast_exp(-fabsf(z));
            const float sig = (z >= 0.0f ? 1.0f : e) / (1.0f + e);
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
