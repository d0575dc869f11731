// Vocabulary-parallel embedding lookup: row r of `out` [ids, cols] is row ids[r] - offset of
// this rank's table slice [rows, cols], or zeros when the id is another rank's (the
// all-reduce that follows adds those rows). Grid: one block per id.
#include "common.cuh"

__device__ __forceinline__ i64 local_row(i64 id, i64 offset, i64 rows) {
    return (id >= offset && id - offset < rows) ? id - offset : -1;
}

extern "C" __global__ void embedding_f32(float* out, const float* table, const i64* ids,
                                         i64 rows, i64 cols, i64 offset) {
    const i64 r = blockIdx.x;
    const i64 row = local_row(ids[r], offset, rows);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        out[r * cols + c] = row >= 0 ? table[row * cols + c] : 0.0f;
    }
}

extern "C" __global__ void embedding_bf16(float* out, const bf16* table, const i64* ids,
                                          i64 rows, i64 cols, i64 offset) {
    const i64 r = blockIdx.x;
    const i64 row = local_row(ids[r], offset, rows);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        out[r * cols + c] = row >= 0 ? bf16_to_f32(table[row * cols + c]) : 0.0f;
    }
}
