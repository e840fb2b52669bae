"""C sources built at first use into shared libraries for this CPU, cached on disk, loaded with
ctypes (which releases the GIL during a call).

A source is compiled with the system C compiler (`$CC`, default `cc`; `-march=native`, about a
second) into `kernels/` of the model cache (`$RADIXRAY_CACHE`, default ~/.cache/radixray/models),
keyed by source, flags and the CPU's instruction set: a cache directory shared between nodes
must not hand one CPU's build to another (an instruction the other lacks would kill the
process). `build` returns None when there is no compiler or the build fails; each kernel's
caller then keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from worker.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

# Reassociation (to vectorize the sums and maxima), but not -ffast-math: with GCC < 13 a shared
# library built with it sets flush-to-zero for the whole process when it is loaded.
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
    "-fassociative-math", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11",
)  # fmt: skip
# On x86, loops the compiler vectorizes take 512-bit vectors where the core has AVX-512 (GCC
# prefers 256 on Intel cores): on a Xeon VM with AMX, SwiGLU's loop over a 566-token chunk
# took 0.71x the time and RMSNorm's 0.73x, the same bits. Without AVX-512 it changes nothing.
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS += ("-mprefer-vector-width=512",)

# e^r for |r| <= ln 2 / 2, Cephes expf's polynomial, on a float or on a vector of floats (GCC's
# vector types take the same arithmetic): the one polynomial of `exp_f32` and the vector exps.
EXP_REDUCED = r"""
#ifndef EXP_REDUCED
#define EXP_REDUCED(r)                                                                      \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r)       \
         + 4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) \
     + (r) + 1.0f)
#endif
"""

# AMX's tile state, for kernel sources that multiply in tiles (after `#define _DEFAULT_SOURCE`,
# for syscall()): whether Linux grants this process the tiles (it does only when asked), and a
# configuration of tiles 0..n-1 as 16 rows of 64 bytes (per thread; set per call, released
# with `_tile_release`). Empty where the compiler builds no AMX.
AMX_TILES = r"""
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
"""

# Scalar bfloat16 <-> float32 and exp, for the kernels' sources to start with (plain C that
# the compiler vectorizes in loops).
BF16_SCALARS = EXP_REDUCED + r"""
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
"""

# A kernel's element type (its activations or its KV pool), chosen at build time by
# `build_for`: bfloat16 bits, converted and rounded with BF16_SCALARS (which must come first),
# or float32 where ELEM_F32 is defined (loads, roundings and stores then do nothing).
ELEMENT = r"""
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
"""

# the element dtypes `build_for` builds a source for, and the suffix of each one's library name
ELEMENT_DTYPES = {torch.bfloat16: "", torch.float32: "_f32"}


# float32 vectors of VW lanes on GCC's (and clang's) vector types, for any CPU: VW is 16 where
# the core has AVX-512 (32 registers of 16 floats) and 8 elsewhere (AVX2: 16 registers of 8), so
# that a kernel's register tiles fit; a test builds the other width too (`-DVW=...`). With a
# VW x VW transpose in registers (`transpose`), the sums of VW rows at once (`row_sums`), and
# e^x on VW lanes for the softmaxes (`exp_v`).
FLOAT_VECTORS = EXP_REDUCED + r"""
#include <stdint.h>
#ifndef VW
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
#endif
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
"""


# The same exp on 16 floats at once, where the CPU has AVX-512 (`exp16`).
AVX512_EXP = r"""
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x on 16 floats (the polynomial of exp_f32, 2^n by scalef; below -87 it is e^-87). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#endif
"""


def compiler() -> str | None:
    """The system C compiler's path (`$CC`, default `cc`), or None."""
    return shutil.which(os.environ.get("CC", "cc"))


def build_for(name: str, source: str, dtype: torch.dtype) -> ctypes.CDLL | None:
    """`build` of a source written over `ELEMENT` for elements of `dtype` (one of
    `ELEMENT_DTYPES`), as a library of its own."""
    prefix = "#define ELEM_F32 1\n" if dtype == torch.float32 else ""
    return build(name + ELEMENT_DTYPES[dtype], prefix + source)


def build(name: str, source: str) -> ctypes.CDLL | None:
    """The library of `source` (built now unless a build for this CPU is cached), or None
    (logged) when it cannot be built here."""
    cc = compiler()
    if cc is None:
        logger.info("no C compiler: the CPU kernel %s is off (torch path)", name)
        return None
    key = hashlib.sha256((source + " ".join(FLAGS) + _cpu()).encode()).hexdigest()
    directory = cache_root() / "kernels"
    library = directory / f"{name}_{key[:16]}.so"
    try:
        if not library.exists():
            _compile(cc, name, source, directory, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernel %s unavailable, using the torch path: %s", name, e)
        return None


def _cpu() -> str:
    """The machine and its instruction-set flags (what `-march=native` builds for)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + " " + (flags or platform.processor())


def _compile(compiler: str, name: str, source: str, directory: Path, library: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / f"{name}.c"
        path.write_text(source)
        built = Path(tmp) / library.name
        subprocess.run(
            [compiler, *FLAGS, str(path), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, library)  # atomic: concurrent builders never load a partial file
