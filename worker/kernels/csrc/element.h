/* A kernel's element type (its activations or its KV pool), chosen at build time by
   `build_for`: bfloat16 bits, converted and rounded with bf16_scalars.h (which must come first),
   or float32 where ELEM_F32 is defined (loads, roundings and stores then do nothing). */
#pragma once
#ifdef ELEM_F32
typedef float elem_t;
#define E_LOAD(x) (x)
#define E_ROUND(x) (x)
#define E_STORE(x) (x)
#else
typedef uint16_t elem_t;
#define E_LOAD(x) bf16_to_f32(x)
#define E_ROUND(x) round_bf16(x)
#define E_STORE(x) f32_to_bf16(x)
#endif
