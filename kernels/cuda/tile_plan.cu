// Replica distribution planned on the device (UltraEP §6.2: "the kernel builds the relay
// topology"). From a plan in device memory (the quota solver's outputs, or a host plan uploaded)
// `plan_tiles` builds the load-aware two-stage relay trees and compiles the chunked copies into
// the tile tasks `tile_stream` (replicate.cu) consumes, so nothing travels to the host between
// the solver and the weight streaming. It reproduces rackfill_balancer::relay::plan_transfers
// followed by rackfill_kernels::cuda::tiles::compile entry for entry
// (kernels/tests/device_kernels/tiles.rs compares them on random plans, on every executor: the
// host emulator in CI, the GPU where there is one).
//
// One block, latency first: the plan's instance arrays and every scratch array live in one arena,
// in shared memory whenever it fits (the host decides, TilePlanner::new), so the sequential steps
// read shared memory instead of waiting on global loads one after another. The per-expert pass
// (send volumes, hot experts) runs on every thread; thread 0 runs only what is sequential by
// nature and small (hot-expert order, relay choice, leaf attachment, group numbering:
// O(hot experts * fan-out * sqrt(fan-out) + replicas)); the sort of the copy edges and the
// emission of tasks and destinations, the bulk of the work, run on every thread again.
//
// Arithmetic: send volumes are plain sums; the host refuses geometries where they could exceed
// 64 bits (2 * replicas * expert_bytes), so they equal relay.rs's saturating sums.
//
// Notation: an edge is one replica's delivery (stage 1: from the expert's home; stage 2: from a
// relay), keyed (stage, expert, src, dst); a group is a run of edges with the same (stage,
// expert, src), whose source bytes are staged once and stored to every destination; every chunk
// of the expert repeats the groups, chunk-major.

struct TilePlanParams {
    u64 expert_bytes;
    u64 slot_bytes;
    u64 chunk_bytes;    // effective chunk, > 0 (the last chunk of an expert may be shorter)
    u32 n_chunks;
    u32 tile_bytes;
    u32 ranks;
    u32 experts;
    u32 n_slot;
    u32 threshold;      // experts with more replicas than this get a relay tree
    u32 task_capacity;
    u32 dst_capacity;
    u32 flag_capacity;  // ready counters per rank
    u32 edge_capacity;  // replicas a plan can have: ranks * n_slot
    u32 arena_in_shared;  // 1: the arena is dynamic shared memory, 0: the `global_arena` argument
    u32 reserved;
};

// header[0]: one of these; header[1..4]: tasks, destinations, groups (all zero unless TP_OK).
#define TP_OK 0u
#define TP_GUARD 1u  // the plan's producer (the quota solver) reported an error
#define TP_PLAN 2u   // the plan is malformed (instance offsets, ranks, a replica without a slot)
#define TP_TASKS 3u  // more tile tasks than the task buffer holds
#define TP_DSTS 4u   // more destinations than the destination buffer holds
#define TP_FLAGS 5u  // a relay needs more ready counters than each rank has

#define KEY_BITS 21u
#define KEY_MASK ((1ull << KEY_BITS) - 1ull)

// round(sqrt(fanout)), at least 1 (relay.rs relay_count).
__device__ u32 relay_count(u32 fanout) {
    u32 k = 0;
    while ((u64)(k + 1) * (k + 1) <= fanout) ++k;
    const u32 r = fanout - k * k > k ? k + 1 : k;
    return r > 0 ? r : 1;
}

// The first slot of `rank` holding `expert`, -1 if none.
__device__ i32 slot_of(const i32* slots, u32 n_slot, u32 rank, u32 expert) {
    for (u32 s = 0; s < n_slot; ++s)
        if (slots[(u64)rank * n_slot + s] == (i32)expert) return (i32)s;
    return -1;
}

__device__ __forceinline__ u64 edge_key(u32 stage, u32 expert, u32 src, u32 dst) {
    return ((u64)(stage - 1) << 63) | ((u64)expert << (2 * KEY_BITS)) | ((u64)src << KEY_BITS) | dst;
}
__device__ __forceinline__ u32 key_stage(u64 k) { return (u32)(k >> 63) + 1; }
__device__ __forceinline__ u32 key_expert(u64 k) { return (u32)((k >> (2 * KEY_BITS)) & KEY_MASK); }
__device__ __forceinline__ u32 key_src(u64 k) { return (u32)((k >> KEY_BITS) & KEY_MASK); }
__device__ __forceinline__ u32 key_dst(u64 k) { return (u32)(k & KEY_MASK); }

