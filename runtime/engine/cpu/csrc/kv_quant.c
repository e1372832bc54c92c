/* The quantized KV cache's writes: a forward's new K/V rows quantized into their pool slots
 * (store_kv_rows_q, the quantizing twin of store_kv_rows) and the decode mirror's rebuild from
 * quantized pool rows (mirror_gather_q, the twin of mirror_gather): the codes move as they are,
 * never dequantized. The bytes stored are memory/kv_format.py's KVCacheFormat.quantize bit for bit
 * (int8: per (token, head) amax, inv = fp32(1 / amax) * 127 as torch's `127 / tensor` computes it,
 * rint(x * inv) saturated at +-127, scale amax / 127 after the D values; fp8: x / layer scale
 * saturated at the format's largest value, then rounded to nearest even, subnormals included, NaN
 * as torch's cast gives it). Built by runtime/engine/cpu/kernel_library.py, called through
 * runtime/engine/cpu/kv_quant_kernels.py and by decode_layers.c (entry_points.h). */
#include "common.h"
#include "entry_points.h"
#include "kv_codes.h"

/* fp32 -> fp8 bits (man_bits 3 and bias 7: e4m3fn; 2 and 15: e5m2), nearest even. |x| must not
 * exceed the format's largest value (the store saturates first, as the reference clamps); NaN
 * gives sign | 0x7f, torch's code. Integer arithmetic throughout, so denormal modes change nothing. */
static inline uint8_t f32_to_fp8(float x, int man_bits, int bias)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;
    const int shift = 23 - man_bits;
    const int32_t e = (int32_t)(a >> 23);           /* fp32's biased exponent (0: subnormal) */
    if (e >= 128 - bias) {                          /* an fp8 normal: round the mantissa, rebias */
        const uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
        return sign | (uint8_t)((r >> shift) - ((uint32_t)(127 - bias) << man_bits));
    }
    /* an fp8 subnormal: |x| = mant * 2^(e - 150) in units of 2^(1 - bias - man_bits), rounded */
    const uint32_t mant = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
    const int s = 151 - bias - man_bits - (e ? e : 1);  /* > 23 - man_bits */
    if (s > 24) return sign;                        /* under half the smallest subnormal */
    uint32_t q = mant >> s;
    const uint32_t rem = mant & ((1u << s) - 1u), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint8_t)q;
}

/* One (token, head) row of d fp32 values as pool bytes of format fmt (kv_row_bytes(fmt, d)). */
static void quantize_row(const float* x, int64_t d, int fmt, float layer_scale, uint8_t* out)
{
    if (fmt == KV_INT8) {
        float amax = 0.0f;
        for (int64_t i = 0; i < d; ++i) {
            const float a = fabsf(x[i]);
            amax = (a > amax || a != a) ? a : amax;  /* (NaN propagates, as torch's amax) */
        }
        /* (the reciprocal kept apart: the build's -fassociative-math would make 127 / amax of it) */
        float recip = 1.0f / amax;
        __asm__("" : "+x"(recip));
        const float inv = amax > 0.0f ? recip * 127.0f : 0.0f;
        for (int64_t i = 0; i < d; ++i) {
            float q = rintf(x[i] * inv);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            out[i] = q != q ? 0 : (uint8_t)(int8_t)q;
        }
        const float row_scale = amax / 127.0f;
        memcpy(out + d, &row_scale, KV_SCALE_BYTES);
        return;
    }
    const int e4m3 = fmt == KV_FP8_E4M3;
    const float limit = e4m3 ? 448.0f : 57344.0f;
    for (int64_t i = 0; i < d; ++i) {
        float y = x[i] / layer_scale;
        y = y > limit ? limit : (y < -limit ? -limit : y);
        out[i] = f32_to_fp8(y, e4m3 ? 3 : 2, e4m3 ? 7 : 15);
    }
}

/* Token rows of one tensor (k or v) into pool rows: row i (hkv heads of d values, elem 2 = bf16 or
 * 4 = fp32, rows src_stride bytes apart, heads packed) quantized to slot loc[i] of buf. */
