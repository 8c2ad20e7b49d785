// Ready flags between ranks of a group in peer memory (kernels/src/cuda/moe/peers.rs): after
// a rank's copies into its peers' windows, `peer_signal` raises its word in every rank's flag
// array; a rank's stream then runs `peer_wait` before it reads what its peers wrote. Words are
// epochs (each layer a lane runs raises them by one), so flags are never reset and a late
// waiter cannot miss a signal.
//
// Flag array of a rank: `[signal][source rank]` u32 words. Every wait is bounded: after
// `timeout_ns` it records the first source that never signalled in `stalled` (source + 1) and
// returns, and the host fails the layer, naming the rank, instead of the GPU spinning forever.

// `flags[r]`: rank r's flag array (a peer address). Sets word `word` of every rank's array to
// `value`, after everything this stream wrote before (the stream's copies have completed when
// the kernel starts; the fence orders any earlier stores of this grid). One thread per rank.
extern "C" __global__ void peer_signal(const u64* flags, u32 ranks, u32 word, u32 value) {
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= ranks) return;
    __threadfence_system();
    st_release_sys_u32((u32*)flags[r] + word, value);
}

// Waits until words `first .. first + count` of this rank's flag array reach `value`, or
// `timeout_ns` passes: then `stalled` gets the first late word's index in the array + 1 (the
// signal and the source rank that never raised it) and the wait gives up. One thread per word.
extern "C" __global__ void peer_wait(const u32* flags, u32 first, u32 count, u32 value, u64 timeout_ns,
                                     u32* stalled) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const u64 start = global_ns();
    while (ld_acquire_sys_u32(flags + first + i) < value) {
        if (ld_acquire_sys_u32(stalled) != 0 || global_ns() - start > timeout_ns) {
            atomicCAS(stalled, 0u, first + i + 1);
            return;
        }
    }
    __threadfence_system();
}
