// The experts' outputs of a mixture-of-experts layer, each row weighted by the router and
// added into the row of the token that chose the expert. Grid-stride; any grid size.
#include "common.cuh"

// out[at[j], :] += w[j] * y[j, :] for the `count` rows of y [count, cols]; a row whose at[j]
// is negative is left to another launch. The targets of one launch are distinct (the
// backend puts a repeated target's later rows in later launches), so no two threads write
// one value. The product and the sum are rounded apart, never fused into one FMA, so the
// result has the CPU backend's bits.
extern "C" __global__ void weighted_rows_add(float* out, const float* y, const i64* at,
                                             const float* w, i64 count, i64 cols) {
    FOR_EACH(i, count * cols) {
        const i64 row = at[i / cols];
        if (row >= 0) {
            float* o = &out[row * cols + i % cols];
            *o = __fadd_rn(*o, __fmul_rn(w[i / cols], y[i]));
        }
    }
}
