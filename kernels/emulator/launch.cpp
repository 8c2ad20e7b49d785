// The kernel launcher of rackfill's host emulator (rackfill_kernels::cuda::exec::Emulator): every
// kernel source (kernels.inc, prepared by the Rust side) compiled as host C++ against emu.h into
// a shared library loaded into the process. `emu_launch` runs a launch the way cuLaunchKernel
// describes one (a grid, a 1-D block, dynamic shared memory, one pointer per parameter):
//
// - by default block after block on the calling thread, each CUDA thread a fiber (emu.h);
// - with `concurrent_blocks`, every block at once, each a forked process with its own
//   `__shared__` variables and dynamic shared memory; blocks then meet only through global
//   memory (the emulator's device memory is a shared mapping), as on a GPU. What the replica
//   streaming test uses to make relay chunks cross blocks that really run side by side.
#include "emu.h"

#include <cstddef>
#include <functional>
#include <type_traits>
#include <utility>

#include "kernels.inc"

// Calls a kernel of any signature with cuLaunchKernel's parameter array: args[i] points to the
// value of parameter i, of exactly that parameter's type.
template <class F> struct Trampoline;
template <class... A> struct Trampoline<void(A...)> {
    template <std::size_t... I> static void call_with(void* fn, void** args, std::index_sequence<I...>) {
        ((void (*)(A...))fn)(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
    }
    static void call(void* fn, void** args) { call_with(fn, args, std::index_sequence_for<A...>{}); }
};

struct Entry {
    const char* name;
    void* fn;
    void (*call)(void*, void**);
};

#define KERNEL(k) Entry{#k, (void*)&k, &Trampoline<decltype(k)>::call},
static const Entry g_entries[] = {
#include "entries.inc"
    Entry{nullptr, nullptr, nullptr}};

// What a launch may change about the emulation (rackfill_kernels::cuda::exec::EmulatorSettings).
struct EmuSettings {
    unsigned concurrent_blocks;
    unsigned fence_delay_us;
    unsigned long long tile_stall_ns;
    unsigned packed_keys;
    unsigned reserved;
};

// What a launch observed: wait-loop back-offs over every block, and the most warp-synchronous
// operations any thread ran.
struct EmuStats {
    unsigned long long backoffs;
    unsigned long long max_warp_ops;
};

// Counters every forked block adds to: one shared page.
static unsigned long long* shared_counters() {
    static unsigned long long* page = [] {
        void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? nullptr : (unsigned long long*)p;
    }();
    return page;
}

// Runs every block of the grid at once, each in a forked process; false if one died.
static bool run_concurrent(const Entry* entry, void** args, unsigned blocks, unsigned threads,
                           unsigned long long shared_bytes) {
    std::fflush(nullptr);
    std::vector<pid_t> kids;
    for (unsigned b = 0; b < blocks; ++b) {
        const pid_t pid = fork();
        if (pid < 0) break;
        if (pid == 0) {
            std::vector<unsigned char> smem(shared_bytes + 16);
            g_smem = smem.data();
            run_block(threads, [&] { entry->call(entry->fn, args); }, b, blocks);
            _exit(0);  // no atexit handlers, no destructors of the parent's thread pool
        }
        kids.push_back(pid);
    }
    bool ok = kids.size() == blocks;
    for (pid_t k : kids) {
        int status = 0;
        ok &= waitpid(k, &status, 0) == k && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return ok;
}

// 0: ran; 1: no kernel of that name; 2: a block of more than 1024 threads or an empty grid, or a
// concurrent grid that is not one-dimensional; 3: a block of a concurrent grid died.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                          unsigned long long shared_bytes, void** args, const EmuSettings* settings,
                          EmuStats* stats) {
    const Entry* entry = nullptr;
    for (const Entry* e = g_entries; e->name; ++e)
        if (std::strcmp(e->name, name) == 0) entry = e;
    if (!entry) return 1;
    if (threads == 0 || threads > 1024 || gx == 0 || gy == 0 || gz == 0) return 2;
    g_fence_delay_us = settings->fence_delay_us;
    g_tile_stall_ns = settings->tile_stall_ns;
    g_emu_packed_keys = settings->packed_keys != 0;
    unsigned long long* counters = shared_counters();
    if (counters) counters[0] = 0;
    g_backoffs = counters;
    g_max_warp_ops = 0;
    int status = 0;
    if (settings->concurrent_blocks && gx > 1) {
        if (gy != 1 || gz != 1) return 2;
        gridDim = Idx{gx, 1, 1};
        blockDim = Idx{threads, 1, 1};
        if (!run_concurrent(entry, args, gx, threads, shared_bytes)) status = 3;
    } else {
        std::vector<unsigned char> shared(shared_bytes + 16);
        g_smem = shared.data();
        gridDim = Idx{gx, gy, gz};
        for (unsigned z = 0; z < gz; ++z)
            for (unsigned y = 0; y < gy; ++y)
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = Idx{x, y, z};
                    run_fibers(threads, [&] { entry->call(entry->fn, args); });
                }
        g_smem = nullptr;
    }
    stats->backoffs = counters ? counters[0] : 0;
    stats->max_warp_ops = g_max_warp_ops.load();
    g_backoffs = nullptr;
    return status;
}

