// Shared by every kernel file: NVRTC gets one source per file, so the runtime pastes this
// header in where a file says `#include "common.cuh"` (src/runtime/cuda/kernels.rs).
// No CUDA headers: NVRTC then needs no include folder on the machine that runs tpc.
// Guarded: the CPU emulator's fake driver (tests/emulator) includes every kernel file at once.
#ifndef TPC_COMMON_CUH
#define TPC_COMMON_CUH

typedef long long i64;
typedef unsigned long long u64;
// Without <math.h>: the two special values the kernels write.
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fc00000)

// A bfloat16 as its bits (the upper half of an f32), as weights are stored and cuBLAS reads.
typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// Round to nearest, ties to even, as torch and __float2bfloat16_rn do; NaN stays NaN.
__device__ __forceinline__ bf16 f32_to_bf16(float x) {
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((bits >> 16) | 0x0040u);
    }
    return (bf16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// A grid-stride loop: index i takes every value below n, whatever the grid size.
#define FOR_EACH(i, n) \
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Sum of `v` over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int step = 16; step > 0; step >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, step);
    }
    return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the total. `scratch` holds 32 floats of shared memory; the call synchronizes the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) {
        total += scratch[w];  // the same order in every thread: every thread gets the same bits
    }
    return total;
}

// True when `x` is neither NaN nor an infinity.
__device__ __forceinline__ bool is_finite_value(float x) {
    return isfinite(x);
}

#endif  // TPC_COMMON_CUH
