// Products over quantized linear weights kept on the GPU as their checkpoint's codes, in the
// CPU backend's panel layout (src/runtime/cpu/packed/): panel q holds output columns
// 16q .. 16q + 15 over `k` steps.
// - FP8 e4m3 / INT8 codes: a panel is k steps of 16 bytes (step p, column j at p * 16 + j);
//   its scales are [ceil(k / kblock)][16] f32.
// - INT4 codes (GPTQ, AWQ): a panel is k / 4 quads of 32 bytes; in quad t the byte
//   (j % 8) * 4 + p % 4 holds step 4t + p % 4 of column j in its low nibble (j < 8) or high
//   nibble (j >= 8); scales and zero points are [ceil(k / kblock)][16] f32, a value is
//   (code - zero) * scale.
// FP8 prompts on GPUs with FP8 tensor cores (cuBLASLt, block-scaled) take the codes as plain
// rows ([n][k], a weight's inputs contiguous) and the activations quantized to e4m3 in blocks
// of 128 inputs per row (quantize_rows_e4m3), as transformers' and vLLM's FP8 linears do.
// A decode step (at most GEMV_ROWS rows) multiplies the codes in place: one block of
// GEMV_WARPS warps per panel, the warps taking interleaved runs of steps, every lane a 32-bit
// word of codes a load (a warp reads 128 consecutive bytes), the lanes' and warps' sums added
// in a fixed order. Prompts widen the weight to bf16 or f32 rows ([n][k], out-in) for cuBLAS.
#include "common.cuh"

#define PANEL 16
#define GEMV_ROWS 8
#define GEMV_WARPS 8

// The value of an e4m3 code (no NaN codes: the loader refuses 0x7f and 0xff).
__device__ __forceinline__ float e4m3_value(unsigned int b) {
    const unsigned int e = (b >> 3) & 15u;
    const unsigned int m = b & 7u;
    const float mag = e == 0 ? (float)m * 0.001953125f  // m * 2^-9: subnormal
                             : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ float code_value(unsigned int b, int e4m3) {
    return e4m3 ? e4m3_value(b) : (float)(signed char)(unsigned char)b;
}

// The sums of the block's warps for `rows` rows of one panel: `acc[r][c]` is this lane's
// sum for row r, column `cols[c]`; lanes that share columns differ in the lane bits that
// `spread` (a mask of xor steps from 16 down) names. Thread t < rows * 16 then writes
// out[r][16q + j] for the columns below n, the warps added in order.
template <int COLS>
__device__ __forceinline__ void gemv_finish(float acc[GEMV_ROWS][COLS], const int cols[COLS],
                                            int first_step, float* out, i64 rows, i64 n,
                                            i64 q) {
    __shared__ float sums[GEMV_WARPS][GEMV_ROWS][PANEL];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    // Only the rows asked for (the same count in every lane: the shuffles stay whole-warp).
    for (int r = 0; r < GEMV_ROWS && r < rows; ++r) {
        for (int c = 0; c < COLS; ++c) {
            float v = acc[r][c];
            for (int step = 16; step >= first_step; step >>= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, step);
            }
            acc[r][c] = v;
        }
    }
    // Lanes below first_step hold their columns' warp sums.
    if (lane < first_step) {
        for (int r = 0; r < GEMV_ROWS && r < rows; ++r) {
            for (int c = 0; c < COLS; ++c) {
                sums[warp][r][cols[c]] = acc[r][c];
            }
        }
    }
    __syncthreads();
    const int t = threadIdx.x;
    if (t < rows * PANEL) {
        const int r = t / PANEL;
        const int j = t % PANEL;
        float total = 0.0f;
        for (int w = 0; w < GEMV_WARPS; ++w) {
            total += sums[w][r][j];
        }
        if (q * PANEL + j < n) {
            out[r * n + q * PANEL + j] = total;
        }
    }
}

// out[r][j] = sum_p x[r][p] * value(code[p][j]) * scale[p / kblock][j] for r < rows
// (rows <= GEMV_ROWS), j < n. Grid: one block of 32 * GEMV_WARPS threads per panel. A
// warp takes 8 steps a load: lane l the step l / 4, columns 4 (l % 4) .. + 3.
extern "C" __global__ void gemv_codes(float* out, const float* x, const unsigned int* codes,
                                      const float* scales, i64 rows, i64 n, i64 k, i64 kblock,
                                      int e4m3) {
    const i64 q = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const i64 blocks = (k + kblock - 1) / kblock;
    const unsigned int* panel = codes + q * k * (PANEL / 4);
    const float* panel_scales = scales + q * blocks * PANEL;
    const int c0 = (lane & 3) * 4;
    float acc[GEMV_ROWS][4];
    for (int r = 0; r < GEMV_ROWS; ++r) {
        for (int c = 0; c < 4; ++c) {
            acc[r][c] = 0.0f;
        }
    }
    for (i64 p = (i64)warp * 8 + (lane >> 2); p < k; p += GEMV_WARPS * 8) {
        const unsigned int word = panel[p * (PANEL / 4) + (lane & 3)];
        const float* s = panel_scales + (p / kblock) * PANEL + c0;
        float w[4];
        for (int c = 0; c < 4; ++c) {
            w[c] = code_value((word >> (8 * c)) & 0xffu, e4m3) * s[c];
        }
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (r < rows) {
                const float xv = x[r * k + p];
                for (int c = 0; c < 4; ++c) {
                    acc[r][c] += xv * w[c];
                }
            }
        }
    }
    const int cols[4] = {c0, c0 + 1, c0 + 2, c0 + 3};
    gemv_finish<4>(acc, cols, 4, out, rows, n, q);
}

