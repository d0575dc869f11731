// Elementwise kernels over `n` f32 values, in place; grid-stride loops, any grid size.
#include "common.cuh"

// x[r, c] += bias[c] for a bias of `cols` values.
extern "C" __global__ void bias_add(float* x, const float* bias, i64 n, i64 cols) {
    FOR_EACH(i, n) { x[i] += bias[i % cols]; }
}

extern "C" __global__ void add(float* x, const float* y, i64 n) {
    FOR_EACH(i, n) { x[i] += y[i]; }
}

extern "C" __global__ void mul(float* x, const float* y, i64 n) {
    FOR_EACH(i, n) { x[i] *= y[i]; }
}

extern "C" __global__ void silu(float* x, i64 n) {
    FOR_EACH(i, n) {
        const float v = x[i];
        x[i] = v / (1.0f + expf(-v));
    }
}

// GeLU with the tanh approximation (gelu_new, gelu_pytorch_tanh).
extern "C" __global__ void gelu_tanh(float* x, i64 n) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    FOR_EACH(i, n) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
    }
}

// Exact GeLU, with erf.
extern "C" __global__ void gelu_erf(float* x, i64 n) {
    FOR_EACH(i, n) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    }
}

extern "C" __global__ void relu(float* x, i64 n) {
    FOR_EACH(i, n) { x[i] = fmaxf(x[i], 0.0f); }
}

// Activations rounded to bf16 (to nearest, ties to even) for a bf16 GEMM.
extern "C" __global__ void round_to_bf16(bf16* out, const float* x, i64 n) {
    FOR_EACH(i, n) { out[i] = f32_to_bf16(x[i]); }
}
