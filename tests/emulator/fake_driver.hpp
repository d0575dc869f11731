// A stand-in libcuda for machines without a GPU: the part of the CUDA driver API that tpc
// (through cudarc) calls, over host memory, with kernels run by the emulator
// (cuda_on_cpu.hpp). Built by tests/emulator/mod.rs into a folder put first on
// LD_LIBRARY_PATH, so cudarc loads it as "libcuda.so"; the translation unit that includes
// this first includes every kernel file and defines KERNELS, the name -> launcher table.
//
// Two GPUs of compute capability 8.0 (so ranks on distinct GPUs, with the fake libnccl,
// can be run too), sharing the host's memory: device pointers are host pointers. Work runs when it
// is enqueued (every stream is synchronous), so stream order, events and cross-stream waits
// hold trivially; a global lock serialises ranks' threads. cuModuleLoadData accepts NVRTC's
// PTX (compiled for real by the caller) and the module's functions are the emulated kernels
// of the same names. What is not emulated: concurrency between streams, and device limits.
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include <map>
#include <mutex>
#include <string>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUmodule;
typedef unsigned long long CUdeviceptr;

// A kernel the module offers: its name and the emulator's launcher (EMU_EXPORT).
struct FakeKernel {
    const char* name;
    int (*launch)(emu::Dims, emu::Dims, void**, int);
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

// Memory the fake GPU offers: enough for the fixtures, small enough to catch a runaway.
constexpr size_t TOTAL_BYTES = size_t(4) << 30;

inline std::mutex lock;
inline size_t used_bytes = 0;
inline int context_tag, module_tag;  // addresses used as opaque handles

struct Event {
    int recorded;
};

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

inline void count_copy() {
    std::lock_guard<std::mutex> g(lock);
    stats.copies += 1;
}

inline CUresult allocate(CUdeviceptr* p, size_t bytes) {
    std::lock_guard<std::mutex> g(lock);
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
    std::lock_guard<std::mutex> g(lock);
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
        default:  // memory pools (115) and the rest: not supported
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
FAKE_API CUresult cuCtxSynchronize() { return fake::SUCCESS; }
FAKE_API CUresult cuCtxPushCurrent_v2(CUcontext) { return fake::SUCCESS; }
FAKE_API CUresult cuCtxPopCurrent_v2(CUcontext* c) {
    if (c) {
        *c = &fake::context_tag;
    }
    return fake::SUCCESS;
}

FAKE_API CUresult cuStreamCreate(CUstream* s, unsigned) {
    *s = new int(0);
    return fake::SUCCESS;
}
FAKE_API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned, int) {
    *s = new int(0);
    return fake::SUCCESS;
}
FAKE_API CUresult cuStreamDestroy_v2(CUstream s) {
    delete static_cast<int*>(s);
    return fake::SUCCESS;
}
FAKE_API CUresult cuStreamSynchronize(CUstream) { return fake::SUCCESS; }
FAKE_API CUresult cuStreamQuery(CUstream) { return fake::SUCCESS; }
FAKE_API CUresult cuStreamWaitEvent(CUstream, void*, unsigned) { return fake::SUCCESS; }

FAKE_API CUresult cuEventCreate(void** e, unsigned) {
    *e = new fake::Event{0};
    return fake::SUCCESS;
}
FAKE_API CUresult cuEventDestroy_v2(void* e) {
    delete static_cast<fake::Event*>(e);
    return fake::SUCCESS;
}
FAKE_API CUresult cuEventRecord(void* e, CUstream) {
    static_cast<fake::Event*>(e)->recorded = 1;
    return fake::SUCCESS;
}
FAKE_API CUresult cuEventSynchronize(void*) { return fake::SUCCESS; }
FAKE_API CUresult cuEventQuery(void*) { return fake::SUCCESS; }
FAKE_API CUresult cuEventElapsedTime(float* ms, void*, void*) {
    *ms = 0.0f;
    return fake::SUCCESS;
}

FAKE_API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) { return fake::allocate(p, bytes); }
FAKE_API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) {
    return fake::allocate(p, bytes);
}
FAKE_API CUresult cuMemFree_v2(CUdeviceptr p) { return fake::release(p); }
FAKE_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) { return fake::release(p); }
FAKE_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(fake::lock);
    *free_bytes = fake::TOTAL_BYTES - fake::used_bytes;
    *total = fake::TOTAL_BYTES;
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream) {
    {
        std::lock_guard<std::mutex> g(fake::lock);
        fake::stats.fills += 1;
    }
    memset(reinterpret_cast<void*>(p), v, n);
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    {
        std::lock_guard<std::mutex> g(fake::lock);
        fake::stats.fills += 1;
    }
    memset(reinterpret_cast<void*>(p), v, n);
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream) {
    fake::count_copy();
    memcpy(reinterpret_cast<void*>(dst), src, n);
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream) {
    fake::count_copy();
    memcpy(dst, reinterpret_cast<const void*>(src), n);
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
    fake::count_copy();
    memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    fake::count_copy();
    memcpy(reinterpret_cast<void*>(dst), src, n);
    return fake::SUCCESS;
}
FAKE_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    fake::count_copy();
    memcpy(dst, reinterpret_cast<const void*>(src), n);
    return fake::SUCCESS;
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
                                 unsigned by, unsigned bz, unsigned shared_bytes, CUstream,
                                 void** params, void** extra) {
    const auto* k = static_cast<const FakeKernel*>(f);
    if (extra != nullptr || shared_bytes != 0) {
        fprintf(stderr, "fake libcuda: %s launched with extra or dynamic shared memory\n",
                k->name);
        return fake::INVALID_VALUE;
    }
    std::lock_guard<std::mutex> g(fake::lock);
    fake::stats.launches[k->name] += 1;
    if (k->launch({gx, gy, gz}, {bx, by, bz}, params, 0) != 0) {
        fprintf(stderr, "fake libcuda: kernel %s: %s\n", k->name, emu_last_error());
        return fake::LAUNCH_FAILED;
    }
    return fake::SUCCESS;
}

FAKE_API CUresult cuGetErrorString(CUresult e, const char** s) {
    static thread_local char text[64];
    snprintf(text, sizeof text, "fake libcuda error %d", e);
    *s = text;
    return fake::SUCCESS;
}
FAKE_API CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }
