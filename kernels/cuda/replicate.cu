// Replica weight distribution by persistent tile streaming (UltraEP §6.1) with chunk-streaming
// two-stage relay trees (§6.2).
//
// The task stream (TileTask / TileDst, common.cuh) is built on the device from the plan by
// `plan_tiles` (tile_plan.cu), or compiled on the host from any relay transfer schedule
// (rackfill_kernels::cuda::tiles, the reference): each task is one tile of one source chunk
// together with every destination that receives it, so the tile is read once, staged once in
// shared memory and stored to all of them. A persistent grid pulls tasks from the stream with
// one atomic counter. Each block double-buffers: while tile i is being stored, the block has
// already claimed task i+1 and, unless that task still waits on a relay, started its load
// (cp.async on sm_80+).
//
// Relays: a stage-1 tile that lands on a relay bumps the relay's per-chunk ready counter once the
// bytes are visible system-wide (the block synchronises, then one thread fences and adds).
// A stage-2 task (relay -> leaves) waits until its chunk's counter reaches the chunk's tile
// count, so a relay forwards chunk c while chunk c+1 is still arriving, with no global barrier.
// Tasks are ordered so that every producer precedes its consumers in the stream; the block
// holding the earliest unfinished task never waits, so the grid cannot deadlock, whatever the
// residency. A relay counter that still falls short after TILE_STALL_NS (a broken stream, never a
// slow one) stops the waiting block and raises the stall word next to the claim counter, and
// every other waiting block stops when it sees it: the host reports an error instead of the GPU
// spinning forever.
//
// Ranks are addressed through a peer-pointer table (home weights, slot buffer and flag array per
// rank), so the same kernel runs with NVLink peer pointers or with several rank buffers on one GPU.

// How long a block waits for a relay chunk before it declares the stream broken: far beyond the
// time to stream every byte before it (milliseconds), short enough to fail a test run.
#ifndef TILE_STALL_NS
#define TILE_STALL_NS 5000000000ull
#endif

__device__ __forceinline__ const u8* task_source(const TileTask& t, const u64* home_base, const u64* slot_base) {
    const u64 base = t.src_kind == 0 ? home_base[t.src_rank] : slot_base[t.src_rank];
    return (const u8*)(base + t.src_offset);
}

// Starts loading a task's tile into `stage`: 16-byte cp.async over the aligned body (all of it
// when the source is 16-byte aligned) and plain bytes for the rest.
__device__ void issue_load(const TileTask& t, const u64* home_base, const u64* slot_base, u8* stage) {
    const u8* src = task_source(t, home_base, slot_base);
    const u32 body = ((u64)src & 15ull) == 0 ? t.len & ~15u : 0;
    for (u32 i = threadIdx.x; i < body / 16; i += blockDim.x) cp_async_16(stage + 16 * i, src + 16 * i, true);
    for (u32 i = body + threadIdx.x; i < t.len; i += blockDim.x) stage[i] = src[i];
    cp_async_commit();
}

// Blocks until the relay chunk a task forwards has fully landed (block-uniform). False when it
// did not within TILE_STALL_NS, or another block found the stream broken: `stalled` is then set
// and the block must stop. `s_ok` is the block's shared word for the verdict.
__device__ bool wait_ready(const TileTask& t, const u64* flag_base, u32* stalled, u32* s_ok) {
    if (t.wait_flag < 0) return true;
    if (threadIdx.x == 0) {
        const u32* flag = (const u32*)flag_base[t.src_rank] + t.wait_flag;
        const u64 start = global_ns();
        u32 ok = 1;
        while (ld_acquire_sys_u32(flag) < t.wait_target) {
            if (ld_acquire_sys_u32(stalled) != 0 || global_ns() - start > TILE_STALL_NS) {
                atomicExch(stalled, 1u);
                ok = 0;
                break;
            }
            __nanosleep(64);
        }
        *s_ok = ok;
    }
    __syncthreads();
    return *s_ok != 0;
}

// The next task of the stream whose source rank is in `[src_lo, src_hi)` (`n_tasks` when none is
// left): claims skip the tasks other processes run. One thread.
__device__ u32 claim_task(const TileTask* tasks, u32 n_tasks, u32* next_task, u32 src_lo, u32 src_hi) {
    u32 c = atomicAdd(next_task, 1u);
    while (c < n_tasks && (tasks[c].src_rank < src_lo || tasks[c].src_rank >= src_hi)) c = atomicAdd(next_task, 1u);
    return c < n_tasks ? c : n_tasks;
}

