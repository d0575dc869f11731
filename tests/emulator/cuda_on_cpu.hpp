// The CUDA C++ that kernels/ uses, on the CPU, so tests can run the kernels with no GPU.
//
// g++ compiles a kernel file with this header forced in front (tests/emulator/mod.rs).
// Every thread of a block is a fiber (ucontext) on one OS thread; the blocks of a grid run
// one after another, so `__shared__` variables are function statics. A fiber runs until it
// reaches __syncthreads, __syncwarp or a warp shuffle, where it waits; the scheduler then
// releases a warp when all its lanes wait at a warp point, and the block when every thread
// waits at __syncthreads. What would hang or be undefined on a GPU is reported instead: a
// barrier some thread never reaches (it returned, or waits elsewhere), a shuffle of a
// partial warp or mask. Fibers run in increasing or decreasing thread order (the caller's
// choice): a kernel whose result depends on that order has a shared-memory race.
//
// Not emulated: warps running ahead of each other between barriers in any order other than
// those two, memory spaces (every pointer is a host pointer), the GPU's float rounding of
// expf and friends (a few ulp apart), and the shared-memory and register limits.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <bit>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// common.cuh defines these two itself (NVRTC has no math header).
#undef INFINITY
#undef NAN

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

struct uint3 {
    unsigned x, y, z;
};

inline uint3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

enum class State { Ready, AtWarpPoint, AtBlockBarrier, Done };

struct Fiber {
    ucontext_t context;
    State state;
    std::vector<char> stack;
};

constexpr size_t STACK_BYTES = 64 * 1024;  // the kernels keep a few hundred bytes of locals

struct Block {
    std::vector<Fiber> fibers;
    std::vector<uint64_t> lanes;  // one shuffle slot per thread
    ucontext_t scheduler;
    unsigned current = 0;
    void (*body)(void*) = nullptr;
    void* closure = nullptr;
    std::string error;
};

inline Block* running = nullptr;
inline Block block_pool;
inline std::string last_error;

inline void fail(const std::string& why) {
    if (running->error.empty()) {
        running->error = why;
    }
}

inline std::string where() {
    return "block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
           std::to_string(blockIdx.z) + ") thread " + std::to_string(running->current);
}

// The running fiber stops at a warp point or barrier until the scheduler releases it.
inline void wait_at(State s) {
    Fiber& f = running->fibers[running->current];
    f.state = s;
    swapcontext(&f.context, &running->scheduler);
}

inline void fiber_main() {
    running->body(running->closure);
    running->fibers[running->current].state = State::Done;
    // Returning resumes uc_link: the scheduler.
}

inline void enter(unsigned t) {
    running->current = t;
    threadIdx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
    swapcontext(&running->scheduler, &running->fibers[t].context);
}

// Releases whatever can go on after every fiber has stopped; false when nothing can.
inline bool release(unsigned n) {
    bool released = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
        const unsigned lo = w * 32;
        const unsigned hi = lo + 32 < n ? lo + 32 : n;
        unsigned at_point = 0;
        for (unsigned t = lo; t < hi; ++t) {
            at_point += running->fibers[t].state == State::AtWarpPoint;
        }
        if (at_point == hi - lo) {
            for (unsigned t = lo; t < hi; ++t) {
                running->fibers[t].state = State::Ready;
            }
            released = true;
        } else if (at_point > 0) {
            fail("block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
                 "): a warp shuffle or __syncwarp that only " + std::to_string(at_point) +
                 " of warp " + std::to_string(w) + "'s " + std::to_string(hi - lo) +
                 " lanes reached");
            return false;
        }
    }
    if (released) {
        return true;
    }
    unsigned at_barrier = 0;
    for (unsigned t = 0; t < n; ++t) {
        at_barrier += running->fibers[t].state == State::AtBlockBarrier;
    }
    if (at_barrier == n) {
        for (unsigned t = 0; t < n; ++t) {
            running->fibers[t].state = State::Ready;
        }
        return true;
    }
    if (at_barrier > 0) {
        fail("block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
             "): __syncthreads reached by " + std::to_string(at_barrier) + " of " +
             std::to_string(n) + " threads (the others returned)");
    }
    return false;
}

// Runs one block to its end; false with running->error set when it cannot finish.
inline bool run_block(unsigned n, bool reverse) {
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = running->fibers[t];
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = &running->scheduler;
        makecontext(&f.context, fiber_main, 0);
        f.state = State::Ready;
    }
    for (;;) {
        for (unsigned k = 0; k < n; ++k) {
            const unsigned t = reverse ? n - 1 - k : k;
            if (running->fibers[t].state == State::Ready) {
                enter(t);
                if (!running->error.empty()) {
                    return false;
                }
            }
        }
        bool all_done = true;
        for (unsigned t = 0; t < n; ++t) {
            all_done = all_done && running->fibers[t].state == State::Done;
        }
        if (all_done) {
            return true;
        }
        if (!release(n)) {
            return false;
        }
    }
}

template <class... A, size_t... I>
void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

struct Dims {
    unsigned x, y, z;
};