// What cuBLAS computes for one strided batched GEMM (rackfill_kernels::cuda::exec::Gemm): c =
// alpha * a * op(b) + beta * c per batch, a `m x k`, c `m x n`, b stored `n x k` (b_layout 0,
// a linear layer's weight) or `k x n` (1), row-major with leading dimensions and batch strides
// in elements; dtype 0 is f32, 1 is bf16 (read widened, written rounded to nearest even). The
// sum runs over k in order in f32.
static inline float emu_load(const void* p, unsigned dtype, unsigned long long i) {
    if (dtype == 0) return ((const float*)p)[i];
    const unsigned u = (unsigned)((const unsigned short*)p)[i] << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline void emu_store(void* p, unsigned dtype, unsigned long long i, float v) {
    if (dtype == 0) {
        ((float*)p)[i] = v;
        return;
    }
    unsigned u;
    std::memcpy(&u, &v, 4);
    unsigned short b = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    ((unsigned short*)p)[i] = b;
}

struct EmuMatrix {
    unsigned long long ptr, ld, batch_stride;
    unsigned dtype, reserved;
};

extern "C" void emu_gemm(unsigned long long m, unsigned long long n, unsigned long long k, unsigned long long batch,
                         const EmuMatrix* a, const EmuMatrix* b, unsigned b_layout, const EmuMatrix* c, float alpha,
                         float beta) {
    const unsigned long long sa = a->dtype ? 2 : 4, sb = b->dtype ? 2 : 4, sc = c->dtype ? 2 : 4;
    for (unsigned long long z = 0; z < batch; ++z) {
        const char* A = (const char*)a->ptr + z * a->batch_stride * sa;
        const char* B = (const char*)b->ptr + z * b->batch_stride * sb;
        char* C = (char*)c->ptr + z * c->batch_stride * sc;
        for (unsigned long long row = 0; row < m; ++row)
            for (unsigned long long col = 0; col < n; ++col) {
                float acc = 0.0f;
                for (unsigned long long i = 0; i < k; ++i) {
                    const unsigned long long at = b_layout == 0 ? col * b->ld + i : i * b->ld + col;
                    acc += emu_load(A, a->dtype, row * a->ld + i) * emu_load(B, b->dtype, at);
                }
                const unsigned long long at = row * c->ld + col;
                const float old = beta == 0.0f ? 0.0f : emu_load(C, c->dtype, at);
                emu_store(C, c->dtype, at, alpha * acc + beta * old);
            }
    }
}
