// Greedy and vocabulary-parallel sampling on the device, so logits stay there.
#include "common.cuh"

// Whether candidate (v, i) beats (best_v, best_i): a real index beats none, then the larger
// value, then the lower index among equal values (torch.argmax keeps the first).
__device__ __forceinline__ bool beats(float v, i64 i, float best_v, i64 best_i) {
    return i >= 0 && (best_i < 0 || v > best_v || (v == best_v && i < best_i));
}

// Per row of x [rows, cols]: the largest of the first `valid` columns as (value, index +
// offset) in out [rows, 2]; (-inf, -1) when valid is 0. With `mark_non_finite`, a row with a
// NaN or an infinity in any column gets (NaN, 0). Grid: one block per row; blockDim a
// multiple of 32.
extern "C" __global__ void argmax_pairs(float* out, const float* x, i64 cols, i64 valid,
                                        i64 offset, int mark_non_finite) {
    __shared__ float warp_v[32];
    __shared__ i64 warp_i[32];
    __shared__ int non_finite;
    const float* row = x + blockIdx.x * cols;
    if (threadIdx.x == 0) {
        non_finite = 0;
    }
    __syncthreads();
    float best_v = -INFINITY;
    i64 best_i = -1;
    int bad = 0;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = row[c];
        bad |= !is_finite_value(v);
        if (c < valid && beats(v, c, best_v, best_i)) {
            best_v = v;
            best_i = c;
        }
    }
    if (bad && mark_non_finite) {
        atomicOr(&non_finite, 1);
    }
    for (int step = 16; step > 0; step >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best_v, step);
        const i64 i = __shfl_xor_sync(0xffffffffu, best_i, step);
        if (beats(v, i, best_v, best_i)) {
            best_v = v;
            best_i = i;
        }
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_v[warp] = best_v;
        warp_i[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            if (beats(warp_v[w], warp_i[w], best_v, best_i)) {
                best_v = warp_v[w];
                best_i = warp_i[w];
            }
        }
        float* o = out + blockIdx.x * 2;
        if (non_finite) {
            o[0] = NAN;
            o[1] = 0.0f;
        } else if (best_i < 0) {
            o[0] = -INFINITY;
            o[1] = -1.0f;
        } else {
            // Exact: vocabularies are below 2^24 (the model validation's limit).
            o[0] = best_v;
            o[1] = (float)(best_i + offset);
        }
    }
}

// pairs: `parts` rank-major [rows, 2] blocks of argmax_pairs over consecutive vocabulary
// slices; per row the best pair (a NaN in any part wins), as out [rows, 2].
extern "C" __global__ void best_of_pairs(float* out, const float* pairs, i64 rows, i64 parts) {
    FOR_EACH(r, rows) {
        float best_v = -INFINITY;
        float best_i = -1.0f;
        for (i64 p = 0; p < parts; ++p) {
            const float v = pairs[(p * rows + r) * 2];
            const float i = pairs[(p * rows + r) * 2 + 1];
            if (isnan(v)) {
                best_v = NAN;
                best_i = 0.0f;
                break;
            }
            // Parts hold increasing vocabulary ranges: the first of equal values stays.
            if (i >= 0.0f && (best_i < 0.0f || v > best_v)) {
                best_v = v;
                best_i = i;
            }
        }
        out[r * 2] = best_v;
        out[r * 2 + 1] = best_i;
    }
}

// The lowest row of x [rows, cols] holding a NaN or an infinity, into *first (which the
// caller sets to the largest u64 first, meaning none).
extern "C" __global__ void first_non_finite_row(u64* first, const float* x, i64 rows, i64 cols) {
    FOR_EACH(i, rows * cols) {
        if (!is_finite_value(x[i])) {
            atomicMin(first, (u64)(i / cols));
        }
    }
}
