/* AMX tiles for the CPU kernels (csrc/ *.c): whether the build has them (AMX_COMPILED), whether
 * they are switched on (tinyserve_amx_on, set by tinyserve_amx() in amx_linear.c once the OS has
 * granted the tile state), and a thread's tile configuration around a parallel region. */
#ifndef TINYSERVE_CPU_AMX_H
#define TINYSERVE_CPU_AMX_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

extern int tinyserve_amx_on;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_COMPILED 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* This thread's tile configuration (tile state is per thread): eight 16 x 64-byte tiles. */
static inline void amx_configure(void)
{
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}
#else
#define AMX_COMPILED 0
#endif

/* Per thread, around a parallel region's work: configure the tiles if AMX is on; returns whether. */
static inline int amx_begin(void)
{
#if AMX_COMPILED
    if (tinyserve_amx_on) { amx_configure(); return 1; }
#endif
    return 0;
}

static inline void amx_end(int used)
{
#if AMX_COMPILED
    if (used) _tile_release();
#else
    (void)used;
#endif
}

#endif