// As gemv_codes for INT4 panels. A warp takes 4 quads (16 steps) a load: lane l the quad
// l / 8, its word l % 8 (4 steps of columns l % 8 and l % 8 + 8).
extern "C" __global__ void gemv_int4(float* out, const float* x, const unsigned int* codes,
                                     const float* scales, const float* zeros, i64 rows, i64 n,
                                     i64 k, i64 kblock) {
    const i64 q = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const i64 blocks = (k + kblock - 1) / kblock;
    const i64 quads = k / 4;
    const unsigned int* panel = codes + q * quads * 8;
    const float* panel_scales = scales + q * blocks * PANEL;
    const float* panel_zeros = zeros + q * blocks * PANEL;
    const int jj = lane & 7;
    float acc[GEMV_ROWS][2];
    for (int r = 0; r < GEMV_ROWS; ++r) {
        acc[r][0] = 0.0f;
        acc[r][1] = 0.0f;
    }
    for (i64 t = (i64)warp * 4 + (lane >> 3); t < quads; t += GEMV_WARPS * 4) {
        const unsigned int word = panel[t * 8 + jj];
        // A group is a whole number of quads: one scale and zero for the quad.
        const i64 b = (4 * t) / kblock;
        const float s0 = panel_scales[b * PANEL + jj];
        const float s1 = panel_scales[b * PANEL + jj + 8];
        const float z0 = panel_zeros[b * PANEL + jj];
        const float z1 = panel_zeros[b * PANEL + jj + 8];
        for (int i = 0; i < 4; ++i) {
            const unsigned int byte = (word >> (8 * i)) & 0xffu;
            const float w0 = ((float)(byte & 15u) - z0) * s0;
            const float w1 = ((float)(byte >> 4) - z1) * s1;
            const i64 p = 4 * t + i;
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r < rows) {
                    const float xv = x[r * k + p];
                    acc[r][0] += xv * w0;
                    acc[r][1] += xv * w1;
                }
            }
        }
    }
    const int cols[2] = {jj, jj + 8};
    gemv_finish<2>(acc, cols, 8, out, rows, n, q);
}

__device__ __forceinline__ float code_weight(const unsigned char* codes, const float* scales,
                                             i64 i, i64 k, i64 kblock, int e4m3) {
    const i64 j = i / k;
    const i64 p = i % k;
    const i64 q = j / PANEL;
    const i64 blocks = (k + kblock - 1) / kblock;
    const unsigned int b = codes[(q * k + p) * PANEL + j % PANEL];
    return code_value(b, e4m3) * scales[(q * blocks + p / kblock) * PANEL + j % PANEL];
}

__device__ __forceinline__ float int4_weight(const unsigned char* codes, const float* scales,
                                             const float* zeros, i64 i, i64 k, i64 kblock) {
    const i64 j = i / k;
    const i64 p = i % k;
    const i64 q = j / PANEL;
    const i64 jj = j % PANEL;
    const i64 blocks = (k + kblock - 1) / kblock;
    const unsigned int byte = codes[q * (k / 2) * PANEL + (p / 4) * 32 + (jj % 8) * 4 + p % 4];
    const unsigned int code = (byte >> (4 * (jj / 8))) & 15u;
    const i64 g = (q * blocks + p / kblock) * PANEL + jj;
    return ((float)code - zeros[g]) * scales[g];
}

// The weight's values as rows: out[j][p] for j < n, p < k (bf16 rounded to nearest even, or
// f32). Grid-stride.
extern "C" __global__ void codes_to_bf16(bf16* out, const unsigned char* codes,
                                         const float* scales, i64 n, i64 k, i64 kblock,
                                         int e4m3) {
    FOR_EACH(i, n * k) { out[i] = f32_to_bf16(code_weight(codes, scales, i, k, kblock, e4m3)); }
}

extern "C" __global__ void codes_to_f32(float* out, const unsigned char* codes,
                                        const float* scales, i64 n, i64 k, i64 kblock,
                                        int e4m3) {
    FOR_EACH(i, n * k) { out[i] = code_weight(codes, scales, i, k, kblock, e4m3); }
}

