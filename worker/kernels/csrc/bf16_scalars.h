/* Scalar bfloat16 <-> float32 and exp, for the kernels' sources to start with (plain C that
   the compiler vectorizes in loops). */
#pragma once
#include "exp_reduced.h"

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, NaN kept a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Cephes expf: ~1 ulp. Below -87 it is e^-87 (~1e-38); past ~88.7 (float32's largest) inf. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 89.0f ? 89.0f : x);
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = EXP_REDUCED(r);
    float twice = n > 127.0f ? 1.0f : 0.0f;  /* 2^128 is no float: take 2^127, then double */
    int32_t e = ((int32_t)(n - twice) + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return y * s * (1.0f + twice);
}
