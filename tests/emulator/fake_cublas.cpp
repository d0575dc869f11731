// A stand-in libcublas for machines without a GPU (see fake_driver.hpp): the handle calls
// cudarc makes and cublasGemmEx for what tpc asks of it (f32 or bf16 operands, f32 output,
// f32 compute), over host memory, column-major as cuBLAS defines it:
// C = alpha * op(A) * op(B) + beta * C, op(A) m x k, op(B) k x n, C m x n. A product is
// queued on the handle's stream in the fake libcuda, as cuBLAS enqueues its kernels.
#include <stdint.h>
#include <string.h>

#include "fake_hooks.hpp"

#define FAKE_API extern "C" __attribute__((visibility("default")))

typedef int cublasStatus_t;
constexpr cublasStatus_t SUCCESS = 0;
constexpr cublasStatus_t NOT_SUPPORTED = 15;
constexpr int OP_N = 0, OP_T = 1;
constexpr int R_32F = 0, R_16BF = 14;
constexpr int COMPUTE_32F = 68;

struct Handle {
    void* stream;
};

FAKE_API cublasStatus_t cublasCreate_v2(Handle** handle) {
    *handle = new Handle{nullptr};
    return SUCCESS;
}
FAKE_API cublasStatus_t cublasDestroy_v2(Handle* handle) {
    delete handle;
    return SUCCESS;
}
FAKE_API cublasStatus_t cublasSetStream_v2(Handle* handle, void* stream) {
    handle->stream = stream;
    return SUCCESS;
}
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

struct Product {
    int transa, transb, m, n, k;
    float alpha, beta;
    const void* a;
    int atype, lda;
    const void* b;
    int btype, ldb;
    float* c;
    int ldc;
};

static void multiply(void* context) {
    const Product* p = static_cast<const Product*>(context);
    for (int64_t j = 0; j < p->n; ++j) {
        for (int64_t i = 0; i < p->m; ++i) {
            float sum = 0.0f;
            for (int64_t l = 0; l < p->k; ++l) {
                const float x = p->transa == OP_N ? element(p->a, p->atype, i, l, p->lda)
                                                  : element(p->a, p->atype, l, i, p->lda);
                const float y = p->transb == OP_N ? element(p->b, p->btype, l, j, p->ldb)
                                                  : element(p->b, p->btype, j, l, p->ldb);
                sum += x * y;
            }
            // beta = 0 must not read C (it may hold anything, NaN included).
            float& out = p->c[i + j * p->ldc];
            out = p->beta == 0.0f ? p->alpha * sum : p->alpha * sum + p->beta * out;
        }
    }
    delete p;
}

typedef void (*Enqueue)(void* stream, void (*run)(void*), void* context);

// The fake libcuda's queue, if that is the libcuda this process loaded.
static Enqueue driver_queue() {
    static Enqueue found = fake_driver_hook<Enqueue>("tpc_fake_enqueue");
    return found;
}

FAKE_API cublasStatus_t cublasGemmEx(Handle* handle, int transa, int transb, int m, int n,
                                     int k, const void* alpha, const void* a, int atype,
                                     int lda, const void* b, int btype, int ldb,
                                     const void* beta, void* c, int ctype, int ldc, int compute,
                                     int) {
    const bool types_ok = (atype == R_32F || atype == R_16BF) && atype == btype &&
                          ctype == R_32F && compute == COMPUTE_32F;
    const bool ops_ok = (transa == OP_N || transa == OP_T) && (transb == OP_N || transb == OP_T);
    // The leading dimensions cuBLAS requires of column-major operands.
    const bool ld_ok = lda >= (transa == OP_N ? m : k) && ldb >= (transb == OP_N ? k : n) &&
                       ldc >= m && m >= 0 && n >= 0 && k >= 0;
    if (!types_ok || !ops_ok || !ld_ok) {
        return NOT_SUPPORTED;
    }
    // alpha and beta are host values, read now (host pointer mode); the operands when the
    // product runs.
    Product* p = new Product{transa, transb, m, n, k, *static_cast<const float*>(alpha),
                             *static_cast<const float*>(beta), a, atype, lda, b, btype, ldb,
                             static_cast<float*>(c), ldc};
    if (Enqueue enqueue = driver_queue()) {
        enqueue(handle->stream, multiply, p);
    } else {
        multiply(p);
    }
    return SUCCESS;
}
