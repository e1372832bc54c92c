/* The quantized KV cache's element formats as the C kernels name them (memory/kv_format.py is the
 * reference): the pool's rows, the decode mirror's copies and the attention kernel that reads them
 * agree on these codes. */
#ifndef TINYSERVE_CPU_KV_CODES_H
#define TINYSERVE_CPU_KV_CODES_H

enum {
    KV_PLAIN = 0,     /* the model's dtype: not quantized */
    KV_INT8 = 1,      /* D int8 values, then the row's fp32 scale (4 bytes): a row of D + 4 bytes */
    KV_FP8_E4M3 = 2,  /* D bytes of float8_e4m3fn bits of x / layer scale */
    KV_FP8_E5M2 = 3,  /* D bytes of float8_e5m2 bits of x / layer scale */
};
#define KV_SCALE_BYTES 4

/* Bytes of one (token, KV head) row of the pool in format fmt. */
static inline int64_t kv_row_bytes(int fmt, int64_t d) { return fmt == KV_INT8 ? d + KV_SCALE_BYTES : d; }

#endif
