/* VW, the float32 lanes of the kernels' vectors: 16 where the core has AVX-512 (32 registers of
   16 floats), 8 elsewhere (AVX2: 16 registers of 8), unless the build says (`-DVW=...`: a test
   builds the other width too). */
#pragma once
#ifndef VW
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
#endif
