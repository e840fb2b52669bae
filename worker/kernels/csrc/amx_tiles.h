/* AMX's tile state, for kernel sources that multiply in tiles (after `#define _DEFAULT_SOURCE`,
   for syscall()): whether Linux grants this process the tiles (it does only when asked), and a
   configuration of tiles 0..n-1 as 16 rows of 64 bytes (per thread; set per call, released
   with `_tile_release`). Empty where the compiler builds no AMX. */
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) TileConfig;

static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

static void amx_configure(int n) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < n; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
#endif
