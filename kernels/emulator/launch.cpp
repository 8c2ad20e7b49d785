// The kernel launcher of rackfill's host emulator (rackfill_kernels::cuda::exec::Emulator): every
// kernel source (kernels.inc, prepared by the Rust side) compiled as host C++ against emu.h into
// a shared library loaded into the process. `emu_launch` runs a launch the way cuLaunchKernel
// describes one (a grid, a 1-D block, dynamic shared memory, one pointer per parameter):
//
// - by default block after block, each block on a pool of std::threads, one per CUDA thread,
//   kept across blocks and launches (spawning a block's threads afresh cost more than running
//   it);
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

// Folds this thread's warp-synchronous operation count into the launch's maximum.
static void publish_warp_ops() {
    unsigned long long most = g_max_warp_ops.load();
    while (t_warp_ops > most && !g_max_warp_ops.compare_exchange_weak(most, t_warp_ops)) {}
}

// The threads of a block, reused block after block: thread t is CUDA thread t. Resized (its
// threads, the block barrier and the warp barriers made anew) when a launch asks for another
// block size.
struct BlockPool {
    unsigned size = 0;
    std::vector<std::thread> threads;
    std::barrier<>* go = nullptr;
    std::barrier<>* done = nullptr;
    std::function<void()> body;
    bool quit = false;

    void resize(unsigned n) {
        if (n == size) return;
        stop();
        size = n;
        go = new std::barrier<>(n + 1);
        done = new std::barrier<>(n + 1);
        g_block = new std::barrier<>(n);
        for (auto* w : g_warps) { delete w->bar; delete w; }
        g_warps.clear();
        for (unsigned i = 0; i < (n + 31) / 32; ++i) {
            auto* x = new WarpX;
            x->bar = new std::barrier<>(std::min(32u, n - 32 * i));
            g_warps.push_back(x);
        }
        for (unsigned t = 0; t < n; ++t)
            threads.emplace_back([this, t] {
                threadIdx.x = t;
                t_warp = t / 32;
                for (;;) {
                    go->arrive_and_wait();
                    if (quit) return;
                    t_warp_ops = 0;
                    body();
                    publish_warp_ops();
                    done->arrive_and_wait();
                }
            });
    }

    void stop() {
        if (size == 0) return;
        quit = true;
        go->arrive_and_wait();
        for (auto& t : threads) t.join();
        threads.clear();
        delete go;
        delete done;
        delete g_block;
        quit = false;
        size = 0;
    }

    // Runs `f` on every thread of the block; returns when all have finished.
    void run(std::function<void()> f) {
        body = std::move(f);
        go->arrive_and_wait();
        done->arrive_and_wait();
    }

    ~BlockPool() { stop(); }
};

static BlockPool g_pool;

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
        blockDim = Idx{threads, 1, 1};
        g_pool.resize(threads);
        for (unsigned z = 0; z < gz; ++z)
            for (unsigned y = 0; y < gy; ++y)
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = Idx{x, y, z};
                    g_pool.run([&] { entry->call(entry->fn, args); });
                }
        g_smem = nullptr;
    }
    stats->backoffs = counters ? counters[0] : 0;
    stats->max_warp_ops = g_max_warp_ops.load();
    g_backoffs = nullptr;
    return status;
}