// The arena: the plan's instance arrays (staged) and the scratch, carved from one byte buffer in
// this order; TilePlanParams::arena_bytes on the host computes the same size. I = experts +
// edge_capacity instances at most, C = edge_capacity edges at most.
struct TileScratch {
    u64* volume;       // [R] bytes each rank sends
    u64* key;          // [C] edge keys, by replica (instance order)
    u64* sorted_key;   // [C] edge keys, sorted
    u64* group_src;    // [C] byte offset of a group's chunk 0 in its source buffer
    u64* edge_dst;     // [C] byte offset of a sorted edge's slot in its destination buffer
    u32* inst_offsets; // [E + 1] staged from the plan
    u32* inst_rank;    // [I] staged from the plan
    i32* slots;        // [R * n_slot] staged from the plan
    u32* hot;          // [E] experts that get a relay tree, in tree order
    u32* parent;       // [I] rank that delivers a replica instance
    i32* forwards;     // [I] a relay instance: its index among its rank's forwarded experts; else -1
    u32* relays;       // [C] the current tree's relay instances
    u32* inst_of;      // [C] instance of an edge, by replica
    u32* sorted_inst;  // [C] instance of an edge, sorted
    u32* group_start;  // [C + 1] first sorted edge of each group
    i32* group_wait;   // [C] a relay group: the relay's forward index; else -1
    i32* edge_ready;   // [C] a sorted edge into a relay: the relay's forward index; else -1
};

__device__ TileScratch carve(const TilePlanParams& p, u8* arena) {
    const u64 R = p.ranks, E = p.experts, C = p.edge_capacity, I = E + C;
    TileScratch s;
    s.volume = (u64*)arena;
    s.key = s.volume + R;
    s.sorted_key = s.key + C;
    s.group_src = s.sorted_key + C;
    s.edge_dst = s.group_src + C;
    s.inst_offsets = (u32*)(s.edge_dst + C);
    s.inst_rank = s.inst_offsets + E + 1;
    s.slots = (i32*)(s.inst_rank + I);
    s.hot = (u32*)(s.slots + R * p.n_slot);
    s.parent = s.hot + E;
    s.forwards = (i32*)(s.parent + I);
    s.relays = (u32*)(s.forwards + I);
    s.inst_of = s.relays + C;
    s.sorted_inst = s.inst_of + C;
    s.group_start = s.sorted_inst + C;
    s.group_wait = (i32*)(s.group_start + C + 1);
    s.edge_ready = s.group_wait + C;
    return s;
}

// Every thread. Stages the plan's slots and instance offsets, then (once the offsets are checked)
// its instance ranks; returns false (a malformed plan) if the offsets do not fit the arena.
__device__ bool stage_plan(const TilePlanParams& p, const i32* slots, const u32* inst_offsets,
                           const u32* inst_rank, TileScratch& s, u32* s_ok) {
    const u32 tid = threadIdx.x, bd = blockDim.x, E = p.experts;
    for (u32 i = tid; i < p.ranks * p.n_slot; i += bd) s.slots[i] = slots[i];
    for (u32 e = tid; e <= E; e += bd) s.inst_offsets[e] = inst_offsets[e];
    if (tid == 0) {
        const u32 total = inst_offsets[E];
        *s_ok = inst_offsets[0] == 0 && total >= E && total - E <= p.edge_capacity;
    }
    __syncthreads();
    if (!*s_ok) return false;
    for (u32 j = tid; j < s.inst_offsets[E]; j += bd) s.inst_rank[j] = inst_rank[j];
    __syncthreads();
    return true;
}

