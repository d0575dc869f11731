// A stand-in libcuda for machines without a GPU: the part of the CUDA driver API that tpc
// (through cudarc) calls, over host memory, with kernels run by the emulator
// (cuda_on_cpu.hpp). Built by tests/emulator/mod.rs into a folder put first on
// LD_LIBRARY_PATH, so cudarc loads it as "libcuda.so"; the translation unit that includes
// this first includes every kernel file and defines KERNELS, the name -> launcher table.
//
// Two GPUs of compute capability 8.0 (so ranks on distinct GPUs, with the fake libnccl,
// can be run too), sharing the host's memory: device pointers are host pointers.
// Streams are queues that run as late as CUDA allows, to expose a missing dependency:
// kernels, device-to-device copies, fills, asynchronous frees and host-to-device copies (the
// host data taken at once, as CUDA stages pageable memory) wait on their stream until
// something needs them done — a synchronize, a copy to the host, or another stream waiting
// on an event recorded after them (the recording stream then runs up to the event). Work
// that reads another stream's results without such a wait reads stale memory, and the
// tests see wrong numbers. A global lock serialises the ranks' threads. cuModuleLoadData
// accepts NVRTC's PTX (compiled for real by the caller) and the module's functions are the
// emulated kernels of the same names. Not emulated: device limits.
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <memory>
#include <string>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUmodule;
typedef unsigned long long CUdeviceptr;

// A kernel the module offers: its name and the emulator's launcher (EMU_EXPORT).
struct FakeKernel {
    const char* name;
    std::function<int()> (*bind)(emu::Dims, emu::Dims, void**);
};
// Defined after this header by the generated translation unit: every exported kernel.
extern const FakeKernel KERNELS[];
extern const size_t KERNEL_COUNT;

namespace fake {

constexpr CUresult SUCCESS = 0;
constexpr CUresult INVALID_VALUE = 1;
constexpr CUresult OUT_OF_MEMORY = 2;
constexpr CUresult INVALID_DEVICE = 101;
constexpr CUresult NOT_FOUND = 500;
constexpr CUresult LAUNCH_FAILED = 719;

// Memory the fake GPU offers: enough for the fixtures, small enough to catch a runaway;
// TPC_FAKE_CUDA_BYTES sets another amount (to see tpc run out of it).
inline const size_t TOTAL_BYTES = [] {
    const char* bytes = getenv("TPC_FAKE_CUDA_BYTES");
    return bytes ? size_t(strtoull(bytes, nullptr, 10)) : size_t(4) << 30;
}();

// Recursive: queued work that frees memory runs with the lock already held.
inline std::recursive_mutex lock;
inline size_t used_bytes = 0;
inline int context_tag, module_tag;  // addresses used as opaque handles

// A stream's queue: `done` of the `enqueued` operations have run, the rest wait in order.
struct Stream {
    std::deque<std::function<void()>> pending;
    unsigned long long enqueued = 0, done = 0;
};

// Where an event was recorded: its stream, after that stream's `ticket`-th operation.
struct Event {
    Stream* stream = nullptr;
    unsigned long long ticket = 0;
};

inline std::set<Stream*> streams;
inline Stream null_stream;  // CUstream 0
// The first queued kernel that failed, reported by the next call that waits for work.
inline std::string failure;

inline Stream* stream_of(CUstream s) { return s ? static_cast<Stream*>(s) : &null_stream; }

inline void run_until(Stream* s, unsigned long long ticket) {
    while (s->done < ticket && !s->pending.empty()) {
        auto op = std::move(s->pending.front());
        s->pending.pop_front();
        s->done += 1;
        op();
    }
}

inline void run_all(Stream* s) { run_until(s, s->enqueued); }

inline void run_every_stream() {
    run_all(&null_stream);
    for (Stream* s : streams) {
        run_all(s);
    }
}

inline void enqueue_locked(CUstream s, std::function<void()> op) {
    std::lock_guard<std::recursive_mutex> g(lock);
    Stream* q = stream_of(s);
    q->pending.push_back(std::move(op));
    q->enqueued += 1;
}

// What a call that waited for work returns: a queued kernel's failure, once.
inline CUresult waited() {
    if (failure.empty()) {
        return SUCCESS;
    }
    fprintf(stderr, "fake libcuda: %s\n", failure.c_str());
    failure.clear();
    return LAUNCH_FAILED;
}

// With TPC_FAKE_CUDA_STATS set, what the process asked of the GPU is counted and printed
// to stderr at exit: launches per kernel, allocations, copies (how launch-bound a step is).
struct Stats {
    std::map<std::string, unsigned long long> launches;
    unsigned long long allocations = 0, frees = 0, copies = 0, fills = 0;
    ~Stats() {
        if (getenv("TPC_FAKE_CUDA_STATS") == nullptr) {
            return;
        }
        unsigned long long total = 0;
        for (const auto& [name, n] : launches) {
            fprintf(stderr, "fake libcuda: %llu launches of %s\n", n, name.c_str());
            total += n;
        }
        fprintf(stderr,
                "fake libcuda: %llu launches, %llu allocations, %llu frees, %llu copies, "
                "%llu fills\n",
                total, allocations, frees, copies, fills);
    }
};
inline Stats stats;


inline CUresult allocate(CUdeviceptr* p, size_t bytes) {
    std::lock_guard<std::recursive_mutex> g(lock);
    stats.allocations += 1;
    if (bytes > TOTAL_BYTES - used_bytes) {
        return OUT_OF_MEMORY;
    }
    // The size rides in front of the block, so a free knows what it returns.
    size_t* block = static_cast<size_t*>(malloc(bytes + 16));
    if (block == nullptr) {
        return OUT_OF_MEMORY;
    }
    block[0] = bytes;
    used_bytes += bytes;
    *p = reinterpret_cast<CUdeviceptr>(block + 2);
    return SUCCESS;
}

inline CUresult release(CUdeviceptr p) {
    if (p == 0) {
        return SUCCESS;
    }
    std::lock_guard<std::recursive_mutex> g(lock);
    stats.frees += 1;
    size_t* block = reinterpret_cast<size_t*>(p) - 2;
    used_bytes -= block[0];
    free(block);
    return SUCCESS;
}

}  // namespace fake

