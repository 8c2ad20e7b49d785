// The in-process kernel launcher of rackfill's host emulator (rackfill_kernels::cuda::exec::
// Emulator): the whole-model kernel sources (kernels.inc, prepared by the Rust side) compiled as
// host C++ against emu.h into a shared library. `emu_launch` runs a launch the way
// cuLaunchKernel describes one (a grid, a 1-D block, dynamic shared memory, one pointer per
// parameter), block after block, each block on a pool of std::threads, one per CUDA thread,
// kept across blocks and launches (spawning a block's threads afresh cost more than running it).
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
                    body();
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

// 0: ran; 1: no kernel of that name; 2: a block of more than 1024 threads or an empty grid.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                          unsigned long long shared_bytes, void** args) {
    const Entry* entry = nullptr;
    for (const Entry* e = g_entries; e->name; ++e)
        if (std::strcmp(e->name, name) == 0) entry = e;
    if (!entry) return 1;
    if (threads == 0 || threads > 1024 || gx == 0 || gy == 0 || gz == 0) return 2;
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
    return 0;
}