// Every thread, one expert at a time. Checks each expert's instances, charges what the plan fixes
// before any tree is chosen (direct fan-out, and k seeding sends per hot expert) and lists the hot
// experts (in no particular order yet). Counts malformed experts in *bad.
__device__ void charge_send_volumes(const TilePlanParams& p, TileScratch& s, u32* n_hot, u32* bad) {
    const u32 R = p.ranks, E = p.experts, total = s.inst_offsets[E];
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) {
        const u32 begin = s.inst_offsets[e], end = s.inst_offsets[e + 1];
        if (end <= begin || end > total || s.inst_rank[begin] >= R) {
            atomicAdd(bad, 1u);
            continue;
        }
        const u32 home = s.inst_rank[begin];
        for (u32 j = begin; j < end; ++j) {
            if (s.inst_rank[j] >= R) atomicAdd(bad, 1u);
            s.parent[j] = home;
            s.forwards[j] = -1;
        }
        const u32 fanout = end - begin - 1;
        u32 sends = fanout;
        if (fanout > p.threshold) {
            s.hot[atomicAdd(n_hot, 1u)] = e;
            sends = relay_count(fanout);
        }
        if (sends > 0) atomicAdd(&s.volume[home], (u64)sends * p.expert_bytes);
    }
}

// Thread 0. Trees are planned by descending fan-out, ties lower expert id (insertion sort: the
// hot experts are few).
__device__ void order_hot_experts(const u32* inst_offsets, u32* hot, u32 n_hot) {
    for (u32 i = 1; i < n_hot; ++i) {
        const u32 e = hot[i], n = inst_offsets[e + 1] - inst_offsets[e];
        u32 at = i;
        while (at > 0) {
            const u32 prev = hot[at - 1], m = inst_offsets[prev + 1] - inst_offsets[prev];
            if (m > n || (m == n && prev < e)) break;
            hot[at] = prev;
            --at;
        }
        hot[at] = e;
    }
}

// Thread 0. One hot expert's tree: its k relays are the replica ranks with the smallest send
// volume (ties lower rank); each other replica, in instance order, hangs off the relay whose
// volume is smallest (ties lower rank), which is charged the forward.
__device__ void build_relay_tree(const TilePlanParams& p, u32 e, TileScratch& s) {
    const u32* inst_rank = s.inst_rank;
    const u32 begin = s.inst_offsets[e] + 1, end = s.inst_offsets[e + 1];
    const u32 k = relay_count(end - begin);
    for (u32 chosen = 0; chosen < k; ++chosen) {
        u32 best = end;
        for (u32 j = begin; j < end; ++j) {
            if (s.forwards[j] == -2) continue;
            const u32 r = inst_rank[j];
            if (best == end || s.volume[r] < s.volume[inst_rank[best]] ||
                (s.volume[r] == s.volume[inst_rank[best]] && r < inst_rank[best]))
                best = j;
        }
        s.forwards[best] = -2;  // a relay (its forward index comes with the groups)
        s.relays[chosen] = best;
    }
    for (u32 j = begin; j < end; ++j) {
        if (s.forwards[j] == -2) continue;
        u32 best = s.relays[0];
        for (u32 i = 1; i < k; ++i) {
            const u32 r = inst_rank[s.relays[i]], b = inst_rank[best];
            if (s.volume[r] < s.volume[b] || (s.volume[r] == s.volume[b] && r < b)) best = s.relays[i];
        }
        s.parent[j] = inst_rank[best];
        s.volume[inst_rank[best]] += p.expert_bytes;
    }
}

// Every thread. One edge per replica instance, keyed (stage, expert, src, dst); then each edge's
// place in key order, counted (ties by replica order, so the places are a permutation even for a
// malformed plan that puts an expert twice on one rank; plan_tiles rejects equal neighbours).
__device__ void sort_edges(const TilePlanParams& p, TileScratch& s, u32 n_edges) {
    const u32 *inst_offsets = s.inst_offsets, *inst_rank = s.inst_rank;
    for (u32 e = threadIdx.x; e < p.experts; e += blockDim.x) {
        const u32 home = inst_rank[inst_offsets[e]];
        for (u32 j = inst_offsets[e] + 1; j < inst_offsets[e + 1]; ++j) {
            const u32 q = j - e - 1;  // every expert before this one has exactly one main instance
            s.key[q] = edge_key(s.parent[j] == home ? 1 : 2, e, s.parent[j], inst_rank[j]);
            s.inst_of[q] = j;
        }
    }
    __syncthreads();
    for (u32 q = threadIdx.x; q < n_edges; q += blockDim.x) {
        const u64 k = s.key[q];
        u32 pos = 0;
        for (u32 o = 0; o < n_edges; ++o) pos += s.key[o] < k || (s.key[o] == k && o < q) ? 1u : 0u;
        s.sorted_key[pos] = k;
        s.sorted_inst[pos] = s.inst_of[q];
    }
}

