// Host emulation of the CUDA subset rackfill's kernels use, so that the real kernel sources
// (kernels/cuda/*.cu) run on a CPU: every CUDA thread of a block a fiber (its own stack, switched
// in user space on one OS thread), __syncthreads / __syncwarp as fiber barriers, warp shuffles
// and match through a per-warp exchange buffer. Fibers run in thread order up to their next
// barrier, so a block's execution is deterministic, and no OS thread waits on another. launch.cpp builds the
// host emulator (rackfill_kernels::cuda::exec::Emulator) on it: a grid's blocks one after another
// in the process, or all at once as forked processes (run_block in each), each with its own
// __shared__ variables, meeting only through global memory (shared mappings) and its atomics, as
// on a GPU. Tensor-core operations (mma.sync, ldmatrix) are warp collectives over the PTX ISA's
// fragment layouts; cp.async copies land at cp.async.wait_group. What it cannot show: the GPU's
// weaker memory ordering (x86's is stronger), memory across GPUs, real warp scheduling, the
// tensor cores' own rounding of a sum.
// Kernel sources test this to take their host stand-ins for inline PTX.
#define RACKFILL_HOST_EMULATOR 1

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

struct Idx { unsigned x, y, z; };
// The running fiber's thread index (set by the scheduler before it resumes a fiber).
static Idx threadIdx;
static Idx blockIdx{0};  // per process: one block per process in a concurrent grid
static Idx blockDim{0, 1, 1};
static Idx gridDim{1, 1, 1};
static unsigned char* g_smem;

// Warp-synchronous operations (shuffles, matches, reductions, warp barriers) the running thread
// has run, and the most any thread of the block ran: the length of a kernel's warp-level
// critical path, a count the emulator reports per launch (not a time).
static unsigned long long t_warp_ops = 0;
static std::atomic<unsigned long long> g_max_warp_ops{0};

// A fiber's saved context: its stack pointer, with the callee-saved registers pushed below it
// (x86-64: emu_switch); elsewhere a ucontext.
#if defined(__x86_64__)
struct FiberContext { void* sp = nullptr; };
// Saves the callee-saved registers and the stack pointer into *from, then resumes `to`.
extern "C" void emu_switch(void** from, void* to);
asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
inline void fiber_switch(FiberContext& from, FiberContext& to) { emu_switch(&from.sp, to.sp); }
// A context that starts `entry` on the stack `[stack, stack + size)`: a return address for
// emu_switch's `ret`, six zero registers below it, and a 16-byte aligned frame at entry.
inline void fiber_init(FiberContext& ctx, char* stack, size_t size, void (*entry)()) {
    auto* top = (void**)(((unsigned long long)(stack + size)) & ~15ull);
    *--top = nullptr;  // entry's own return address, never used: it ends by switching away
    *--top = (void*)entry;
    for (int i = 0; i < 6; ++i) *--top = nullptr;
    ctx.sp = top;
}
#else
struct FiberContext { ucontext_t uc; };
inline void fiber_switch(FiberContext& from, FiberContext& to) { swapcontext(&from.uc, &to.uc); }
inline void fiber_init(FiberContext& ctx, char* stack, size_t size, void (*entry)()) {
    getcontext(&ctx.uc);
    ctx.uc.uc_stack.ss_sp = stack;
    ctx.uc.uc_stack.ss_size = size;
    ctx.uc.uc_link = nullptr;
    makecontext(&ctx.uc, entry, 0);
}
#endif

// The fibers of the block that runs now: one per CUDA thread, run in thread order on this OS
// thread until each reaches a barrier (or ends); a barrier releases once every thread of its
// scope that has not ended has reached it.
struct Fibers {
    enum State : unsigned char { Run, AtBlock, AtWarp, Done };
    static constexpr size_t STACK = 256 * 1024;
    unsigned n = 0;
    std::vector<FiberContext> ctx;
    std::vector<char*> stacks;
    std::vector<State> state;
    std::vector<unsigned long long> ops;
    FiberContext scheduler;
    unsigned cur = 0, done = 0, at_block = 0;
    std::vector<unsigned> at_warp;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
};
static Fibers g_fibers;

