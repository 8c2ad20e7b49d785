// The token side of one EP MoE layer on the GPU (UltraEP §5.2), mirroring the CPU reference
// rackfill_kernels::permute step for step:
//
//   source rank:  stable_rank_by_key(expert)  -> j, the pair's index among this rank's pairs of
//                                                its expert (token order, then top-k order)
//                 lookup_instance             -> instance by cumulative quota, destination rank
//                 stable_rank_by_key(dest)    -> row of the pair in its destination's buffer
//                 scatter_rows_bf16           -> the all-to-all send buffer, one segment per rank
//   destination:  instance_keys + stable_rank_by_key + scatter_rows_bf16
//                                             -> one block per (expert, instance): group_by_instance
//                 gather_rows_f32 (glue.cu)   -> outputs back in each sender's order
//   source rank:  combine_topk_rows (model.cu) -> sum of router weight x output in top-k order
//
// Everything here is integer bookkeeping plus copies: rows move bit for bit.

// Stable counting: out_pos[i] = number of j < i with keys[j] == keys[i]; out_offsets = exclusive
// prefix of the per-key counts (n_keys + 1 entries). Keys >= n_keys are counted in *out_bad and
// get out_pos NONE. One block; dynamic shared memory: (warps + 1) * n_keys u32.
extern "C" __global__ void __launch_bounds__(1024)
stable_rank_by_key(const u32* __restrict__ keys, u32 n, u32 n_keys, u32* __restrict__ out_pos,
                   u32* __restrict__ out_offsets, u32* out_bad) {
    extern __shared__ u32 shm[];
    const u32 tid = threadIdx.x, bd = blockDim.x, warps = bd >> 5, w = warp_id();
    u32* running = shm;          // per key: items seen in earlier tiles
    u32* hist = shm + n_keys;    // [warp][key]: count in this tile, then prefix
    for (u32 k = tid; k < n_keys; k += bd) running[k] = 0;
    for (u32 x = tid; x < warps * n_keys; x += bd) hist[x] = 0;
    u32 bad = 0;
    __syncthreads();
    for (u32 base = 0; base < n; base += bd) {
        const u32 i = base + tid;
        u32 k = NONE_U32;
        if (i < n) {
            k = keys[i];
            if (k >= n_keys) {
                ++bad;
                k = NONE_U32;
            }
        }
        const u32 peers = __match_any_sync(FULL_MASK, k);
        const u32 before = __popc(peers & lanemask_lt());
        const bool leader = (peers & lanemask_lt()) == 0;
        if (k != NONE_U32 && leader) hist[w * n_keys + k] = __popc(peers);
        __syncthreads();
        // Per key: warps in order, after everything earlier tiles saw. Entries without items stay 0.
        for (u32 kk = tid; kk < n_keys; kk += bd) {
            u32 run = running[kk];
            for (u32 ww = 0; ww < warps; ++ww) {
                const u32 c = hist[ww * n_keys + kk];
                if (c != 0) {
                    hist[ww * n_keys + kk] = run;
                    run += c;
                }
            }
            running[kk] = run;
        }
        __syncthreads();
        if (i < n) out_pos[i] = k == NONE_U32 ? NONE_U32 : hist[w * n_keys + k] + before;
        __syncthreads();
        if (k != NONE_U32 && leader) hist[w * n_keys + k] = 0;
        __syncthreads();
    }
    if (bad != 0) atomicAdd(out_bad, bad);
    // Exclusive prefix of the counts by warp 0: each lane sums a contiguous run of keys.
    if (w == 0) {
        const u32 lane = lane_id();
        const u32 per = (n_keys + 31) / 32;
        const u32 lo = min(lane * per, n_keys), hi = min(lo + per, n_keys);
        u32 sum = 0;
        for (u32 k = lo; k < hi; ++k) sum += running[k];
        u32 incl = sum;
        for (int o = 1; o < 32; o <<= 1) {
            u32 v = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= (u32)o) incl += v;
        }
        u32 run = incl - sum;
        for (u32 k = lo; k < hi; ++k) {
            out_offsets[k] = run;
            run += running[k];
        }
        if (lane == 31) out_offsets[n_keys] = incl;
    }
}

