/* The exported linear of the float32-summing kernels (f32_linear.c, quant_linear.c), included
   after their `rows_block` and `#define LINEAR`: the rows cut into blocks, each block over
   gangs of output groups (see few_rows_sums.h for what they define). */
#pragma once
#define BLOCK(N)                                                                   \
    case N:                                                                        \
        if (ng == 1) rows_block(xr, k, w, g, 1, N, 0, bias, dst, o);               \
        else if (wide) rows_block(xr, k, w, g, GANG_OF(N, 1), N, 1, bias, dst, o); \
        else rows_block(xr, k, w, g, GANG_OF(N, 0), N, 0, bias, dst, o);           \
        break;

/* out[rows, o] = x[rows, k] . w^T (+ bias): x float32 row-major, w packed in groups of
   GROUP outputs as the source says (outputs past o are zero), bias float32 [o] or NULL. Up to
   TILE rows are one block; more go in blocks of up to TILE rows or, where the source's WIDE
   is less, of up to WIDE rows (wide blocks), as even as that allows (8 rows at 6: 4 + 4, not
   6 + 2, whose 2-row pass has fewer sums in flight), each block over GANG groups at a time
   (from the cache for the blocks after the first). */
void LINEAR(const float *x, const float *w, const float *bias, float *out, int64_t rows,
            int64_t k, int64_t o) {
    const int wide = WIDE < TILE && rows > TILE;
    int64_t tile = wide ? WIDE : TILE;
    int64_t groups = (o + GROUP - 1) / GROUP, blocks = (rows + tile - 1) / tile;
    for (int64_t gang = 0; gang < groups; gang += GANG) {
        int64_t end = gang + GANG < groups ? gang + GANG : groups;
        for (int64_t blk = 0, r = 0; blk < blocks; blk++) {
            int64_t left = blocks - blk, n = (rows - r + left - 1) / left;
            const float *xr = x + r * k;
            float *dst = out + r * o;
            for (int64_t g = gang; g < end;) {
                int ng = g + GANG_OF(n, wide) <= end ? GANG_OF(n, wide) : 1;
                switch (n) {
                    BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
#if TILE > 6
                    BLOCK(7) BLOCK(8)
#endif
                }
                g += ng;
            }
            r += n;
        }
    }
}