// Switches from the running fiber to the scheduler, leaving it in `state`.
inline void fiber_park(Fibers::State state) {
    Fibers& f = g_fibers;
    f.state[f.cur] = state;
    f.ops[f.cur] = t_warp_ops;
    fiber_switch(f.ctx[f.cur], f.scheduler);
}
inline void block_sync() {
    ++g_fibers.at_block;
    fiber_park(Fibers::AtBlock);
}
// A warp's exchange buffer: each lane's value for a shuffle, match or reduction.
struct WarpX { unsigned long long x[32]; };
static std::vector<WarpX> g_warps;
inline unsigned t_warp() { return threadIdx.x / 32; }
inline void warp_barrier() {
    ++g_fibers.at_warp[t_warp()];
    fiber_park(Fibers::AtWarp);
}
inline void warp_sync() {
    ++t_warp_ops;
    warp_barrier();
}
#define __syncthreads() block_sync()
#define __syncwarp() warp_sync()
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
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
    WarpX* w = &g_warps[t_warp()];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    warp_barrier();
    T r = from_lane_bits<T>(w->x[lane ^ o]);
    warp_barrier();
    return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src) {
    WarpX* w = &g_warps[t_warp()];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    warp_barrier();
    T r = from_lane_bits<T>(w->x[src & 31]);
    warp_barrier();
    return r;
}
template <class T> T __shfl_down_sync(unsigned, T v, int o) {
    WarpX* w = &g_warps[t_warp()];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    warp_barrier();
    T r = lane + o < 32 ? from_lane_bits<T>(w->x[lane + o]) : v;
    warp_barrier();
    return r;
}
template <class T> T __shfl_up_sync(unsigned, T v, int o) {
    WarpX* w = &g_warps[t_warp()];
    ++t_warp_ops;
    int lane = threadIdx.x & 31;
    w->x[lane] = to_lane_bits(v);
    warp_barrier();
    T r = lane >= o ? from_lane_bits<T>(w->x[lane - o]) : v;
    warp_barrier();
    return r;
}
inline unsigned __match_any_sync(unsigned, unsigned k) {
    WarpX* w = &g_warps[t_warp()];
    ++t_warp_ops;
    unsigned lane = threadIdx.x & 31;
    w->x[lane] = k;
    warp_barrier();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i)
        if ((unsigned)w->x[i] == k) m |= 1u << i;
    warp_barrier();
    return m;
}
template <class Op> unsigned reduce_warp(unsigned v, Op op) {
    WarpX* w = &g_warps[t_warp()];
    ++t_warp_ops;
    const unsigned lane = threadIdx.x & 31, first = threadIdx.x - lane;
    const unsigned lanes = std::min(32u, blockDim.x - first);
    w->x[lane] = v;
    warp_barrier();
    unsigned r = (unsigned)w->x[0];
    for (unsigned i = 1; i < lanes; ++i) r = op(r, (unsigned)w->x[i]);
    warp_barrier();
    return r;
}
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
    return reduce_warp(v, [](unsigned a, unsigned b) { return a < b ? a : b; });
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    return reduce_warp(v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
// A warp's operands for the tensor-core operations: each lane's A and B fragment registers
// (mma) or the shared-memory row address it gives (ldmatrix).
struct WarpFragments {
    unsigned a[32][4];
    unsigned b[32][2];
    const unsigned char* row[32];
    // A . B of an mma, computed once by the first lane to run after the barrier.
    bool product_ready;
    float product[16][8];
};
// Two per warp, used in turn: a lane's next collective writes the other one, so a lane that
// runs ahead cannot overwrite operands a slower lane is still reading (it would have to pass
// the next collective's barrier first, which waits for that lane), and each collective needs
// one barrier instead of two.
static std::vector<WarpFragments> g_fragments;
static std::vector<unsigned char> g_fragment_turn;  // per thread: which of its warp's two is next
inline WarpFragments& next_fragments() {
    unsigned char& turn = g_fragment_turn[threadIdx.x];
    WarpFragments& w = g_fragments[2 * t_warp() + turn];
    turn ^= 1;
    return w;
}
inline float bf16_bits_to_f32(unsigned bits) {
    const unsigned u = (bits & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 as the PTX ISA lays out its fragments: every lane
// publishes its registers; after the warp's barrier the first lane to run forms the 16x8
// product A . B from the whole warp's fragments (products of bf16 are exact in f32; each sum runs
// in k order), and every lane adds its four elements of it to its accumulators.
inline void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    WarpFragments& w = next_fragments();
    ++t_warp_ops;
    const unsigned lane = threadIdx.x & 31;
    std::memcpy(w.a[lane], a, sizeof w.a[lane]);
    std::memcpy(w.b[lane], b, sizeof w.b[lane]);
    w.product_ready = false;
    warp_barrier();
    if (!w.product_ready) {
        float am[16][16], bm[16][8];
        for (unsigned l = 0; l < 32; ++l) {
            const unsigned group = l >> 2, pair = l & 3;
            for (unsigned r = 0; r < 4; ++r)
                for (unsigned h = 0; h < 2; ++h) {
                    const unsigned row = group + 8 * (r & 1), col = 2 * pair + h + 8 * (r >> 1);
                    am[row][col] = bf16_bits_to_f32(w.a[l][r] >> (16 * h));
                }
            for (unsigned r = 0; r < 2; ++r)
                for (unsigned h = 0; h < 2; ++h) bm[2 * pair + h + 8 * r][group] = bf16_bits_to_f32(w.b[l][r] >> (16 * h));
        }
        for (unsigned row = 0; row < 16; ++row)
            for (unsigned col = 0; col < 8; ++col) {
                float sum = 0.0f;
                for (unsigned k = 0; k < 16; ++k) sum += am[row][k] * bm[k][col];
                w.product[row][col] = sum;
            }
        w.product_ready = true;
    }
    const unsigned group = lane >> 2, pair = lane & 3;
    for (unsigned i = 0; i < 4; ++i) d[i] += w.product[group + (i >= 2 ? 8 : 0)][2 * pair + (i & 1)];
}
// ldmatrix.sync.m8n8.x4(.trans).shared.b16: lanes 8i .. 8i + 7 give matrix i's row addresses.
inline void ldmatrix_x4_emulated(unsigned* r, const void* row, bool trans) {
    WarpFragments& w = next_fragments();
    ++t_warp_ops;
    const unsigned lane = threadIdx.x & 31;
    w.row[lane] = static_cast<const unsigned char*>(row);
    warp_barrier();
    for (unsigned m = 0; m < 4; ++m) {
        unsigned short lo, hi;
        if (!trans) {
            const unsigned char* at = w.row[8 * m + lane / 4] + 4 * (lane & 3);
            std::memcpy(&lo, at, 2);
            std::memcpy(&hi, at + 2, 2);
        } else {
            const unsigned col = 2 * (lane / 4);
            std::memcpy(&lo, w.row[8 * m + 2 * (lane & 3)] + col, 2);
            std::memcpy(&hi, w.row[8 * m + 2 * (lane & 3) + 1] + col, 2);
        }
        r[m] = lo | ((unsigned)hi << 16);
    }
}
inline void ldmatrix_x4(unsigned* r, const void* row) { ldmatrix_x4_emulated(r, row, false); }
inline void ldmatrix_x4_trans(unsigned* r, const void* row) { ldmatrix_x4_emulated(r, row, true); }
// cp.async as the PTX ISA defines its visibility: a thread's copies are queued in groups and
// land only when cp.async.wait_group lets their group complete, so a kernel that reads a tile
// before waiting for it reads stale shared memory here too.
struct AsyncCopy {
    void* dst;
    const void* src;
    bool full;
};
struct AsyncGroups {
    std::vector<AsyncCopy> open;
    std::vector<std::vector<AsyncCopy>> committed;
};
static std::vector<AsyncGroups> g_async;
inline void cp_async_16(void* dst, const void* src, bool full) {
    g_async[threadIdx.x].open.push_back(AsyncCopy{dst, src, full});
}
inline void cp_async_commit() {
    AsyncGroups& g = g_async[threadIdx.x];
    g.committed.push_back(std::move(g.open));
    g.open.clear();
}
template <int N> inline void cp_async_wait() {
    AsyncGroups& g = g_async[threadIdx.x];
    while (g.committed.size() > (size_t)N) {
        for (const AsyncCopy& c : g.committed.front()) {
            if (c.full) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        g.committed.erase(g.committed.begin());
    }
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd_system(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) {
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
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
    fiber_park(Fibers::Run);  // other threads of the block run first
    std::this_thread::yield();  // and other blocks' processes (a concurrent grid)
}
inline unsigned long long host_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// The body of every fiber: the kernel, then the end of the thread.
static void fiber_main() {
    Fibers& f = g_fibers;
    t_warp_ops = 0;
    f.body(f.body_arg);
    f.state[f.cur] = Fibers::Done;
    f.ops[f.cur] = t_warp_ops;
    ++f.done;
    fiber_switch(f.ctx[f.cur], f.scheduler);  // never resumed
}

// Releases the barriers every live thread of their scope has reached; false when none could be.
static bool release_barriers() {
    Fibers& f = g_fibers;
    bool released = false;
    const unsigned live = f.n - f.done;
    if (live > 0 && f.at_block == live) {
        for (unsigned t = 0; t < f.n; ++t)
            if (f.state[t] == Fibers::AtBlock) f.state[t] = Fibers::Run;
        f.at_block = 0;
        released = true;
    }
    for (unsigned w = 0; w < f.at_warp.size(); ++w) {
        if (f.at_warp[w] == 0) continue;
        unsigned lanes = 0;
        for (unsigned t = 32 * w; t < std::min(f.n, 32 * w + 32); ++t) lanes += f.state[t] != Fibers::Done;
        if (f.at_warp[w] == lanes) {
            for (unsigned t = 32 * w; t < std::min(f.n, 32 * w + 32); ++t)
                if (f.state[t] == Fibers::AtWarp) f.state[t] = Fibers::Run;
            f.at_warp[w] = 0;
            released = true;
        }
    }
    return released;
}

// Runs `f` as the block blockIdx names, `threads` threads (fibers), on this thread.
template <class F> void run_fibers(unsigned threads, F f) {
    blockDim = Idx{threads, 1, 1};
    const unsigned block = blockIdx.x;
    Fibers& fb = g_fibers;
    fb.body = [](void* arg) { (*static_cast<F*>(arg))(); };
    fb.body_arg = &f;
    fb.n = threads;
    while (fb.stacks.size() < threads) fb.stacks.push_back(new char[Fibers::STACK]);
    fb.ctx.resize(threads);
    fb.state.assign(threads, Fibers::Run);
    fb.ops.assign(threads, 0);
    fb.at_warp.assign((threads + 31) / 32, 0);
    fb.done = fb.at_block = 0;
    g_warps.assign((threads + 31) / 32, WarpX{});
    g_fragments.assign(2 * ((threads + 31) / 32), WarpFragments{});
    g_fragment_turn.assign(threads, 0);
    g_async.assign(threads, AsyncGroups{});
    for (unsigned t = 0; t < threads; ++t) fiber_init(fb.ctx[t], fb.stacks[t], Fibers::STACK, fiber_main);
    while (fb.done < threads) {
        bool ran = false;
        for (unsigned t = 0; t < threads; ++t) {
            if (fb.state[t] != Fibers::Run) continue;
            fb.cur = t;
            threadIdx = Idx{t, 0, 0};
            t_warp_ops = fb.ops[t];
            fiber_switch(fb.scheduler, fb.ctx[t]);
            ran = true;
        }
        if (!release_barriers() && !ran && fb.done < threads) {
            std::fprintf(stderr, "emulator: block %u deadlocked (a barrier some threads never reach)\n", block);
            std::abort();
        }
    }
    unsigned long long most = g_max_warp_ops.load();
    for (unsigned long long ops : fb.ops)
        while (ops > most && !g_max_warp_ops.compare_exchange_weak(most, ops)) {}
}

// Runs `f` as block `block` of a one-dimensional `grid`-block grid, `threads` threads.
template <class F> void run_block(unsigned threads, F f, unsigned block = 0, unsigned grid = 1) {
    blockIdx = Idx{block, 0, 0};
    gridDim = Idx{grid, 1, 1};
    run_fibers(threads, f);
}