#define FAKE_API extern "C" __attribute__((visibility("default")))

FAKE_API CUresult cuInit(unsigned) { return fake::SUCCESS; }
FAKE_API CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return fake::SUCCESS;
}
FAKE_API CUresult cuDeviceGetCount(int* n) {
    *n = 2;
    return fake::SUCCESS;
}
FAKE_API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal < 0 || ordinal > 1) {
        return fake::INVALID_DEVICE;
    }
    *d = ordinal;
    return fake::SUCCESS;
}
FAKE_API CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
    switch (attribute) {
        case 75:  // compute capability major
            *v = 8;
            break;
        case 76:  // minor
            *v = 0;
            break;
        case 115:  // memory pools: cudarc then allocates and frees in stream order, as on
                   // the GPUs tpc targets (a synchronous free would run every queue)
            *v = 1;
            break;
        default:
            *v = 0;
    }
    return fake::SUCCESS;
}
FAKE_API CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    snprintf(name, len, "tpc emulated GPU");
    return fake::SUCCESS;
}
FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
    *c = &fake::context_tag;
    return fake::SUCCESS;
}
FAKE_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return fake::SUCCESS; }
FAKE_API CUresult cuCtxSetCurrent(CUcontext) { return fake::SUCCESS; }
FAKE_API CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = &fake::context_tag;
    return fake::SUCCESS;
}
FAKE_API CUresult cuCtxSynchronize() {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_every_stream();
    return fake::waited();
}
FAKE_API CUresult cuCtxPushCurrent_v2(CUcontext) { return fake::SUCCESS; }
FAKE_API CUresult cuCtxPopCurrent_v2(CUcontext* c) {
    if (c) {
        *c = &fake::context_tag;
    }
    return fake::SUCCESS;
}

FAKE_API CUresult cuStreamCreate(CUstream* s, unsigned) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::Stream* q = new fake::Stream;
    fake::streams.insert(q);
    *s = q;
    return fake::SUCCESS;
}
FAKE_API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) {
    return cuStreamCreate(s, flags);
}
FAKE_API CUresult cuStreamDestroy_v2(CUstream s) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::Stream* q = fake::stream_of(s);
    fake::run_all(q);
    if (q != &fake::null_stream) {
        fake::streams.erase(q);
        delete q;
    }
    return fake::waited();
}
FAKE_API CUresult cuStreamSynchronize(CUstream s) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_all(fake::stream_of(s));
    return fake::waited();
}
FAKE_API CUresult cuStreamQuery(CUstream s) { return cuStreamSynchronize(s); }
FAKE_API CUresult cuStreamWaitEvent(CUstream s, void* e, unsigned) {
    // The waiting stream's later work is queued after this call; the recording stream's
    // work up to the event runs now, so it is done before any of that (a stream waiting on
    // its own event needs nothing run).
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    const auto* ev = static_cast<fake::Event*>(e);
    if (ev->stream != nullptr && ev->stream != fake::stream_of(s)) {
        fake::run_until(ev->stream, ev->ticket);
    }
    return fake::SUCCESS;
}

FAKE_API CUresult cuEventCreate(void** e, unsigned) {
    *e = new fake::Event;
    return fake::SUCCESS;
}
FAKE_API CUresult cuEventDestroy_v2(void* e) {
    delete static_cast<fake::Event*>(e);
    return fake::SUCCESS;
}
FAKE_API CUresult cuEventRecord(void* e, CUstream s) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    auto* ev = static_cast<fake::Event*>(e);
    ev->stream = fake::stream_of(s);
    ev->ticket = ev->stream->enqueued;
    return fake::SUCCESS;
}
FAKE_API CUresult cuEventSynchronize(void* e) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    const auto* ev = static_cast<fake::Event*>(e);
    if (ev->stream != nullptr) {
        fake::run_until(ev->stream, ev->ticket);
    }
    return fake::waited();
}
FAKE_API CUresult cuEventQuery(void* e) { return cuEventSynchronize(e); }
FAKE_API CUresult cuEventElapsedTime(float* ms, void*, void*) {
    *ms = 0.0f;
    return fake::SUCCESS;
}