// Launches `kernel` on `grid` blocks of `block` threads, its arguments passed as cuLaunchKernel
// takes them: one pointer to each argument's value. 0 when it ran to the end; else 1 and
// emu_last_error() says why.
template <class... A>
int launch(void (*kernel)(A...), Dims grid, Dims block, void** args, int reverse) {
    last_error.clear();
    const unsigned long long n = (unsigned long long)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
        grid.z > 65535) {
        last_error = "invalid launch: grid (" + std::to_string(grid.x) + ", " +
                     std::to_string(grid.y) + ", " + std::to_string(grid.z) + "), block of " +
                     std::to_string(n) + " threads";
        return 1;
    }
    // Fibers and their stacks are kept from launch to launch (launches never overlap).
    Block& b = block_pool;
    b.error.clear();
    if (b.fibers.size() < n) {
        b.fibers.resize(n);
    }
    b.lanes.assign(n, 0);
    for (unsigned long long t = 0; t < n; ++t) {
        b.fibers[t].stack.resize(STACK_BYTES);
    }
    auto body = [&]() { call(kernel, args, std::index_sequence_for<A...>{}); };
    b.body = [](void* c) { (*static_cast<decltype(body)*>(c))(); };
    b.closure = &body;
    running = &b;
    blockDim = {block.x, block.y, block.z};
    gridDim = {grid.x, grid.y, grid.z};
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                if (!run_block((unsigned)n, reverse != 0)) {
                    last_error = b.error.empty() ? "a block could not finish" : b.error;
                    running = nullptr;
                    return 1;
                }
            }
        }
    }
    running = nullptr;
    return 0;
}

// `kernel` with its arguments' values copied now (as cuLaunchKernel copies them), to launch
// later: what the fake driver queues on a stream.
template <class... A, size_t... I>
std::function<int()> bind_args(void (*kernel)(A...), Dims grid, Dims block, void** args,
                               std::index_sequence<I...>) {
    auto values = std::make_tuple(*static_cast<std::remove_cv_t<A>*>(args[I])...);
    return [kernel, grid, block, values]() mutable {
        void* pointers[sizeof...(A) + 1] = {static_cast<void*>(&std::get<I>(values))...};
        return launch(kernel, grid, block, pointers, 0);
    };
}

template <class... A>
std::function<int()> bind(void (*kernel)(A...), Dims grid, Dims block, void** args) {
    return bind_args(kernel, grid, block, args, std::index_sequence_for<A...>{});
}

// A warp shuffle: every lane of the warp posts its value, waits for the others, reads its
// source lane's, and waits again so no slot is overwritten before every lane has read it.
template <class T>
T shuffle(unsigned mask, T v, int width, unsigned (*source)(unsigned lane, int arg), int arg) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    const unsigned t = running->current;
    const unsigned warp0 = t & ~31u;
    if (mask != 0xffffffffu || width != 32 || blockDim.x * blockDim.y * blockDim.z < warp0 + 32) {
        fail(where() + ": a shuffle of a partial warp (mask, width or block size)");
    }
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    running->lanes[t] = bits;
    wait_at(State::AtWarpPoint);
    const uint64_t got = running->lanes[warp0 + (source(t & 31u, arg) & 31u)];
    wait_at(State::AtWarpPoint);
    T out;
    memcpy(&out, &got, sizeof(T));
    return out;
}

}  // namespace emu

extern "C" const char* emu_last_error() { return emu::last_error.c_str(); }

#define EMU_EXPORT(name)                                                                 \
    extern "C" int emu_launch_##name(emu::Dims grid, emu::Dims block, void** args,      \
                                     int reverse) {                                     \
        return emu::launch(name, grid, block, args, reverse);                           \
    }                                                                                   \
    inline std::function<int()> emu_bind_##name(emu::Dims grid, emu::Dims block,        \
                                                void** args) {                          \
        return emu::bind(name, grid, block, args);                                      \
    }

inline void __syncthreads() { emu::wait_at(emu::State::AtBlockBarrier); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) {
        emu::fail(emu::where() + ": __syncwarp of a partial mask");
    }
    emu::wait_at(emu::State::AtWarpPoint);
}

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return emu::shuffle(mask, v, width, [](unsigned lane, int m) { return lane ^ (unsigned)m; },
                        lane_mask);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return emu::shuffle(mask, v, width, [](unsigned, int s) { return (unsigned)s; }, src);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    // A lane whose source is past the warp keeps its own value.
    return emu::shuffle(
        mask, v, width,
        [](unsigned lane, int d) { return lane + (unsigned)d < 32 ? lane + (unsigned)d : lane; },
        (int)delta);
}

// One OS thread runs every fiber and none is interrupted: atomics are plain updates.
template <class T>
T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <class T>
T atomicMin(T* p, T v) {
    const T old = *p;
    *p = v < old ? v : old;
    return old;
}
template <class T>
T atomicMax(T* p, T v) {
    const T old = *p;
    *p = v > old ? v : old;
    return old;
}
template <class T>
T atomicOr(T* p, T v) {
    const T old = *p;
    *p = old | v;
    return old;
}

inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Arithmetic with the rounding named (each one IEEE operation, never fused with another).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __double2float_rn(double a) { return (float)a; }
template <class T>
T __ldg(const T* p) {
    return *p;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
