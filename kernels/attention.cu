// Causal attention of one sequence's new rows over its KV cache, the rows' own keys and
// values already written (`kv_write`). q [batch rows, q_heads * head_dim]; the segment's
// rows start at batch row `q_row0`, and its row i sits at position start + i, seeing cache
// positions 0 ..= start + i. cache_k, cache_v are the attention op's paged pool, rows of
// kv_heads * head_dim in blocks of `block_size` rows: position p lives in row
// blocks[p / block_size] * block_size + p % block_size (`kv_row`), `blocks` the sequence's
// block table. Grouped heads: query head h reads kv head h / (q_heads / kv_heads).
// head_dim <= 32 * MAX_DIMS_PER_LANE; each lane of a warp holds head_dim / 32 of a row's
// dims.
//
// Three ways through, chosen by the backend per segment:
// - `attention`: one block per (row, head) over every position it sees (short contexts);
// - `attention_split` then `attention_merge`: a decode step over a long cache, the
//   positions cut into chunks, one block per (row, head, chunk), so a single row still
//   fills the GPU; the chunks' partial softmax sums are merged after;
// - `attention_tiled`: a prompt, TILE_ROWS rows per block sharing each tile of keys and
//   values staged in shared memory, instead of every row reading them from memory.
// All keep an online softmax per row: a running max, the sum of exp(score - max) and the
// values weighted by the same exponentials, rescaled when the max grows.
#include "common.cuh"

#define ATTENTION_WARPS 4
#define MAX_DIMS_PER_LANE 8
#define MAX_HEAD_DIM (32 * MAX_DIMS_PER_LANE)

// The pool row of position p through a block table. Positions and block sizes fit 31 bits
// (the backend checks), so the division is a 32-bit one, not a 64-bit one in software.
__device__ __forceinline__ i64 kv_row(const i64* blocks, i64 block_size, i64 p) {
    const unsigned int bs = (unsigned int)block_size;
    const unsigned int pos = (unsigned int)p;
    const unsigned int b = pos / bs;
    return blocks[b] * block_size + (pos - b * bs);
}

// Writes rows src_row0 .. src_row0 + rows of src [.., cols] at positions start .. of the
// pool `cache` (rows of cols) through the block table: grid-stride over rows * cols.
extern "C" __global__ void kv_write(float* cache, const float* src, const i64* blocks,
                                    i64 block_size, i64 src_row0, i64 start, i64 rows,
                                    i64 cols) {
    FOR_EACH(i, rows * cols) {
        const i64 r = i / cols;
        const i64 c = i - r * cols;
        cache[kv_row(blocks, block_size, start + r) * cols + c] = src[(src_row0 + r) * cols + c];
    }
}

// A block's partial softmax sum over some positions: every thread gets the block's max and
// sum of exponentials (sum 0 when the block saw no position); weight[w] rescales warp w's
// values in `part_acc` to that max.
struct BlockSoftmax {
    float max;
    float sum;
    float weight[ATTENTION_WARPS];
};