static void store_rows(const char* src, int64_t src_stride, int64_t elem, const int64_t* loc, int64_t n,
                       int64_t hkv, int64_t d, int fmt, float layer_scale, char* buf)
{
    const int64_t rowb = kv_row_bytes(fmt, d);
#pragma omp parallel for schedule(static) if (n * hkv >= 512)
    for (int64_t t = 0; t < n * hkv; ++t) {
        const int64_t i = t / hkv, h = t % hkv;
        const char* row = src + i * src_stride + h * d * elem;
        float x[MAX_D];
        if (elem == 2)
            for (int64_t j = 0; j < d; ++j) x[j] = bf16_to_f32(((const uint16_t*)row)[j]);
        else
            memcpy(x, row, (size_t)d * sizeof(float));
        quantize_row(x, d, fmt, layer_scale, (uint8_t*)buf + (loc[i] * hkv + h) * rowb);
    }
}

/* The pool write of a forward's new K and V into a quantized pool: row i of k and v (hkv heads of d
 * values of elem bytes, 2 = bf16 or 4 = fp32; rows k_stride / v_stride bytes apart, heads packed)
 * quantized to format fmt (k_scale / v_scale: fp8's layer scales) at slot loc[i] of k_buf / v_buf
 * ([slots, hkv, kv_row_bytes(fmt, d)] bytes). Returns -1, writing nothing, when a slot is outside
 * [0, slots), the format or element size is not one of these, or d is outside [1, MAX_D]. */
int store_kv_rows_q(const char* k, int64_t k_stride, const char* v, int64_t v_stride, int64_t elem,
                    const int64_t* loc, int64_t n, int64_t hkv, int64_t d, int fmt, float k_scale, float v_scale,
                    char* k_buf, char* v_buf, int64_t slots)
{
    if ((elem != 2 && elem != 4) || fmt < KV_INT8 || fmt > KV_FP8_E5M2 || d < 1 || d > MAX_D) return -1;
    for (int64_t i = 0; i < n; ++i)
        if (loc[i] < 0 || loc[i] >= slots) return -1;
    store_rows(k, k_stride, elem, loc, n, hkv, d, fmt, k_scale, k_buf);
    store_rows(v, v_stride, elem, loc, n, hkv, d, fmt, v_scale, v_buf);
    return 0;
}

/* The decode mirror's rebuild from a quantized pool (runtime/engine/cpu/decode_mirror.py): for
 * request b and KV head h, the pool rows at slots loc[b * w + j], j < w ([slots, hkv, row] bytes of
 * format fmt), give key j's codes in kt [n, hkv, d, cap] (transposed: 16 keys of one dim written
 * together) and v [n, hkv, cap, d], and for int8 the rows' scales in ks / vs [n, hkv, cap] fp32
 * (NULL for fp8, whose scale is the layer's); keys from w on are left as they are. Returns -1,
 * writing nothing, when a slot is outside [0, slots), w > cap or the format is not a quantized one. */
int mirror_gather_q(const char* k_pool, const char* v_pool, int64_t slots, const int64_t* loc, int64_t n, int64_t w,
                    int64_t hkv, int64_t d, int64_t cap, int fmt, uint8_t* kt, uint8_t* v, float* ks, float* vs)
{
    if (fmt < KV_INT8 || fmt > KV_FP8_E5M2 || w > cap || (fmt == KV_INT8 && (!ks || !vs))) return -1;
    for (int64_t i = 0; i < n * w; ++i)
        if (loc[i] < 0 || loc[i] >= slots) return -1;
    const int64_t head = kv_row_bytes(fmt, d), row = hkv * head;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < n * hkv; ++bh) {
        const int64_t b = bh / hkv, h = bh % hkv;
        const int64_t* lb = loc + b * w;
        uint8_t* vb = v + bh * cap * d;
        for (int64_t j = 0; j < w; ++j) {
            const char* src = v_pool + lb[j] * row + h * head;
            memcpy(vb + j * d, src, (size_t)d);
            if (fmt == KV_INT8) memcpy(vs + bh * cap + j, src + d, KV_SCALE_BYTES);
        }
        uint8_t* kb = kt + bh * d * cap;
        for (int64_t j0 = 0; j0 < w; j0 += 16) {
            const int64_t jn = w - j0 < 16 ? w - j0 : 16;
            const uint8_t* src[16];
            for (int64_t jj = 0; jj < jn; ++jj) {
                src[jj] = (const uint8_t*)k_pool + lb[j0 + jj] * row + h * head;
                if (fmt == KV_INT8) memcpy(ks + bh * cap + j0 + jj, src[jj] + d, KV_SCALE_BYTES);
            }
            for (int64_t i = 0; i < d; ++i) {
                uint8_t* dst = kb + i * cap + j0;
                for (int64_t jj = 0; jj < jn; ++jj) dst[jj] = src[jj][i];
            }
        }
    }
    return 0;
}
