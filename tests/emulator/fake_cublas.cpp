// A stand-in libcublas for machines without a GPU (see fake_driver.hpp): the handle calls
// cudarc makes and cublasGemmEx for what tpc asks of it (f32 or bf16 operands, f32 output,
// f32 compute), over host memory, column-major as cuBLAS defines it:
// C = alpha * op(A) * op(B) + beta * C, op(A) m x k, op(B) k x n, C m x n.
#include <stdint.h>
#include <string.h>

#define FAKE_API extern "C" __attribute__((visibility("default")))

typedef int cublasStatus_t;
constexpr cublasStatus_t SUCCESS = 0;
constexpr cublasStatus_t NOT_SUPPORTED = 15;
constexpr int OP_N = 0, OP_T = 1;
constexpr int R_32F = 0, R_16BF = 14;
constexpr int COMPUTE_32F = 68;

static int handle_tag;

FAKE_API cublasStatus_t cublasCreate_v2(void** handle) {
    *handle = &handle_tag;
    return SUCCESS;
}
FAKE_API cublasStatus_t cublasDestroy_v2(void*) { return SUCCESS; }
FAKE_API cublasStatus_t cublasSetStream_v2(void*, void*) { return SUCCESS; }
FAKE_API cublasStatus_t cublasSetMathMode(void*, int) { return SUCCESS; }
FAKE_API cublasStatus_t cublasSetWorkspace_v2(void*, void*, size_t) { return SUCCESS; }

// Element (row, col) of a column-major matrix with leading dimension ld.
static float element(const void* p, int type, int64_t row, int64_t col, int64_t ld) {
    const int64_t i = row + col * ld;
    if (type == R_32F) {
        return static_cast<const float*>(p)[i];
    }
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

FAKE_API cublasStatus_t cublasGemmEx(void*, int transa, int transb, int m, int n, int k,
                                     const void* alpha, const void* a, int atype, int lda,
                                     const void* b, int btype, int ldb, const void* beta,
                                     void* c, int ctype, int ldc, int compute, int) {
    const bool types_ok = (atype == R_32F || atype == R_16BF) && atype == btype &&
                          ctype == R_32F && compute == COMPUTE_32F;
    const bool ops_ok = (transa == OP_N || transa == OP_T) && (transb == OP_N || transb == OP_T);
    // The leading dimensions cuBLAS requires of column-major operands.
    const bool ld_ok = lda >= (transa == OP_N ? m : k) && ldb >= (transb == OP_N ? k : n) &&
                       ldc >= m && m >= 0 && n >= 0 && k >= 0;
    if (!types_ok || !ops_ok || !ld_ok) {
        return NOT_SUPPORTED;
    }
    const float al = *static_cast<const float*>(alpha);
    const float be = *static_cast<const float*>(beta);
    float* out = static_cast<float*>(c);
    for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = 0; i < m; ++i) {
            float sum = 0.0f;
            for (int64_t l = 0; l < k; ++l) {
                const float x = transa == OP_N ? element(a, atype, i, l, lda)
                                               : element(a, atype, l, i, lda);
                const float y = transb == OP_N ? element(b, btype, l, j, ldb)
                                               : element(b, btype, j, l, ldb);
                sum += x * y;
            }
            // beta = 0 must not read C (it may hold anything, NaN included).
            out[i + j * ldc] = be == 0.0f ? al * sum : al * sum + be * out[i + j * ldc];
        }
    }
    return SUCCESS;
}
