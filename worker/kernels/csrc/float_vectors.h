/* float32 vectors of VW lanes on GCC's (and clang's) vector types, for any CPU: VW is 16 where
   the core has AVX-512 (32 registers of 16 floats) and 8 elsewhere (AVX2: 16 registers of 8), so
   that a kernel's register tiles fit; a test builds the other width too (`-DVW=...`). With a
   VW x VW transpose in registers (`transpose`), the sums of VW rows at once (`row_sums`), and
   e^x on VW lanes for the softmaxes (`exp_v`). */
#pragma once
#include "exp_reduced.h"

#include <stdint.h>
#include "vector_width.h"
typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4)));  /* any float address */
typedef int32_t vi __attribute__((vector_size(4 * VW)));

#ifdef __clang__
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* Lanes of two vectors a, b (b's numbered from VW) for a block width B: LO<B> takes lane l of
   a where bit B of l is clear and lane l - B of b where it is set; HI<B> lane l + B of a and
   lane l of b. */
#if VW == 16
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#else
#define LO4 0, 1, 2, 3, 8, 9, 10, 11
#define HI4 4, 5, 6, 7, 12, 13, 14, 15
#define LO2 0, 1, 8, 9, 4, 5, 12, 13
#define HI2 2, 3, 10, 11, 6, 7, 14, 15
#define LO1 0, 8, 2, 10, 4, 12, 6, 14
#define HI1 1, 9, 3, 11, 5, 13, 7, 15
#endif

/* Rows r[i] and r[i + B] (i with bit B clear) swap their off-diagonal B-wide blocks. */
#define SWAP_BLOCKS(r, B, LO, HI)                      \
    for (int i = 0; i < VW; i++)                       \
        if (!(i & B)) {                                \
            vf a = r[i], b = r[i + B];                 \
            r[i] = SHUFFLE(a, b, LO);                  \
            r[i + B] = SHUFFLE(a, b, HI);              \
        }

/* Rows r[i] (i < B) become the sums of r[i] and r[i + B] folded by B lanes: lanes with bit B
   clear hold r[i]'s pairs of lanes B apart, the others r[i + B]'s. */
#define FOLD(r, B, LO, HI)                             \
    for (int i = 0; i < B; i++) {                      \
        vf a = r[i], b = r[i + B];                     \
        r[i] = SHUFFLE(a, b, LO) + SHUFFLE(a, b, HI);  \
    }

/* r [VW rows of VW] transposed in place. */
static inline void transpose(vf *r) {
#if VW == 16
    SWAP_BLOCKS(r, 8, LO8, HI8)
#endif
    SWAP_BLOCKS(r, 4, LO4, HI4)
    SWAP_BLOCKS(r, 2, LO2, HI2)
    SWAP_BLOCKS(r, 1, LO1, HI1)
}

/* The sum of each of the VW rows r (overwritten): lane j of the result is row j's. */
static inline vf row_sums(vf *r) {
#if VW == 16
    FOLD(r, 8, LO8, HI8)
#endif
    FOLD(r, 4, LO4, HI4)
    FOLD(r, 2, LO2, HI2)
    FOLD(r, 1, LO1, HI1)
    return r[0];
}

static inline vf splat(float x) { return (vf){0} + x; }

/* Lane l: a where mask m is set, else b (not `select`: POSIX has one). */
static inline vf blend(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* e^x on VW lanes as exp_f32 (`EXP_REDUCED`) for x <= 0 (a score less its row's max): below
   -87 it is e^-87. n = x / ln 2 rounded is read from the bits of x / ln 2 + 1.5 * 2^23 (the
   flags allow reassociation, so not as that sum less 1.5 * 2^23), and 2^n built in exponent
   bits. */
static inline vf exp_v(vf x) {
    x = blend(x < splat(-87.0f), splat(-87.0f), x);
    const vf magic = splat(12582912.0f);
    vf t = x * 1.44269504088896341f + magic;
    vi ni = (vi)t - (vi)magic;
    vf n = __builtin_convertvector(ni, vf);
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    return EXP_REDUCED(r) * (vf)((ni + 127) << 23);
}
