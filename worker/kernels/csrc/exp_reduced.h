/* e^r for |r| <= ln 2 / 2, Cephes expf's polynomial, on a float or on a vector of floats (GCC's
   vector types take the same arithmetic): the one polynomial of `exp_f32` and the vector exps. */
#pragma once
#ifndef EXP_REDUCED
#define EXP_REDUCED(r)                                                                      \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r)       \
         + 4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) \
     + (r) + 1.0f)
#endif