extern "C" __global__ void int4_to_bf16(bf16* out, const unsigned char* codes,
                                        const float* scales, const float* zeros, i64 n, i64 k,
                                        i64 kblock) {
    FOR_EACH(i, n * k) { out[i] = f32_to_bf16(int4_weight(codes, scales, zeros, i, k, kblock)); }
}

extern "C" __global__ void int4_to_f32(float* out, const unsigned char* codes,
                                       const float* scales, const float* zeros, i64 n, i64 k,
                                       i64 kblock) {
    FOR_EACH(i, n * k) { out[i] = int4_weight(codes, scales, zeros, i, k, kblock); }
}

// Activations in a weight's stored step order (GPTQ act order): out[r][s] = x[r][order[s]],
// zero where order[s] is 0xffffffff (a padding slot). x is [rows][inputs], out [rows][slots].
extern "C" __global__ void permute_steps(float* out, const float* x, const unsigned int* order,
                                         i64 rows, i64 inputs, i64 slots) {
    FOR_EACH(i, rows * slots) {
        const i64 r = i / slots;
        const unsigned int from = order[i % slots];
        out[i] = from == 0xffffffffu ? 0.0f : x[r * inputs + from];
    }
}

// The e4m3 code nearest to v (ties to the even code), saturated to +-448 (0x7e / 0xfe; 0x7f
// would be NaN): normals keep 3 mantissa bits of the f32 by rounding at bit 20, values below
// 2^-6 are multiples of 2^-9 (a code of 8 is 2^-6, the first normal, so rounding up into it
// needs no case of its own). A NaN (from a NaN activation: the block's amax skips it) fails
// both comparisons and ends in the exponent check below, as +-448.
__device__ __forceinline__ unsigned char e4m3_code(float v) {
    const unsigned int sign = (__float_as_uint(v) >> 24) & 0x80u;
    const float a = fabsf(v);
    if (a >= 448.0f) {
        return (unsigned char)(sign | 0x7eu);
    }
    if (a < 0.015625f) {  // 2^-6
        return (unsigned char)(sign | (unsigned int)rintf(a * 512.0f));
    }
    unsigned int u = __float_as_uint(a);
    u += 0x7ffffu + ((u >> 20) & 1u);
    const int e = (int)(u >> 23) - 127;
    const unsigned int m = (u >> 20) & 7u;
    if (e > 8 || (e == 8 && m == 7u)) {  // a NaN; a finite v below 448 never rounds past it
        return (unsigned char)(sign | 0x7eu);
    }
    return (unsigned char)(sign | ((unsigned int)(e + 7) << 3) | m);
}

// Activations x [rows][k] as e4m3 codes [rows_pad][k] and one scale per row per block of 128
// inputs: scale = amax / 448 over the block (1 where the block is all zeros), code =
// e4m3(x / scale). Scales are stored [ceil(k / 128)][rows_pad] (rows contiguous: cuBLASLt's
// VEC128_32F layout for the operand whose other dimension is the rows); rows from `rows` to
// rows_pad (a multiple of 4 that cuBLASLt asks for) get zero codes and scale 1.
// Grid: one warp per (row, block), warps in blocks of any multiple of 32 threads; a lane
// takes 4 consecutive inputs.
extern "C" __global__ void quantize_rows_e4m3(unsigned char* codes, float* scales,
                                              const float* x, i64 rows, i64 rows_pad, i64 k) {
    const i64 blocks = (k + 127) / 128;
    const i64 warp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (warp >= rows_pad * blocks) {
        return;  // the whole warp leaves together: the shuffles below see every lane
    }
    const i64 r = warp / blocks, b = warp % blocks;
    const i64 first = b * 128 + lane * 4;
    float v[4];
    float amax = 0.0f;
    for (int i = 0; i < 4; ++i) {
        const i64 p = first + i;
        v[i] = (r < rows && p < k) ? x[r * k + p] : 0.0f;
        amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int step = 16; step > 0; step >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, step));
    }
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = 0; i < 4; ++i) {
        const i64 p = first + i;
        if (p < k) {
            codes[r * k + p] = e4m3_code(v[i] / scale);
        }
    }
    if (lane == 0) {
        scales[b * rows_pad + r] = scale;
    }
}

// A weight's byte codes (FP8 or INT8 panels) as plain rows: out[j][p] = the code of column j
// at step p, for j < n, p < k. Grid-stride.
extern "C" __global__ void codes_to_rows(unsigned char* out, const unsigned char* codes, i64 n,
                                         i64 k) {
    FOR_EACH(i, n * k) {
        const i64 j = i / k, p = i % k;
        out[i] = codes[((j / PANEL) * k + p) * PANEL + j % PANEL];
    }
}