// Thread 0. Cuts the sorted edges into groups; numbers each relay's forwarded experts in expert
// order (its ready counters, per chunk); resolves each group's source offset. Returns the group
// count, or sets *status.
__device__ u32 number_groups(const TilePlanParams& p, const u64* home_offsets, TileScratch& s, u32 n_edges,
                             u32* forwarded, u32* status) {
    const u32 *inst_offsets = s.inst_offsets, *inst_rank = s.inst_rank;
    u32 groups = 0;
    for (u32 q = 0; q < n_edges; ++q) {
        const u64 k = s.sorted_key[q];
        if (q > 0 && (k >> KEY_BITS) == (s.sorted_key[q - 1] >> KEY_BITS)) continue;
        const u32 e = key_expert(k), src = key_src(k);
        s.group_start[groups] = q;
        if (key_stage(k) == 1) {
            s.group_wait[groups] = -1;
            s.group_src[groups] = home_offsets[e];
        } else {
            const i32 slot = slot_of(s.slots, p.n_slot, src, e);
            if (slot < 0) {
                *status = TP_PLAN;
                return 0;
            }
            const i32 index = (i32)forwarded[src]++;
            for (u32 j = inst_offsets[e] + 1; j < inst_offsets[e + 1]; ++j)
                if (inst_rank[j] == src) s.forwards[j] = index;
            s.group_wait[groups] = index;
            s.group_src[groups] = (u64)slot * p.slot_bytes;
        }
        ++groups;
    }
    s.group_start[groups] = n_edges;
    return groups;
}