// rackfill_balancer::TokenAssignment::instance_of on the plan's device arrays (the quota solver's
// outputs, or a host plan uploaded in the same layout): the j-th pair of (src_rank, e) goes to the
// first instance whose cumulative quota exceeds j, clamped to the last instance. Experts out of
// range get dest NONE (the next stable_rank_by_key reports them as bad keys).
extern "C" __global__ void lookup_instance(const u32* __restrict__ experts, const u32* __restrict__ occ, u32 n,
                                           u32 src_rank, u32 n_experts, const u32* __restrict__ inst_offsets,
                                           const u32* __restrict__ inst_rank, const u32* __restrict__ split_offsets,
                                           const u64* __restrict__ cumulative, u32* __restrict__ out_instance,
                                           u32* __restrict__ out_dest) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const u32 e = experts[i];
        if (e >= n_experts) {
            out_instance[i] = NONE_U32;
            out_dest[i] = NONE_U32;
            continue;
        }
        const u32 first = inst_offsets[e];
        const u32 count = inst_offsets[e + 1] - first;
        const u32 block = split_offsets[e];
        u32 inst = 0;
        if (split_offsets[e + 1] != block) {
            const u64* row = cumulative + block + (u64)src_rank * count;
            const u64 j = occ[i];
            u32 lo = 0, hi = count;  // partition_point(end <= j)
            while (lo < hi) {
                const u32 mid = (lo + hi) >> 1;
                if (row[mid] <= j) lo = mid + 1; else hi = mid;
            }
            inst = min(lo, count - 1);
        }
        out_instance[i] = inst;
        out_dest[i] = inst_rank[first + inst];
    }
}

// Group key of each received row: its expert instance's global index (instance offsets ascend
// with the expert), so keys order groups by (expert, instance) as group_by_instance does. Rows
// whose instance is not computed on `rank` get NONE (reported as bad keys).
extern "C" __global__ void instance_keys(const u32* __restrict__ experts, const u32* __restrict__ instances, u32 n,
                                         u32 n_experts, u32 rank, const u32* __restrict__ inst_offsets,
                                         const u32* __restrict__ inst_rank, u32* __restrict__ out_key) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const u32 e = experts[i];
        u32 key = NONE_U32;
        if (e < n_experts) {
            const u32 first = inst_offsets[e];
            const u32 inst = instances[i];
            if (inst < inst_offsets[e + 1] - first && inst_rank[first + inst] == rank) key = first + inst;
        }
        out_key[i] = key;
    }
}

// Moves item i to row offsets[key[i]] + pos[i]: its row (in_rows[i / row_div], so a pair reads
// its token's activations with row_div = top_k), its index, and up to two u32 metadata arrays
// (null to skip). out_row_of[i] records where it went. Items with key NONE are skipped.
// Grid: one block per item (grid-stride), threads across the row. Rows of f32 (`scatter_rows`)
// or bf16 (`scatter_rows_bf16`, the whole-model data plane: half the bytes to dispatch).
template <class T>
__device__ void scatter_rows_of(const T* __restrict__ in_rows, u32 n, u32 hidden, u32 row_div,
                                const u32* __restrict__ key, const u32* __restrict__ pos,
                                const u32* __restrict__ offsets, const u32* __restrict__ meta_a,
                                const u32* __restrict__ meta_b, T* __restrict__ out_rows,
                                u32* __restrict__ out_index, u32* __restrict__ out_meta_a,
                                u32* __restrict__ out_meta_b, u32* __restrict__ out_row_of) {
    for (u32 i = blockIdx.x; i < n; i += gridDim.x) {
        const u32 k = key[i];
        if (k == NONE_U32) continue;
        const u64 dst = (u64)offsets[k] + pos[i];
        const T* src = in_rows + (u64)(i / row_div) * hidden;
        T* out = out_rows + dst * hidden;
        for (u32 h = threadIdx.x; h < hidden; h += blockDim.x) out[h] = src[h];
        if (threadIdx.x == 0) {
            out_index[dst] = i;
            if (meta_a) out_meta_a[dst] = meta_a[i];
            if (meta_b) out_meta_b[dst] = meta_b[i];
            out_row_of[i] = (u32)dst;
        }
    }
}

extern "C" __global__ void scatter_rows_bf16(const bf16* __restrict__ in_rows, u32 n, u32 hidden, u32 row_div,
                                             const u32* __restrict__ key, const u32* __restrict__ pos,
                                             const u32* __restrict__ offsets, const u32* __restrict__ meta_a,
                                             const u32* __restrict__ meta_b, bf16* __restrict__ out_rows,
                                             u32* __restrict__ out_index, u32* __restrict__ out_meta_a,
                                             u32* __restrict__ out_meta_b, u32* __restrict__ out_row_of) {
    scatter_rows_of(in_rows, n, hidden, row_div, key, pos, offsets, meta_a, meta_b, out_rows, out_index,
                    out_meta_a, out_meta_b, out_row_of);
}