// Positions lo .. hi - 1 of one (row, head) for the whole block: warp w takes positions
// lo + w, lo + w + ATTENTION_WARPS, ...; then the warps' partials are combined. On return
// (after a barrier) part_acc[w][d] holds warp w's weighted values.
__device__ BlockSoftmax attend_positions(float (*part_acc)[MAX_HEAD_DIM], const float* q_head,
                                         const float* cache_k, const float* cache_v,
                                         const i64* blocks, i64 block_size, i64 kv_cols,
                                         i64 kv_offset, i64 lo, i64 hi, i64 head_dim,
                                         float scale) {
    __shared__ float part_max[ATTENTION_WARPS];
    __shared__ float part_sum[ATTENTION_WARPS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
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
    for (i64 p = lo + warp; p < hi; p += ATTENTION_WARPS) {
        const i64 row = kv_row(blocks, block_size, p);
        const float* k = cache_k + row * kv_cols + kv_offset;
        const float* v = cache_v + row * kv_cols + kv_offset;
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
    // A warp that saw no position has sum 0 and max -inf: it gets weight 0.
    BlockSoftmax b;
    b.max = -INFINITY;
    for (int w = 0; w < ATTENTION_WARPS; ++w) {
        if (part_sum[w] > 0.0f) {
            b.max = fmaxf(b.max, part_max[w]);
        }
    }
    b.sum = 0.0f;
    for (int w = 0; w < ATTENTION_WARPS; ++w) {
        b.weight[w] = part_sum[w] > 0.0f ? expf(part_max[w] - b.max) : 0.0f;
        b.sum += part_sum[w] * b.weight[w];
    }
    return b;
}

__device__ __forceinline__ float weighted_value(float (*part_acc)[MAX_HEAD_DIM],
                                                const BlockSoftmax& b, i64 d) {
    float a = 0.0f;
    for (int w = 0; w < ATTENTION_WARPS; ++w) {
        a += part_acc[w][d] * b.weight[w];
    }
    return a;
}

// Grid: (segment rows, q_heads); block: 32 * ATTENTION_WARPS threads.
extern "C" __global__ void attention(float* out, const float* q, const float* cache_k,
                                     const float* cache_v, const i64* blocks, i64 block_size,
                                     i64 q_row0, i64 start, i64 q_heads, i64 kv_heads,
                                     i64 head_dim, float scale) {
    __shared__ float part_acc[ATTENTION_WARPS][MAX_HEAD_DIM];
    const i64 row = q_row0 + blockIdx.x;
    const i64 h = blockIdx.y;
    const i64 q_cols = q_heads * head_dim;
    const i64 kv_offset = (h / (q_heads / kv_heads)) * head_dim;
    // Position 0 is always seen, so the sum is positive.
    const BlockSoftmax b =
        attend_positions(part_acc, q + row * q_cols + h * head_dim, cache_k, cache_v, blocks,
                         block_size, kv_heads * head_dim, kv_offset, 0, start + blockIdx.x + 1,
                         head_dim, scale);
    float* o = out + row * q_cols + h * head_dim;
    for (i64 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        o[d] = weighted_value(part_acc, b, d) / b.sum;
    }
}

// One chunk of `chunk` positions per block: grid (segment rows, q_heads, chunks); block
// 32 * ATTENTION_WARPS threads. Chunk c of row i covers positions c * chunk .. up to
// (c + 1) * chunk - 1 and start + i; its partial softmax goes to slot
// (i * q_heads + h) * chunks + c of part_max, part_sum and (head_dim values a slot)
// part_values, the values not yet divided by the sum. A chunk past what the row sees
// writes sum 0.
extern "C" __global__ void attention_split(float* part_max, float* part_sum, float* part_values,
                                           const float* q, const float* cache_k,
                                           const float* cache_v, const i64* blocks,
                                           i64 block_size, i64 q_row0, i64 start,
                                           i64 q_heads, i64 kv_heads, i64 head_dim,
                                           float scale, i64 chunk) {
    __shared__ float part_acc[ATTENTION_WARPS][MAX_HEAD_DIM];
    const i64 i = blockIdx.x;
    const i64 h = blockIdx.y;
    const i64 c = blockIdx.z;
    const i64 q_cols = q_heads * head_dim;
    const i64 kv_offset = (h / (q_heads / kv_heads)) * head_dim;
    const i64 seen = start + i + 1;
    const i64 lo = c * chunk;
    const i64 hi = lo + chunk < seen ? lo + chunk : seen;
    const BlockSoftmax b =
        attend_positions(part_acc, q + (q_row0 + i) * q_cols + h * head_dim, cache_k, cache_v,
                         blocks, block_size, kv_heads * head_dim, kv_offset, lo, hi, head_dim,
                         scale);
    const i64 slot = (i * q_heads + h) * gridDim.z + c;
    float* values = part_values + slot * head_dim;
    for (i64 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        values[d] = weighted_value(part_acc, b, d);
    }
    if (threadIdx.x == 0) {
        part_max[slot] = b.max;
        part_sum[slot] = b.sum;
    }
}

// The chunks of attention_split merged, in chunk order: grid (segment rows, q_heads); any
// block size.
extern "C" __global__ void attention_merge(float* out, const float* part_max,
                                           const float* part_sum, const float* part_values,
                                           i64 q_row0, i64 q_heads, i64 head_dim,
                                           i64 chunks) {
    const i64 i = blockIdx.x;
    const i64 h = blockIdx.y;
    const i64 first = (i * q_heads + h) * chunks;
    float max = -INFINITY;
    for (i64 c = 0; c < chunks; ++c) {
        if (part_sum[first + c] > 0.0f) {
            max = fmaxf(max, part_max[first + c]);
        }
    }
    float total = 0.0f;
    for (i64 c = 0; c < chunks; ++c) {
        const float s = part_sum[first + c];
        total += s > 0.0f ? s * expf(part_max[first + c] - max) : 0.0f;
    }
    float* o = out + (q_row0 + i) * q_heads * head_dim + h * head_dim;
    for (i64 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (i64 c = 0; c < chunks; ++c) {
            const float s = part_sum[first + c];
            if (s > 0.0f) {
                a += part_values[(first + c) * head_dim + d] * expf(part_max[first + c] - max);
            }
        }
        o[d] = a / total;
    }
}

#define TILE_ROWS 16
#define TILE_KEYS 16
#define ROWS_PER_WARP (TILE_ROWS / ATTENTION_WARPS)

// TILE_ROWS rows of a prompt per block: grid (ceil(rows / TILE_ROWS), q_heads); block
// 32 * ATTENTION_WARPS threads, warp w holding rows w * ROWS_PER_WARP .. of the tile. The
// block stages TILE_KEYS positions of keys and values at a time in shared memory (every
// thread loads part, read coalesced) and each warp scores them against its rows; a row
// skips the keys past its own position. rows: the segment's row count.
extern "C" __global__ void attention_tiled(float* out, const float* q, const float* cache_k,
                                           const float* cache_v, const i64* blocks,
                                           i64 block_size, i64 q_row0, i64 rows, i64 start,
                                           i64 q_heads, i64 kv_heads, i64 head_dim,
                                           float scale) {
    __shared__ float tile_k[TILE_KEYS][MAX_HEAD_DIM];
    __shared__ float tile_v[TILE_KEYS][MAX_HEAD_DIM];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const i64 h = blockIdx.y;
    const i64 q_cols = q_heads * head_dim;
    const i64 kv_cols = kv_heads * head_dim;
    const i64 kv_offset = (h / (q_heads / kv_heads)) * head_dim;
    const i64 first = blockIdx.x * (i64)TILE_ROWS + warp * ROWS_PER_WARP;  // warp's first row
    const i64 tile_end = (blockIdx.x + 1) * (i64)TILE_ROWS < rows
                             ? (blockIdx.x + 1) * (i64)TILE_ROWS
                             : rows;
    const i64 end = start + tile_end;  // positions the tile's last row sees

    float qv[ROWS_PER_WARP][MAX_DIMS_PER_LANE];
    float acc[ROWS_PER_WARP][MAX_DIMS_PER_LANE];
    float run_max[ROWS_PER_WARP];
    float run_sum[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const float* q_head = q + (q_row0 + first + r) * q_cols + h * head_dim;
#pragma unroll
        for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
            const i64 d = lane + 32 * j;
            qv[r][j] = first + r < rows && d < head_dim ? q_head[d] * scale : 0.0f;
            acc[r][j] = 0.0f;
        }
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
    }
    for (i64 t0 = 0; t0 < end; t0 += TILE_KEYS) {
        const i64 n = end - t0 < TILE_KEYS ? end - t0 : TILE_KEYS;
        __syncthreads();  // every warp is done with the previous tile
        for (i64 e = threadIdx.x; e < n * head_dim; e += blockDim.x) {
            const i64 j = e / head_dim;
            const i64 d = e - j * head_dim;
            const i64 row = kv_row(blocks, block_size, t0 + j);
            tile_k[j][d] = cache_k[row * kv_cols + kv_offset + d];
            tile_v[j][d] = cache_v[row * kv_cols + kv_offset + d];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            // Keys of this tile row `first + r` sees; the same for every lane of the warp.
            const i64 seen = start + first + r + 1 - t0;
            const int m = first + r >= rows ? 0 : (seen < n ? (int)seen : (int)n);
            if (m <= 0) {
                continue;
            }
            float s[TILE_KEYS];
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < TILE_KEYS; ++j) {
                if (j < m) {
                    float dot = 0.0f;
#pragma unroll
                    for (int x = 0; x < MAX_DIMS_PER_LANE; ++x) {
                        const i64 d = lane + 32 * x;
                        if (d < head_dim) {
                            dot += qv[r][x] * tile_k[j][d];
                        }
                    }
                    s[j] = warp_sum(dot);
                    tile_max = fmaxf(tile_max, s[j]);
                }
            }
            const float new_max = fmaxf(run_max[r], tile_max);
            const float keep = expf(run_max[r] - new_max);  // 0 on the row's first tile
            run_sum[r] *= keep;
#pragma unroll
            for (int x = 0; x < MAX_DIMS_PER_LANE; ++x) {
                acc[r][x] *= keep;
            }
#pragma unroll
            for (int j = 0; j < TILE_KEYS; ++j) {
                if (j < m) {
                    const float e = expf(s[j] - new_max);
                    run_sum[r] += e;
#pragma unroll
                    for (int x = 0; x < MAX_DIMS_PER_LANE; ++x) {
                        const i64 d = lane + 32 * x;
                        if (d < head_dim) {
                            acc[r][x] += e * tile_v[j][d];
                        }
                    }
                }
            }
            run_max[r] = new_max;
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        if (first + r < rows) {
            float* o = out + (q_row0 + first + r) * q_cols + h * head_dim;
#pragma unroll
            for (int j = 0; j < MAX_DIMS_PER_LANE; ++j) {
                const i64 d = lane + 32 * j;
                if (d < head_dim) {
                    o[d] = acc[r][j] / run_sum[r];
                }
            }
        }
    }
}
