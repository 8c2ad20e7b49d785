// Host emulation of the CUDA subset rackfill's kernels use, so that the real kernel sources
// (kernels/cuda/*.cu) run on a CPU: one thread block, every CUDA thread a std::thread,
// __syncthreads / __syncwarp as barriers, warp shuffles and match through a per-warp exchange
// buffer. Used by tests/cuda_emulated.rs on machines without a GPU. What it cannot show:
// cp.async, memory ordering across GPUs, several concurrent blocks, real warp scheduling.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

struct Idx { unsigned x; };
static thread_local Idx threadIdx;
static Idx blockIdx{0};
static Idx blockDim{0};
static Idx gridDim{1};
static thread_local int t_warp;
static std::barrier<>* g_block;
struct WarpX { std::barrier<>* bar; unsigned long long x[32]; };
static std::vector<WarpX*> g_warps;
static unsigned char* g_smem;

#define __syncthreads() g_block->arrive_and_wait()
#define __syncwarp() g_warps[t_warp]->bar->arrive_and_wait()
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

struct uint4 { unsigned x, y, z, w; };

template <class T> T __shfl_xor_sync(unsigned, T v, int o) {
    WarpX* w = g_warps[t_warp];
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = (unsigned long long)v;
    w->bar->arrive_and_wait();
    T r = (T)w->x[lane ^ o];
    w->bar->arrive_and_wait();
    return r;
}
template <class T> T __shfl_up_sync(unsigned, T v, int o) {
    WarpX* w = g_warps[t_warp];
    int lane = threadIdx.x & 31;
    w->x[lane] = (unsigned long long)v;
    w->bar->arrive_and_wait();
    T r = lane >= o ? (T)w->x[lane - o] : v;
    w->bar->arrive_and_wait();
    return r;
}
inline unsigned __match_any_sync(unsigned, unsigned k) {
    WarpX* w = g_warps[t_warp];
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = k;
    w->bar->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i)
        if ((unsigned)w->x[i] == k) m |= 1u << i;
    w->bar->arrive_and_wait();
    return m;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd_system(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
inline unsigned long long host_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Runs `f` as one block of `threads` threads.
template <class F> void run_block(unsigned threads, F f) {
    blockDim.x = threads;
    blockIdx.x = 0;
    gridDim.x = 1;
    std::barrier<> block(threads);
    g_block = &block;
    for (auto* w : g_warps) { delete w->bar; delete w; }
    g_warps.clear();
    for (unsigned i = 0; i < (threads + 31) / 32; ++i) {
        auto* x = new WarpX;
        x->bar = new std::barrier<>(std::min(32u, threads - 32 * i));
        g_warps.push_back(x);
    }
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
        ts.emplace_back([&, t] { threadIdx.x = t; t_warp = t / 32; f(); });
    for (auto& t : ts) t.join();
}