// `next_task` holds two words: the claim counter, then the stall word (both zeroed by the host).
// `landed_base` (null: not counted) holds per rank the address of its byte counters, one per
// slot, zeroed by the host: every tile stored into a slot adds its length there, released like a
// relay counter, so a slot whose counter reaches the expert's bytes has fully landed
// (`wait_slot`). The launch runs only the tasks whose source rank is in `[src_lo, src_hi)`: the
// ranks whose buffers this process holds. Every process of a group runs the same stream over its
// own sources, pushing into its peers' slots and counters through the table's peer addresses;
// one process holding every rank runs it all.
extern "C" __global__ void __launch_bounds__(1024)
tile_stream(const TileTask* __restrict__ tasks, const u32* __restrict__ task_count, const TileDst* __restrict__ dsts,
            u32* next_task, const u64* __restrict__ home_base, const u64* __restrict__ slot_base,
            const u64* __restrict__ flag_base, u32 tile_bytes, const u64* __restrict__ landed_base,
            u64 slot_bytes, u32 src_lo, u32 src_hi) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ u32 s_claim;
    __shared__ u32 s_ready;
    __shared__ u32 s_ok;
    u32* stalled = next_task + 1;
    u8* stage[2] = {smem, smem + tile_bytes};
    const u32 tid = threadIdx.x, bd = blockDim.x;
    const u32 n_tasks = *task_count;  // written on the device by plan_tiles, or uploaded

    if (tid == 0) s_claim = claim_task(tasks, n_tasks, next_task, src_lo, src_hi);
    __syncthreads();
    u32 cur = s_claim;
    u32 buf = 0;
    if (cur < n_tasks) {
        if (!wait_ready(tasks[cur], flag_base, stalled, &s_ok)) return;
        issue_load(tasks[cur], home_base, slot_base, stage[0]);
    }
    while (cur < n_tasks) {
        const TileTask t = tasks[cur];
        __syncthreads();  // every thread has read s_claim for `cur`
        if (tid == 0) s_claim = claim_task(tasks, n_tasks, next_task, src_lo, src_hi);
        __syncthreads();
        const u32 nxt = s_claim;
        bool prefetched = false;
        if (nxt < n_tasks) {
            // Start the next load now unless it waits on a relay chunk that has not landed.
            if (tid == 0) {
                const TileTask& n = tasks[nxt];
                s_ready = n.wait_flag < 0 ||
                          ld_acquire_sys_u32((const u32*)flag_base[n.src_rank] + n.wait_flag) >= n.wait_target;
            }
            __syncthreads();
            prefetched = s_ready != 0;
            if (prefetched) issue_load(tasks[nxt], home_base, slot_base, stage[buf ^ 1]);
        }
        if (prefetched) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // tile `cur` is in stage[buf] for every thread

        // Store the staged tile to every destination of its group.
        const u8* st = stage[buf];
        for (u32 d = 0; d < t.n_dst; ++d) {
            const TileDst dst = dsts[t.dst_begin + d];
            u8* out = (u8*)(slot_base[dst.rank] + dst.offset + t.tile_offset);
            const u32 body = ((u64)out & 15ull) == 0 ? t.len & ~15u : 0;
            for (u32 i = tid; i < body / 16; i += bd) ((uint4*)out)[i] = ((const uint4*)st)[i];
            for (u32 i = body + tid; i < t.len; i += bd) out[i] = st[i];
        }
        __syncthreads();  // every thread's stores of this tile are done
        if (tid == 0) {
            // Release: the barrier orders the block's stores before this thread's system-scope
            // fence, the fence orders them before the counter bumps a relay acquires.
            bool fenced = false;
            for (u32 d = 0; d < t.n_dst; ++d) {
                const TileDst dst = dsts[t.dst_begin + d];
                if (dst.ready_flag < 0 && landed_base == nullptr) continue;
                if (!fenced) {
                    __threadfence_system();
                    fenced = true;
                }
                if (dst.ready_flag >= 0) atomicAdd_system((u32*)flag_base[dst.rank] + dst.ready_flag, 1u);
                if (landed_base != nullptr && slot_bytes != 0) {
                    const u64 slot = (dst.offset + t.tile_offset) / slot_bytes;
                    atomicAdd_system((u32*)landed_base[dst.rank] + slot, t.len);
                }
            }
        }
        if (nxt < n_tasks && !prefetched) {
            if (!wait_ready(tasks[nxt], flag_base, stalled, &s_ok)) return;
            issue_load(tasks[nxt], home_base, slot_base, stage[buf ^ 1]);
        }
        cur = nxt;
        buf ^= 1u;
    }
}

// Holds the stream it runs on until slot `index`'s landed-byte counter (see `tile_stream`)
// reaches `target`, so the GEMM queued behind it reads a replica that has fully landed while the
// rest still stream. Gives up when the tile stream stalled or after TILE_STALL_NS, raising the
// stall word: the host then fails the layer instead of trusting the slot. One thread.
extern "C" __global__ void wait_slot(const u32* landed, u32 index, u32 target, u32* stalled) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 start = global_ns();
    while (ld_acquire_sys_u32(landed + index) < target) {
        if (ld_acquire_sys_u32(stalled) != 0 || global_ns() - start > TILE_STALL_NS) {
            atomicExch(stalled, 1u);
            return;
        }
        __nanosleep(128);
    }
}