// Launched with 512 threads (TilePlanner): the bound lets the compiler use up to 128 registers.
extern "C" __global__ void __launch_bounds__(512)
plan_tiles(TilePlanParams p, const u64* __restrict__ guard, const i32* __restrict__ slots,
           const u32* __restrict__ inst_offsets, const u32* __restrict__ inst_rank,
           const u64* __restrict__ home_offsets, u8* global_arena, TileTask* __restrict__ tasks,
           TileDst* __restrict__ dsts, u32* header, u32* flags_per_rank) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ u32 s_status, s_hot, s_groups, s_bad, s_ok;
    const u32 tid = threadIdx.x, bd = blockDim.x;
    TileScratch s = carve(p, p.arena_in_shared ? smem : global_arena);
    // flags_per_rank counts each relay's forwarded experts until the end, then their counters.
    u32* forwarded = flags_per_rank;

    if (tid == 0) {
        s_status = guard[0] != 0 ? TP_GUARD : TP_OK;
        s_hot = 0;
        s_groups = 0;
        s_bad = 0;
        for (u32 i = 0; i < 4; ++i) header[i] = 0;
    }
    __syncthreads();
    if (s_status != TP_OK) {
        if (tid == 0) header[0] = s_status;
        return;
    }
    if (!stage_plan(p, slots, inst_offsets, inst_rank, s, &s_ok)) {
        if (tid == 0) header[0] = TP_PLAN;
        return;
    }
    for (u32 r = tid; r < p.ranks; r += bd) s.volume[r] = 0, forwarded[r] = 0;
    __syncthreads();
    charge_send_volumes(p, s, &s_hot, &s_bad);
    __syncthreads();
    if (s_bad != 0) {
        if (tid == 0) header[0] = TP_PLAN;
        return;
    }
    if (tid == 0) {
        order_hot_experts(s.inst_offsets, s.hot, s_hot);
        for (u32 h = 0; h < s_hot; ++h) build_relay_tree(p, s.hot[h], s);
    }
    __syncthreads();
    const u32 n_edges = s.inst_offsets[p.experts] - p.experts;
    sort_edges(p, s, n_edges);
    __syncthreads();
    for (u32 q = tid; q < n_edges; q += bd) {
        const u64 k = s.sorted_key[q];
        const i32 slot = slot_of(s.slots, p.n_slot, key_dst(k), key_expert(k));
        if (slot < 0 || (q > 0 && s.sorted_key[q - 1] == k)) atomicAdd(&s_bad, 1u);
        s.edge_dst[q] = (u64)(slot < 0 ? 0 : slot) * p.slot_bytes;
    }
    if (tid == 0)
        s_groups = number_groups(p, home_offsets, s, n_edges, forwarded, &s_status);
    __syncthreads();
    if (s_bad != 0 && s_status == TP_OK) s_status = TP_PLAN;  // the same value from every thread
    for (u32 q = tid; q < n_edges; q += bd) s.edge_ready[q] = s.forwards[s.sorted_inst[q]];

    // Geometry and capacity.
    const u32 G = s_groups, last = p.n_chunks - 1;
    const u64 tile = p.tile_bytes, chunk = p.chunk_bytes;
    const u64 last_len = p.expert_bytes - (u64)last * chunk;
    const u64 tiles_full = div_ceil_u64(chunk, tile), tiles_last = div_ceil_u64(last_len, tile);
    const u64 per_full = (u64)G * tiles_full;
    const u64 n_tasks = p.expert_bytes == 0 ? 0 : (u64)last * per_full + (u64)G * tiles_last;
    const u64 n_dsts = p.expert_bytes == 0 ? 0 : (u64)n_edges * p.n_chunks;
    __syncthreads();
    if (tid == 0 && s_status == TP_OK) {
        if (n_tasks > p.task_capacity) s_status = TP_TASKS;
        else if (n_dsts > p.dst_capacity) s_status = TP_DSTS;
        for (u32 r = 0; r < p.ranks && s_status == TP_OK; ++r)
            if ((u64)forwarded[r] * p.n_chunks > p.flag_capacity) s_status = TP_FLAGS;
    }
    __syncthreads();
    if (s_status != TP_OK) {
        if (tid == 0) header[0] = s_status;
        return;
    }

    for (u64 t = tid; t < n_tasks; t += bd) {
        const u32 c = last == 0 ? 0 : (u32)min_u64(t / per_full, last);
        const u64 rem = t - (u64)c * per_full;
        const u64 tiles_c = c == last ? tiles_last : tiles_full;
        const u32 g = (u32)(rem / tiles_c);
        const u64 at = (rem % tiles_c) * tile;
        const u64 len_c = c == last ? last_len : chunk;
        const u64 first = s.sorted_key[s.group_start[g]];
        const u32 src = key_src(first);
        TileTask task;
        task.src_offset = s.group_src[g] + (u64)c * chunk + at;
        task.tile_offset = at;
        task.src_rank = src;
        task.src_kind = key_stage(first) - 1;
        task.len = (u32)min_u64(tile, len_c - at);
        task.dst_begin = c * n_edges + s.group_start[g];
        task.n_dst = s.group_start[g + 1] - s.group_start[g];
        task.wait_flag = s.group_wait[g] < 0 ? -1 : (i32)(c * forwarded[src]) + s.group_wait[g];
        task.wait_target = s.group_wait[g] < 0 ? 0u : (u32)tiles_c;
        task.reserved = 0;
        tasks[t] = task;
    }
    for (u64 d = tid; d < n_dsts; d += bd) {
        const u32 c = (u32)(d / n_edges), q = (u32)(d % n_edges);
        const u32 rank = key_dst(s.sorted_key[q]);
        TileDst dst;
        dst.offset = s.edge_dst[q] + (u64)c * chunk;
        dst.rank = rank;
        dst.ready_flag = s.edge_ready[q] < 0 ? -1 : (i32)(c * forwarded[rank]) + s.edge_ready[q];
        dsts[d] = dst;
    }
    __syncthreads();  // every thread has read `forwarded`
    for (u32 r = tid; r < p.ranks; r += bd) flags_per_rank[r] = forwarded[r] * p.n_chunks;
    if (tid == 0) {
        header[1] = (u32)n_tasks;
        header[2] = (u32)n_dsts;
        header[3] = G;
    }
}
