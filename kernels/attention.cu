// Causal attention of one sequence's new rows over its KV cache, the rows' own keys and
// values already appended. q [batch rows, q_heads * head_dim]; the segment's rows start at
// batch row `q_row0`, and its row i sits at position start + i, seeing cache positions
// 0 ..= start + i. cache_k, cache_v [positions, kv_heads * head_dim]; grouped heads: query
// head h reads kv head h / (q_heads / kv_heads).
//
// Grid: (segment rows, q_heads); block: ATTENTION_WARPS warps. Warp w takes positions w,
// w + ATTENTION_WARPS, ... with an online softmax (running max, running sum, weighted sum of
// values, each lane holding head_dim / 32 of the dims); the warps' partial results are then
// merged. head_dim <= 32 * MAX_DIMS_PER_LANE.
#include "common.cuh"

#define ATTENTION_WARPS 4
#define MAX_DIMS_PER_LANE 8

extern "C" __global__ void attention(float* out, const float* q, const float* cache_k,
                                     const float* cache_v, i64 q_row0, i64 start, i64 q_heads,
                                     i64 kv_heads, i64 head_dim, float scale) {
    __shared__ float part_max[ATTENTION_WARPS];
    __shared__ float part_sum[ATTENTION_WARPS];
    __shared__ float part_acc[ATTENTION_WARPS][32 * MAX_DIMS_PER_LANE];
    const i64 row = q_row0 + blockIdx.x;
    const i64 h = blockIdx.y;
    const i64 kv_head = h / (q_heads / kv_heads);
    const i64 q_cols = q_heads * head_dim;
    const i64 kv_cols = kv_heads * head_dim;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    const float* q_head = q + row * q_cols + h * head_dim;
    float qv[MAX_DIMS_PER_LANE];
    float acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
        const i64 d = lane + 32 * j;
        qv[j] = d < head_dim ? q_head[d] * scale : 0.0f;
        acc[j] = 0.0f;
    }
    float run_max = -INFINITY;
    float run_sum = 0.0f;
    const i64 last = start + blockIdx.x;
    for (i64 p = warp; p <= last; p += ATTENTION_WARPS) {
        const float* k = cache_k + p * kv_cols + kv_head * head_dim;
        const float* v = cache_v + p * kv_cols + kv_head * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
            const i64 d = lane + 32 * j;
            if (d < head_dim) {
                s += qv[j] * k[d];
            }
        }
        s = warp_sum(s);
        const float new_max = fmaxf(run_max, s);
        const float keep = expf(run_max - new_max);  // 0 on the first position
        const float e = expf(s - new_max);
        run_sum = run_sum * keep + e;
#pragma unroll
        for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
            const i64 d = lane + 32 * j;
            if (d < head_dim) {
                acc[j] = acc[j] * keep + e * v[d];
            }
        }
        run_max = new_max;
    }
    if (lane == 0) {
        part_max[warp] = run_max;
        part_sum[warp] = run_sum;
    }
#pragma unroll
    for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
        const i64 d = lane + 32 * j;
        if (d < head_dim) {
            part_acc[warp][d] = acc[j];
        }
    }
    __syncthreads();
    // Warp 0 always saw position 0, so the total weight is positive.
    float max_all = -INFINITY;
    for (int w = 0; w < ATTENTION_WARPS; ++w) {
        if (part_sum[w] > 0.0f) {
            max_all = fmaxf(max_all, part_max[w]);
        }
    }
    float total = 0.0f;
    float weight[ATTENTION_WARPS];
    for (int w = 0; w < ATTENTION_WARPS; ++w) {
        weight[w] = part_sum[w] > 0.0f ? expf(part_max[w] - max_all) : 0.0f;
        total += part_sum[w] * weight[w];
    }
    float* o = out + row * q_cols + h * head_dim;
    for (i64 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < ATTENTION_WARPS; ++w) {
            a += part_acc[w][d] * weight[w];
        }
        o[d] = a / total;
    }
}
