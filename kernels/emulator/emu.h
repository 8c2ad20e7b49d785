// Host emulation of the CUDA subset rackfill's kernels use, so that the real kernel sources
// (kernels/cuda/*.cu) run on a CPU: every CUDA thread a std::thread, __syncthreads / __syncwarp
// as barriers, warp shuffles and match through a per-warp exchange buffer. launch.cpp builds the
// host emulator (rackfill_kernels::cuda::exec::Emulator) on it: a grid's blocks one after another
// in the process, or all at once as forked processes (run_block in each), each with its own
// __shared__ variables, meeting only through global memory (shared mappings) and its atomics, as
// on a GPU. What it cannot show: cp.async, the GPU's weaker memory ordering (x86's is stronger),
// memory across GPUs, real warp scheduling.
// Kernel sources test this to take their host stand-ins for inline PTX.
#define RACKFILL_HOST_EMULATOR 1

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

struct Idx { unsigned x, y, z; };
static thread_local Idx threadIdx;
static Idx blockIdx{0};  // per process: one block per process in a concurrent grid
static Idx blockDim{0, 1, 1};
static Idx gridDim{1, 1, 1};
static thread_local int t_warp;
static std::barrier<>* g_block;
struct WarpX { std::barrier<>* bar; unsigned long long x[32]; };
static std::vector<WarpX*> g_warps;
static unsigned char* g_smem;

#define __syncthreads() g_block->arrive_and_wait()
// Warp-synchronous operations (shuffles, matches, reductions, warp barriers) this thread has
// run, and the most any thread of the block ran: the length of a kernel's warp-level critical
// path, a count the emulator reports per launch (not a time).
static thread_local unsigned long long t_warp_ops = 0;
static std::atomic<unsigned long long> g_max_warp_ops{0};
inline void warp_sync() {
    ++t_warp_ops;
    g_warps[t_warp]->bar->arrive_and_wait();
}
#define __syncwarp() warp_sync()
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

struct uint4 { unsigned x, y, z, w; };

// A lane's value through the warp's exchange buffer, bit for bit (floats included).
template <class T> unsigned long long to_lane_bits(T v) {
    static_assert(sizeof(T) <= 8);
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> T from_lane_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int o) {
    WarpX* w = g_warps[t_warp];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    w->bar->arrive_and_wait();
    T r = from_lane_bits<T>(w->x[lane ^ o]);
    w->bar->arrive_and_wait();
    return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src) {
    WarpX* w = g_warps[t_warp];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    w->bar->arrive_and_wait();
    T r = from_lane_bits<T>(w->x[src & 31]);
    w->bar->arrive_and_wait();
    return r;
}
template <class T> T __shfl_down_sync(unsigned, T v, int o) {
    WarpX* w = g_warps[t_warp];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    w->bar->arrive_and_wait();
    T r = lane + o < 32 ? from_lane_bits<T>(w->x[lane + o]) : v;
    w->bar->arrive_and_wait();
    return r;
}
template <class T> T __shfl_up_sync(unsigned, T v, int o) {
    WarpX* w = g_warps[t_warp];
    ++t_warp_ops;
    int lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    w->bar->arrive_and_wait();
    T r = lane >= o ? from_lane_bits<T>(w->x[lane - o]) : v;
    w->bar->arrive_and_wait();
    return r;
}
inline unsigned __match_any_sync(unsigned, unsigned k) {
    WarpX* w = g_warps[t_warp];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = k;
    w->bar->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i)
        if ((unsigned)w->x[i] == k) m |= 1u << i;
    w->bar->arrive_and_wait();
    return m;
}
template <class Op> unsigned reduce_warp(unsigned v, Op op) {
    WarpX* w = g_warps[t_warp];
    ++t_warp_ops;
    const unsigned lane = threadIdx.x & 31, first = threadIdx.x - lane;
    const unsigned lanes = std::min(32u, blockDim.x - first);
    w->x[lane] = v;
    w->bar->arrive_and_wait();
    unsigned r = (unsigned)w->x[0];
    for (unsigned i = 1; i < lanes; ++i) r = op(r, (unsigned)w->x[i]);
    w->bar->arrive_and_wait();
    return r;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
    return reduce_warp(v, [](unsigned a, unsigned b) { return a < b ? a : b; });
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    return reduce_warp(v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd_system(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline float atomicAdd(float* p, float v) {
    std::atomic_ref<float> a(*p);
    return a.fetch_add(v);
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
// Whether the quota solver may pick targets by packed keys (the solver test turns it off to run
// the shuffle-tree path on the same layer).
static bool g_emu_packed_keys = true;
// How long tile_stream waits for a relay chunk before it declares the stream broken
// (TILE_STALL_NS, set per run by the emulator).
static unsigned long long g_tile_stall_ns = 50000000ull;
// Microseconds every system-scope fence stalls before it completes (set per launch): the
// kernels fence right before they publish a ready counter, so a delay here holds producers back
// and makes consumers in other blocks really wait.
static unsigned g_fence_delay_us = 0;
// Times a kernel backed off in a wait loop (__nanosleep), counted across every block when it
// points into memory the blocks share (launch.cpp's shared counters page).
static unsigned long long* g_backoffs = nullptr;
inline void __threadfence_system() {
    if (g_fence_delay_us) std::this_thread::sleep_for(std::chrono::microseconds(g_fence_delay_us));
    std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __nanosleep(unsigned) {
    if (g_backoffs) __atomic_fetch_add(g_backoffs, 1ull, __ATOMIC_RELAXED);
    std::this_thread::yield();
}
inline unsigned long long host_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Runs `f` as block `block` of a `grid`-block grid, `threads` threads, in this process.
template <class F> void run_block(unsigned threads, F f, unsigned block = 0, unsigned grid = 1) {
    blockDim.x = threads;
    blockIdx.x = block;
    gridDim.x = grid;
    std::barrier<> barrier(threads);
    g_block = &barrier;
    for (auto* w : g_warps) { delete w->bar; delete w; }
    g_warps.clear();
    for (unsigned i = 0; i < (threads + 31) / 32; ++i) {
        auto* x = new WarpX;
        x->bar = new std::barrier<>(std::min(32u, threads - 32 * i));
        g_warps.push_back(x);
    }
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
            threadIdx.x = t;
            t_warp = t / 32;
            t_warp_ops = 0;
            f();
            unsigned long long most = g_max_warp_ops.load();
            while (t_warp_ops > most && !g_max_warp_ops.compare_exchange_weak(most, t_warp_ops)) {}
        });
    for (auto& t : ts) t.join();
}
