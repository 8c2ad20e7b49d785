// The in-process kernel launcher of rackfill's host emulator (rackfill_kernels::cuda::exec::
// Emulator): the whole-model kernel sources (kernels.inc, prepared by the Rust side) compiled as
// host C++ against emu.h into a shared library. `emu_launch` runs a launch the way
// cuLaunchKernel describes one (a grid, a 1-D block, dynamic shared memory, one pointer per
// parameter), block after block, each block one std::thread per CUDA thread.
#include "emu.h"

#include <cstddef>
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
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx.y = y;
                blockIdx.z = z;
                run_block(threads, [&] { entry->call(entry->fn, args); }, x, gx);
            }
    g_smem = nullptr;
    return 0;
}