FAKE_API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) { return fake::allocate(p, bytes); }
FAKE_API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) {
    return fake::allocate(p, bytes);
}
FAKE_API CUresult cuMemFree_v2(CUdeviceptr p) {
    // cuMemFree waits for the device: every queued operation may still use the memory.
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_every_stream();
    return fake::release(p);
}
FAKE_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    fake::enqueue_locked(s, [p] { fake::release(p); });
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    *free_bytes = fake::TOTAL_BYTES - fake::used_bytes;
    *total = fake::TOTAL_BYTES;
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    fake::enqueue_locked(s, [p, v, n] {
        fake::stats.fills += 1;
        memset(reinterpret_cast<void*>(p), v, n);
    });
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_every_stream();
    fake::stats.fills += 1;
    memset(reinterpret_cast<void*>(p), v, n);
    return fake::waited();
}
FAKE_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    // Pageable host memory is staged at once: the caller may reuse it on return.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + n);
    fake::enqueue_locked(s, [dst, staged] {
        fake::stats.copies += 1;
        memcpy(reinterpret_cast<void*>(dst), staged->data(), staged->size());
    });
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    // Into pageable host memory the copy is synchronous: the stream's work first.
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_all(fake::stream_of(s));
    fake::stats.copies += 1;
    memcpy(dst, reinterpret_cast<const void*>(src), n);
    return fake::waited();
}
FAKE_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    fake::enqueue_locked(s, [dst, src, n] {
        fake::stats.copies += 1;
        memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    });
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_every_stream();
    fake::stats.copies += 1;
    memcpy(reinterpret_cast<void*>(dst), src, n);
    return fake::waited();
}
FAKE_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_every_stream();
    fake::stats.copies += 1;
    memcpy(dst, reinterpret_cast<const void*>(src), n);
    return fake::waited();
}

FAKE_API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    // NVRTC's PTX: accepted as long as it is PTX for the device.
    if (image == nullptr || strstr(static_cast<const char*>(image), ".target sm_80") == nullptr) {
        return fake::INVALID_VALUE;
    }
    *m = &fake::module_tag;
    return fake::SUCCESS;
}
FAKE_API CUresult cuModuleUnload(CUmodule) { return fake::SUCCESS; }
FAKE_API CUresult cuModuleGetFunction(void** f, CUmodule, const char* name) {
    for (size_t i = 0; i < KERNEL_COUNT; ++i) {
        if (strcmp(KERNELS[i].name, name) == 0) {
            *f = const_cast<void*>(static_cast<const void*>(&KERNELS[i]));
            return fake::SUCCESS;
        }
    }
    return fake::NOT_FOUND;
}
FAKE_API CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return fake::SUCCESS;
}
FAKE_API CUresult cuFuncSetAttribute(void*, int, int) { return fake::SUCCESS; }

FAKE_API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned shared_bytes, CUstream s,
                                 void** params, void** extra) {
    const auto* k = static_cast<const FakeKernel*>(f);
    if (extra != nullptr || shared_bytes != 0) {
        fprintf(stderr, "fake libcuda: %s launched with extra or dynamic shared memory\n",
                k->name);
        return fake::INVALID_VALUE;
    }
    // The arguments' values are taken now; the kernel runs when its stream is run.
    auto run = k->bind({gx, gy, gz}, {bx, by, bz}, params);
    const char* name = k->name;
    fake::enqueue_locked(s, [run, name]() mutable {
        fake::stats.launches[name] += 1;
        if (run() != 0 && fake::failure.empty()) {
            fake::failure = std::string("kernel ") + name + ": " + emu_last_error();
        }
    });
    return fake::SUCCESS;
}

FAKE_API CUresult cuGetErrorString(CUresult e, const char** s) {
    static thread_local char text[64];
    snprintf(text, sizeof text, "fake libcuda error %d", e);
    *s = text;
    return fake::SUCCESS;
}
FAKE_API CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }

// For the stand-in cuBLAS and NCCL (found with dlopen(RTLD_NOLOAD)): queue work on a stream,
// and run a stream's queue.
FAKE_API void tpc_fake_enqueue(CUstream s, void (*run)(void*), void* context) {
    fake::enqueue_locked(s, [run, context] { run(context); });
}
FAKE_API void tpc_fake_run_stream(CUstream s) {
    std::lock_guard<std::recursive_mutex> g(fake::lock);
    fake::run_all(fake::stream_of(s));
}
