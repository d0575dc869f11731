// The one-shot all-reduce of ranks that share one GPU (NCCL refuses two ranks on one
// device): each rank's kernel reads every rank's partial sum and adds them in rank order
// 0, 1, ..., so every rank gets the same bits. Up to 8 ranks, their buffers passed by
// pointer (unused ones null). The caller orders it with events: every rank's partial sum is
// written before any rank's kernel runs, and no rank writes its buffer again until every
// rank's kernel has read it. `out` must not be any rank's input (other ranks still read
// those).
#include "common.cuh"

extern "C" __global__ void sum_ranks(float* out, const float* p0, const float* p1,
                                     const float* p2, const float* p3, const float* p4,
                                     const float* p5, const float* p6, const float* p7,
                                     int ranks, i64 n) {
    const float* inputs[8] = {p0, p1, p2, p3, p4, p5, p6, p7};
    FOR_EACH(i, n) {
        float s = inputs[0][i];
        for (int r = 1; r < ranks; ++r) {
            s += inputs[r][i];
        }
        out[i] = s;
    }
}
