// Normalizations, one block per normalized group of columns; f32 in and out, sums in f32.
#include "common.cuh"

// RMSNorm of each `group` columns: out = w * x / sqrt(mean(x^2) + eps). Grid: one block per
// group (rows * cols / group blocks).
extern "C" __global__ void rms_norm(float* out, const float* x, const float* w, i64 group,
                                    float eps) {
    __shared__ float scratch[32];
    const float* in = x + blockIdx.x * group;
    float* o = out + blockIdx.x * group;
    float sq = 0.0f;
    for (i64 c = threadIdx.x; c < group; c += blockDim.x) {
        sq += in[c] * in[c];
    }
    const float inv = rsqrtf(block_sum(sq, scratch) / (float)group + eps);
    for (i64 c = threadIdx.x; c < group; c += blockDim.x) {
        o[c] = w[c] * (in[c] * inv);
    }
}

// RMSNorm after a residual add, in one pass over memory: residual += x, then out = the
// RMSNorm of the new residual (the pre-norm block's "add, then norm" pair).
extern "C" __global__ void add_rms_norm(float* out, float* residual, const float* x,
                                        const float* w, i64 group, float eps) {
    __shared__ float scratch[32];
    float* res = residual + blockIdx.x * group;
    const float* in = x + blockIdx.x * group;
    float* o = out + blockIdx.x * group;
    float sq = 0.0f;
    for (i64 c = threadIdx.x; c < group; c += blockDim.x) {
        const float v = res[c] + in[c];
        res[c] = v;
        sq += v * v;
    }
    const float inv = rsqrtf(block_sum(sq, scratch) / (float)group + eps);
    for (i64 c = threadIdx.x; c < group; c += blockDim.x) {
        o[c] = w[c] * (res[c] * inv);
    }
}

// LayerNorm of each row of `cols`: out = (x - mean) / sqrt(var + eps) * w + b, the variance
// from a second pass over the centred values (no cancellation). Grid: one block per row.
extern "C" __global__ void layer_norm(float* out, const float* x, const float* w,
                                      const float* b, i64 cols, float eps) {
    __shared__ float scratch[32];
    const float* in = x + blockIdx.x * cols;
    float* o = out + blockIdx.x * cols;
    float sum = 0.0f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        sum += in[c];
    }
    const float mean = block_sum(sum, scratch) / (float)cols;
    float var = 0.0f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = in[c] - mean;
        var += d * d;
    }
    const float inv = rsqrtf(block_sum(var, scratch) / (float)cols + eps);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        o[c] = (in[c] - mean) * inv * w[c] + b[c];
    }
}
