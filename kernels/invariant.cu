// Products in the invariant order (`--numerics invariant`; the CPU's twin is
// src/runtime/cpu/packed/invariant.rs, the arithmetic src/runtime/exact.rs). An output's
// bits depend on its row of x and the weights only: not on how many rows ran with it, not
// on the grid, and (with exact blocks) not on how the depth was split over ranks.
//
// The depth is cut into blocks of `block` steps from step 0. Each block's sum is one f32
// chain of fused multiply-adds from zero, step after step, in one thread. Blocks are then
// added in f32 in order (mode 0), or exactly (modes 1, 2): each block sum rounded once to a
// grid of 2^-28 and the grid values added as integers in an f64, which no order changes.
// Mode 1 writes the value, mode 2 its three 19-bit limbs (a rank's partial sum for a
// collective, whose f32 sums over up to 32 ranks stay exact; `decode_limbs` after).
#include "common.cuh"

// A block computes a tile of INV_ROWS rows by INV_COLS columns (a warp per row: decode
// steps of one row waste the fewest threads), its threads staging INV_STEPS steps of x and
// of W in shared memory at a time.
#define INV_ROWS 8
#define INV_COLS 32
#define INV_STEPS 64
#define INV_THREADS (INV_ROWS * INV_COLS)
#define GRID_SCALE 268435456.0           // 2^28
#define GRID_UNIT 3.7252902984619140625e-9  // 2^-28
#define LIMB_UNIT 524288.0               // 2^19
// Adding 1.5 * 2^52 to an f64 below 2^51 rounds it to an integer, to nearest even.
#define ROUND_TO_INTEGER 6755399441055744.0

// A block sum as a count of grid units; NaN past `bound` (exactness would be lost: the run
// stops at its non-finite check instead).
__device__ __forceinline__ double to_units(float v, float bound) {
    const double scaled = __dmul_rn((double)v, GRID_SCALE);
    const double units = __dadd_rn(__dadd_rn(scaled, ROUND_TO_INTEGER), -ROUND_TO_INTEGER);
    return fabsf(v) <= bound ? units : (double)NAN;
}

__device__ __forceinline__ float from_units(double units) {
    return __double2float_rn(__dmul_rn(units, GRID_UNIT));
}

__device__ __forceinline__ float weight_value(const float* w, i64 at) { return w[at]; }
__device__ __forceinline__ float weight_value(const bf16* w, i64 at) {
    return bf16_to_f32(w[at]);
}

// out [m, n * width] = x [m, k] · Wᵀ; W [n, k] (out_in 1) or [k, n] (out_in 0). Grid:
// (column tiles, row tiles), INV_THREADS threads.
template <class W>
__device__ void product_invariant(float* out, const float* x, const W* w, i64 m, i64 k, i64 n,
                                  int out_in, i64 block, int mode, float bound) {
    __shared__ float xs[INV_ROWS][INV_STEPS + 1];
    __shared__ float ws[INV_COLS][INV_STEPS + 1];
    const int t = threadIdx.x;
    const int tr = t / INV_COLS;
    const int tc = t % INV_COLS;
    const i64 row0 = (i64)blockIdx.y * INV_ROWS;
    const i64 col0 = (i64)blockIdx.x * INV_COLS;
    const i64 row = row0 + tr;
    const i64 col = col0 + tc;
    float chain = 0.0f;   // the current block's sum
    float chained = 0.0f; // mode 0: the blocks so far, added in f32
    double units = 0.0;   // modes 1, 2: the blocks so far, in grid units
    i64 left = block;     // steps left in the current block
    bool first = true;
    for (i64 p0 = 0; p0 < k; p0 += INV_STEPS) {
        const i64 steps = k - p0 < INV_STEPS ? k - p0 : INV_STEPS;
        // Stage x's tile by (row, step) and W's by (column, step), both read along memory.
        for (int i = t; i < INV_ROWS * INV_STEPS; i += INV_THREADS) {
            const int r = i / INV_STEPS;
            const int s = i % INV_STEPS;
            xs[r][s] = row0 + r < m && s < steps ? x[(row0 + r) * k + p0 + s] : 0.0f;
        }
        for (int i = t; i < INV_COLS * INV_STEPS; i += INV_THREADS) {
            if (out_in) {
                const int c = i / INV_STEPS;
                const int s = i % INV_STEPS;
                ws[c][s] = col0 + c < n && s < steps ? weight_value(w, (col0 + c) * k + p0 + s) : 0.0f;
            } else {
                const int c = i % INV_COLS;
                const int s = i / INV_COLS;
                ws[c][s] = col0 + c < n && s < steps ? weight_value(w, (p0 + s) * n + col0 + c) : 0.0f;
            }
        }
        __syncthreads();
        // Every thread takes the same steps: the block boundaries are uniform.
        for (int s = 0; s < steps; ++s) {
            chain = fmaf(xs[tr][s], ws[tc][s], chain);
            if (--left == 0) {
                if (mode == 0) {
                    chained = first ? chain : __fadd_rn(chained, chain);
                } else {
                    units = __dadd_rn(units, to_units(chain, bound));
                }
                first = false;
                chain = 0.0f;
                left = block;
            }
        }
        __syncthreads();
    }
    if (left != block) {  // a last, shorter block
        if (mode == 0) {
            chained = first ? chain : __fadd_rn(chained, chain);
        } else {
            units = __dadd_rn(units, to_units(chain, bound));
        }
    }
    if (row >= m || col >= n) {
        return;
    }
    if (mode == 0) {
        out[row * n + col] = chained;
    } else if (mode == 1) {
        out[row * n + col] = from_units(units);
    } else {
        // units = l0 + l1 * 2^19 + l2 * 2^38, 0 <= l0, l1 < 2^19.
        const double high = floor(units / LIMB_UNIT);
        const double top = floor(high / LIMB_UNIT);
        float* o = out + (row * n + col) * 3;
        o[0] = (float)__dadd_rn(units, -__dmul_rn(high, LIMB_UNIT));
        o[1] = (float)__dadd_rn(high, -__dmul_rn(top, LIMB_UNIT));
        o[2] = (float)top;
    }
}

extern "C" __global__ void linear_invariant_f32(float* out, const float* x, const float* w,
                                                i64 m, i64 k, i64 n, int out_in, i64 block,
                                                int mode, float bound) {
    product_invariant(out, x, w, m, k, n, out_in, block, mode, bound);
}

extern "C" __global__ void linear_invariant_bf16(float* out, const float* x, const bf16* w,
                                                 i64 m, i64 k, i64 n, int out_in, i64 block,
                                                 int mode, float bound) {
    product_invariant(out, x, w, m, k, n, out_in, block, mode, bound);
}

// Values from their limbs, each summed over ranks: out [n] from limbs [n * 3].
extern "C" __global__ void decode_limbs(float* out, const float* limbs, i64 n) {
    FOR_EACH(i, n) {
        const float* l = limbs + i * 3;
        const double units =
            __dadd_rn((double)l[0], __dmul_rn(__dadd_rn((double)l[1], __dmul_rn((double)l[2], LIMB_UNIT)), LIMB_UNIT));
        out[i] = from_units(units);
    }
}
