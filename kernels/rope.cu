// Rotary position embedding, rotate-half form, in place. Row r of `x` [rows, heads *
// head_dim] uses row r of the tables [rows, half]: cos and sin of position * frequency,
// computed on the host (partial rotary: half < head_dim / 2 leaves the tail of each head
// as it is; llama3 and linear scaling are in the frequencies). Grid: (rows, heads).
#include "common.cuh"

extern "C" __global__ void rope(float* x, const float* cos_table, const float* sin_table,
                                i64 cols, i64 head_dim, i64 half) {
    const i64 r = blockIdx.x;
    float* head = x + r * cols + blockIdx.y * head_dim;
    const float* cs = cos_table + r * half;
    const float* sn = sin_table + r * half;
    for (i64 i = threadIdx.x; i < half; i += blockDim.x) {
        const float a = head[i];
        const float b = head[i + half];
        head[i] = a * cs[i] - b * sn[i];
        head[i + half] = b * cs[i] + a * sn[i];
    }
}
