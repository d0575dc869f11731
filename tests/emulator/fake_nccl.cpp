// A stand-in libnccl for machines without GPUs (see fake_driver.hpp): communicators of rank
// threads in one process, made by ncclCommInitRank from a shared unique id, and the
// in-place f32 sum all-reduce tpc uses, added in rank order so every rank gets the same
// bits. Device pointers are host pointers, as in the fake driver; a rank's stream is run
// (its queue in the fake libcuda) before its buffer is read, and the sum written at once.
#include <stdio.h>
#include <string.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fake_hooks.hpp"

#define FAKE_API extern "C" __attribute__((visibility("default")))

typedef int ncclResult_t;
constexpr ncclResult_t SUCCESS = 0;
constexpr ncclResult_t INVALID_ARGUMENT = 4;
constexpr int FLOAT32 = 7, SUM = 0;

struct UniqueId {
    char internal[128];
};

// The ranks of one communicator meet here: every rank posts its buffer, the last to come
// adds them, every rank copies the sum back, and the last to leave opens the next round.
struct Group {
    int ranks;
    int joined = 0;
    std::vector<const float*> inputs;
    std::vector<size_t> counts;
    std::vector<float> sum;
    bool mismatch = false;
    int arrived = 0, left = 0;
    unsigned long long round = 0;
};

struct Comm {
    Group* group;
    int rank;
};

static std::mutex lock;
static std::condition_variable changed;
static std::map<std::string, Group*> groups;
static unsigned long long ids = 0;

FAKE_API ncclResult_t ncclGetVersion(int* v) {
    *v = 22800;
    return SUCCESS;
}
FAKE_API const char* ncclGetErrorString(ncclResult_t r) {
    return r == SUCCESS ? "success" : "fake libnccl: invalid argument";
}
FAKE_API ncclResult_t ncclGetUniqueId(UniqueId* id) {
    std::lock_guard<std::mutex> g(lock);
    memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "tpc-fake-nccl-%llu", ids++);
    return SUCCESS;
}
FAKE_API ncclResult_t ncclCommInitRank(Comm** comm, int ranks, UniqueId id, int rank) {
    if (ranks < 1 || rank < 0 || rank >= ranks) {
        return INVALID_ARGUMENT;
    }
    std::unique_lock<std::mutex> g(lock);
    Group*& group = groups[std::string(id.internal, sizeof id.internal)];
    if (group == nullptr) {
        group = new Group{ranks};
        group->inputs.assign(ranks, nullptr);
        group->counts.assign(ranks, 0);
    }
    if (group->ranks != ranks) {
        return INVALID_ARGUMENT;
    }
    Group* gr = group;
    gr->joined += 1;
    changed.notify_all();
    // Every rank of the group blocks until all have joined, as NCCL's does.
    changed.wait(g, [gr] { return gr->joined >= gr->ranks; });
    *comm = new Comm{gr, rank};
    return SUCCESS;
}
FAKE_API ncclResult_t ncclCommAbort(Comm* comm) {
    delete comm;
    return SUCCESS;
}
FAKE_API ncclResult_t ncclCommDestroy(Comm* comm) { return ncclCommAbort(comm); }
FAKE_API ncclResult_t ncclCommFinalize(Comm*) { return SUCCESS; }
FAKE_API ncclResult_t ncclCommGetAsyncError(Comm*, ncclResult_t* e) {
    *e = SUCCESS;
    return SUCCESS;
}
FAKE_API ncclResult_t ncclGroupStart() { return SUCCESS; }
FAKE_API ncclResult_t ncclGroupEnd() { return SUCCESS; }

typedef void (*RunStream)(void* stream);

// The fake libcuda's stream runner, if that is the libcuda this process loaded.
static RunStream driver_run_stream() {
    static RunStream found = fake_driver_hook<RunStream>("tpc_fake_run_stream");
    return found;
}

FAKE_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int type, int op,
                                    Comm* comm, void* stream) {
    if (type != FLOAT32 || op != SUM) {
        return INVALID_ARGUMENT;
    }
    if (RunStream run = driver_run_stream()) {
        run(stream);  // the work that writes `send`, queued before this call
    }
    Group* gr = comm->group;
    std::unique_lock<std::mutex> g(lock);
    // A rank that comes back early waits for the previous round to empty.
    changed.wait(g, [gr] { return gr->left == 0; });
    const unsigned long long round = gr->round;
    gr->inputs[comm->rank] = static_cast<const float*>(send);
    gr->counts[comm->rank] = count;
    gr->arrived += 1;
    if (gr->arrived == gr->ranks) {
        gr->mismatch = false;
        for (int r = 0; r < gr->ranks; ++r) {
            gr->mismatch = gr->mismatch || gr->counts[r] != count;
        }
        if (!gr->mismatch) {
            gr->sum.assign(gr->inputs[0], gr->inputs[0] + count);
            for (int r = 1; r < gr->ranks; ++r) {
                for (size_t i = 0; i < count; ++i) {
                    gr->sum[i] += gr->inputs[r][i];
                }
            }
        }
        gr->round += 1;
        changed.notify_all();
    } else {
        changed.wait(g, [gr, round] { return gr->round != round; });
    }
    const bool mismatch = gr->mismatch;
    if (!mismatch) {
        memcpy(recv, gr->sum.data(), count * sizeof(float));
    }
    gr->left += 1;
    if (gr->left == gr->ranks) {
        gr->arrived = 0;
        gr->left = 0;
        changed.notify_all();
    }
    return mismatch ? INVALID_ARGUMENT : SUCCESS;
}
