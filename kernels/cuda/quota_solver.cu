// GPU quota solver (UltraEP §5.3): the quota-driven replication planner (Algorithm 1, §5.1) and
// the locality-first reroute (§5.2) in one cooperative thread block, with no host round trip.
//
// It reproduces rackfill_balancer::quota::QuotaPlanner bit for bit: same totals, same orders and
// tie-breaking, same threshold search (gallop from the lower bound, then bisect), same greedy
// oracle (BestFit or LargestSlack target rule, u_min floor), same plan assembly and reroute split.
// Every phase names the CPU function (balancer/src/{quota,plan,reroute,metrics,load}.rs) it
// mirrors; a change there must be mirrored here, and the GPU tests compare the two plans.
//
// Parallel structure:
// - the load matrix (when it fits), expert totals, rank loads and orders live in shared memory;
// - every warp owns one probe's state (slack, free slots, moves) in shared memory. A search
//   round evaluates up to `warps` thresholds at once: the next CPU probe plus the probes the CPU
//   would run after it if each one were infeasible (a speculative chain). The first feasible
//   probe of the chain is exactly the CPU's next feasible probe, so a round advances the CPU
//   search by one feasible step and every infeasible step before it;
// - inside a probe the warp picks each move's target with warp-level reductions over the ranks
//   (smallest covering slack / largest slack among ranks with slack and a free slot). When every
//   slack of the solve fits beside a rank index in 32 bits (any layer of fewer than 2^26 routed
//   tokens per rank at R=64), each reduction is one redux instruction over packed keys;
// - plan assembly and the per-expert reroute split run across threads and warps.
//
// Launch: one block of `warps * 32` threads, `SolverParams::shared_bytes` of dynamic shared
// memory (every offset below comes from the host, rackfill_kernels::cuda::solver).

struct SolverParams {
    u64 u_min;            // smallest replica quota (>= 1)
    u32 ranks;            // R
    u32 experts;          // E
    u32 n_slot;           // redundant slots per rank
    u32 rule;             // 0: BestFit, 1: LargestSlack (quota::TargetRule)
    u32 warps;            // blockDim.x / 32, at most 32
    u32 max_moves;        // R * n_slot: every move takes one slot, so no probe makes more
    u32 load_in_shared;   // 1: the load matrix is staged at sh_load
    u32 cumulative_capacity;  // entries of out_cumulative
    // Byte offsets into dynamic shared memory.
    u32 sh_load;          // u64[R * E]
    u32 sh_totals;        // u64[E]      lambda_e
    u32 sh_main_quota;    // u64[E]
    u32 sh_rank_load;     // u64[R]      L0[r]
    u32 sh_main_offsets;  // u32[R + 1]  layout CSR
    u32 sh_hottest;       // u32[E]      each rank's mains by descending load
    u32 sh_by_load;       // u32[R]      ranks by descending load
    u32 sh_best;          // moves of the best probe: u64 quota[M], u32 expert[M], u32 rank[M]
    u32 sh_sorted;        // the same moves sorted by (expert, rank)
    u32 sh_first_prefix;  // u32[M + 1]  replicated experts among sorted[0..i)
    u32 sh_distinct;      // u32[M]      replicated experts, ascending
    u32 sh_warps;         // first warp region
    u32 warp_stride;      // bytes per warp region
    // Offsets inside a warp region.
    u32 w_a;              // u64[R] probe: slack;  split: demand
    u32 w_b;              // u64[R] split: quota_left
    u32 w_c;              // u64[R] split: given
    u32 w_free;           // u32[R] probe: free slots
    u32 w_quota;          // u64[M] probe moves
    u32 w_expert;         // u32[M]
    u32 w_rank;           // u32[M]
};

// out_status entries.
#define ST_STATUS 0        // 0 ok, else an ERR_* code
#define ST_REPLICAS 1
#define ST_CUMULATIVE 2    // entries of out_cumulative used
#define ST_ROUNDS 3        // search rounds (each one probe per busy warp)
#define ST_PROBES 4        // probes the CPU search runs for this input
#define ST_EVALUATED 5     // probes evaluated, speculative ones included
#define ST_REACHED 6       // max rank load of the chosen plan (0 when no probe succeeded)
#define ST_LOWER_BOUND 7
#define ST_PACKED_KEYS 8   // 1: the probes picked targets by pick_target_packed
#define ST_LEN 9

#define ERR_MOVES 1        // a probe made more moves than slots (cannot happen)
#define ERR_CUMULATIVE 2   // the split does not fit out_cumulative (host sized it too small)
#define ERR_SETTLE 3       // a split's marginals disagree (cannot happen)

#define MAX_WARPS 32

// Search state, shared by the block (thread 0 writes it between barriers).
struct Control {
    u64 lo, hi, step;
    u64 taus[MAX_WARPS];
    u64 max_load[MAX_WARPS];
    u32 feasible[MAX_WARPS];
    u32 n_moves[MAX_WARPS];
    u64 scratch[MAX_WARPS];
    u32 n_taus;
    u32 key_shift;  // pick_target_packed's rank bits, NONE_U32 when slacks do not fit beside them
    u32 galloping;
    u32 reached;
    i32 best_warp;
    u32 n_best;
    u32 n_distinct;
    u32 rounds;
    u32 probes;
    u32 evaluated;
    u32 status;
    u64 reached_load;
    u64 lower_bound;
};

struct Shared {
    const SolverParams* p;
    u8* base;
    const u64* load_g;
    __device__ u64* u64s(u32 off) const { return (u64*)(base + off); }
    __device__ u32* u32s(u32 off) const { return (u32*)(base + off); }
    __device__ u64 load(u32 r, u32 e) const {
        u64 i = (u64)r * p->experts + e;
        return p->load_in_shared ? u64s(p->sh_load)[i] : load_g[i];
    }
    __device__ u8* warp(u32 w) const { return base + p->sh_warps + w * p->warp_stride; }
};

// A candidate target rank; rank == NONE_U32 means none.
struct Pick {
    u64 slack;
    u32 rank;
};

__device__ __forceinline__ bool lower_pick(Pick a, Pick b) {  // (slack, rank) ascending
    return a.slack < b.slack || (a.slack == b.slack && a.rank < b.rank);
}

__device__ __forceinline__ Pick better_min(Pick a, Pick b) {
    if (a.rank == NONE_U32) return b;
    if (b.rank == NONE_U32) return a;
    return lower_pick(b, a) ? b : a;
}

__device__ __forceinline__ Pick better_max(Pick a, Pick b) {
    if (a.rank == NONE_U32) return b;
    if (b.rank == NONE_U32) return a;
    return lower_pick(a, b) ? b : a;
}

__device__ __forceinline__ Pick shfl_pick(Pick a, int o) {
    Pick b;
    b.slack = __shfl_xor_sync(FULL_MASK, a.slack, o);
    b.rank = __shfl_xor_sync(FULL_MASK, a.rank, o);
    return b;
}

// Mirrors quota.rs pick_target + count_below over the sorted admissible set: a rank is admissible
// when it has slack and a free slot (quota.rs seed_targets / drain_rank keep exactly those in
// `targets`). BestFit: the smallest (slack, rank) with slack >= need, else the largest
// (slack, rank); LargestSlack: the largest (slack, rank). Warp-uniform result.
__device__ Pick pick_target(const u64* slack, const u32* free_slots, u32 ranks, u64 need, u32 rule) {
    Pick fit = {0, NONE_U32};
    Pick largest = {0, NONE_U32};
    for (u32 t = lane_id(); t < ranks; t += 32) {
        u64 s = slack[t];
        if (s == 0 || free_slots[t] == 0) continue;
        Pick c = {s, t};
        if (s >= need) fit = better_min(fit, c);
        largest = better_max(largest, c);
    }
    for (int o = 16; o > 0; o >>= 1) {
        fit = better_min(fit, shfl_pick(fit, o));
        largest = better_max(largest, shfl_pick(largest, o));
    }
    return (rule == 1 || fit.rank == NONE_U32) ? largest : fit;
}

// pick_target when every slack s of the solve satisfies s < 2^(32 - shift) - 1 and every rank
// t < 2^shift: the key (s << shift) | t orders candidates exactly as (slack, rank) does, so each
// choice is one warp min or max of a u32 (a single redux instruction on sm_80+) instead of a
// five-step shuffle tree over 64-bit slacks and ranks. NONE_U32 (no fit) and 0 (no admissible
// rank: admissible ones have slack >= 1) are never keys. Same result as pick_target.
__device__ Pick pick_target_packed(const u64* slack, const u32* free_slots, u32 ranks, u64 need, u32 rule,
                                   u32 shift) {
    u32 fit = NONE_U32, largest = 0;
    for (u32 t = lane_id(); t < ranks; t += 32) {
        const u64 s = slack[t];
        if (s == 0 || free_slots[t] == 0) continue;
        const u32 key = ((u32)s << shift) | t;
        if (s >= need && key < fit) fit = key;
        if (key > largest) largest = key;
    }
    fit = warp_min_u32(fit);
    largest = warp_max_u32(largest);
    const u32 key = (rule == 1 || fit == NONE_U32) ? largest : fit;
    if (key == 0) return Pick{0, NONE_U32};
    return Pick{(u64)(key >> shift), key & ((1u << shift) - 1u)};
}

// The rank bits of pick_target_packed's keys for `ranks` ranks whose slacks stay below `hi`
// (every probed threshold is), or NONE_U32 when such keys do not fit in 32 bits.
__device__ u32 packed_key_shift(u32 ranks, u64 hi) {
    u32 shift = 0;
    while ((1ull << shift) < (u64)ranks) ++shift;
    return shift < 32 && hi < (1ull << (32 - shift)) ? shift : NONE_U32;
}

// Mirrors quota.rs probe (with seed_targets and drain_rank): the greedy feasibility oracle for
// one threshold, run by one warp. Writes feasible / max_load / n_moves of warp `w` to Control.
__device__ void probe(const Shared& s, Control& ctl, u32 w, u64 tau) {
    const u32 key_shift = ctl.key_shift;
    const SolverParams& p = *s.p;
    u8* region = s.warp(w);
    u64* slack = (u64*)(region + p.w_a);
    u32* free_slots = (u32*)(region + p.w_free);
    u64* mv_quota = (u64*)(region + p.w_quota);
    u32* mv_expert = (u32*)(region + p.w_expert);
    u32* mv_rank = (u32*)(region + p.w_rank);
    const u64* rank_load = s.u64s(p.sh_rank_load);
    const u64* totals = s.u64s(p.sh_totals);
    const u32* by_load = s.u32s(p.sh_by_load);
    const u32* offsets = s.u32s(p.sh_main_offsets);
    const u32* hottest = s.u32s(p.sh_hottest);
    const u32 lane = lane_id();

    // seed_targets: slack = tau - L0 (saturating), n_slot free slots everywhere.
    u32 over = 0;
    for (u32 t = lane; t < p.ranks; t += 32) {
        u64 l = rank_load[t];
        slack[t] = tau > l ? tau - l : 0;
        free_slots[t] = p.n_slot;
        over += l > tau ? 1u : 0u;
    }
    // probe: the overloaded ranks are the prefix of by_load (descending load) above tau.
    const u32 overloaded = warp_sum_u32(over);
    __syncwarp();

    u32 n_moves = 0;
    bool ok = true;
    u32 status = 0;
    for (u32 k = 0; k < overloaded && ok; ++k) {
        const u32 r = by_load[k];
        u64 excess = rank_load[r] - tau;
        // drain_rank: the rank's main experts, hottest first.
        for (u32 idx = offsets[r]; idx < offsets[r + 1]; ++idx) {
            const u32 e = hottest[idx];
            u64 cap = totals[e];
            while (excess > 0 && cap > 0) {
                const u64 need = min_u64(excess, cap);
                const Pick t = key_shift != NONE_U32
                                   ? pick_target_packed(slack, free_slots, p.ranks, need, p.rule, key_shift)
                                   : pick_target(slack, free_slots, p.ranks, need, p.rule);
                if (t.rank == NONE_U32) {  // targets.is_empty(): the rank keeps its excess
                    ok = false;
                    break;
                }
                const u64 delta = min_u64(need, t.slack);
                if (delta < p.u_min) break;
                if (n_moves >= p.max_moves) {
                    status = ERR_MOVES;
                    ok = false;
                    break;
                }
                if (lane == 0) {
                    mv_quota[n_moves] = delta;
                    mv_expert[n_moves] = e;
                    mv_rank[n_moves] = t.rank;
                    slack[t.rank] -= delta;
                    free_slots[t.rank] -= 1;
                }
                __syncwarp();
                ++n_moves;
                excess -= delta;
                cap -= delta;
            }
            if (!ok || excess == 0) break;
        }
        if (excess > 0) ok = false;
    }

    // Loads after the moves: tau - slack on every rank (overloaded ranks sit at tau).
    u64 m = 0;
    for (u32 t = lane; t < p.ranks; t += 32) m = max_u64(m, tau - slack[t]);
    m = warp_max_u64(m);
    if (lane == 0) {
        ctl.feasible[w] = ok ? 1u : 0u;
        ctl.max_load[w] = m;
        ctl.n_moves[w] = n_moves;
        if (status != 0) ctl.status = status;
    }
}

// reroute.rs FloorShare::of: floor(d * c / capacity), with the same fixed-point fast path.
__device__ u64 div128_by_64(u64 hi, u64 lo, u64 d) {  // requires hi < d
    u64 q = 0, r = hi;
    for (int i = 63; i >= 0; --i) {
        u64 top = r >> 63;
        r = (r << 1) | ((lo >> i) & 1ull);
        if (top != 0 || r >= d) {
            r -= d;
            q |= 1ull << i;
        }
    }
    return q;
}

struct FloorShare {
    u64 capacity, reciprocal;
    bool fits;
    __device__ u64 of(u64 d, u64 c) const {
        if (fits) {
            u64 num = d * c;
            u64 x = __umul64hi(num, reciprocal);
            // (x + 1) * capacity <= num, as 128-bit numbers.
            u64 lo = (x + 1) * capacity;
            u64 hi = __umul64hi(x + 1, capacity);
            return x + ((hi == 0 && lo <= num) ? 1ull : 0ull);
        }
        return div128_by_64(__umul64hi(d, c), d * c, capacity);
    }
};

// Mirrors reroute.rs split_locality_first (split_proportionally, settle_shortfalls) for one
// replicated expert, run by one warp, then turns each row into cumulative ends (assignment.rs
// TokenAssignment::new) in place. `blk` is the expert's R x n block of out_cumulative.
__device__ void split_expert(const Shared& s, Control& ctl, u32 w, u32 e, const u32* inst_offsets,
                             const u32* inst_rank, const u64* inst_quota, u64* blk) {
    const SolverParams& p = *s.p;
    u8* region = s.warp(w);
    u64* demand = (u64*)(region + p.w_a);
    u64* quota_left = (u64*)(region + p.w_b);
    u64* given = (u64*)(region + p.w_c);
    const u32 lane = lane_id();
    const u32 base = inst_offsets[e];
    const u32 n = inst_offsets[e + 1] - base;
    const u32 R = p.ranks;

    for (u32 r = lane; r < R; r += 32) demand[r] = s.load(r, e);
    for (u32 i = lane; i < n; i += 32) {
        quota_left[i] = inst_quota[base + i];
        given[i] = 0;
    }
    for (u32 x = lane; x < R * n; x += 32) blk[x] = 0;
    __syncwarp();
    // Local tokens first. Instances of one expert sit on distinct ranks, so lanes may take
    // instances in parallel: no two touch the same demand entry.
    for (u32 i = lane; i < n; i += 32) {
        u32 host = inst_rank[base + i];
        u64 local = min_u64(demand[host], quota_left[i]);
        blk[host * n + i] = local;
        quota_left[i] -= local;
        demand[host] -= local;
    }
    __syncwarp();
    u64 cap_part = 0, max_quota = 0, max_demand = 0;
    for (u32 i = lane; i < n; i += 32) {
        cap_part += quota_left[i];
        max_quota = max_u64(max_quota, quota_left[i]);
    }
    for (u32 r = lane; r < R; r += 32) max_demand = max_u64(max_demand, demand[r]);
    const u64 capacity = warp_sum_u64(cap_part);
    max_quota = warp_max_u64(max_quota);
    max_demand = warp_max_u64(max_demand);
    if (capacity != 0) {
        // split_proportionally: rows are independent; `given` sums across rows with atomics
        // (integer sums: the order does not matter).
        FloorShare share;
        share.capacity = capacity;
        share.reciprocal = U64_MAX / capacity;
        share.fits = __umul64hi(max_demand, max_quota) == 0 && max_demand * max_quota < (1ull << 63);
        for (u32 r = lane; r < R; r += 32) {
            u64 d = demand[r];
            if (d == 0) continue;
            u64 sent = 0;
            for (u32 i = 0; i < n; ++i) {
                u64 q = share.of(d, quota_left[i]);
                blk[r * n + i] += q;
                atomicAdd(&given[i], q);
                sent += q;
            }
            demand[r] = d - sent;
        }
        __syncwarp();
        for (u32 i = lane; i < n; i += 32) quota_left[i] -= given[i];
        __syncwarp();
        // settle_shortfalls: the northwest-corner pass, sequential as on the CPU.
        if (lane == 0) {
            u32 i = 0;
            for (u32 r = 0; r < R; ++r) {
                u64 short_by = demand[r];
                while (short_by > 0) {
                    while (i < n && quota_left[i] == 0) ++i;
                    if (i == n) {
                        ctl.status = ERR_SETTLE;
                        short_by = 0;
                        r = R;
                        break;
                    }
                    u64 take = min_u64(short_by, quota_left[i]);
                    blk[r * n + i] += take;
                    quota_left[i] -= take;
                    short_by -= take;
                }
            }
        }
    }
    __syncwarp();
    // Cumulative ends per source row (assignment.rs TokenAssignment::new).
    for (u32 r = lane; r < R; r += 32) {
        u64 run = 0;
        for (u32 i = 0; i < n; ++i) {
            run += blk[r * n + i];
            blk[r * n + i] = run;
        }
    }
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(1024, 1)
quota_solve(const SolverParams params, const u64* __restrict__ load, const u32* __restrict__ main_offsets,
            const u32* __restrict__ mains, const u32* __restrict__ home, u64* out_status,
            i32* out_slots, u32* out_inst_offsets, u32* out_inst_rank,
            u64* out_inst_quota, u32* out_split_offsets,
            u64* out_cumulative) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ Control ctl;
    // The parameters in shared memory: helpers reach them through a pointer, and a pointer to a
    // kernel parameter would force a copy into (slow) local memory per thread.
    __shared__ SolverParams shared_params;
    if (threadIdx.x == 0) shared_params = params;
    __syncthreads();
    const SolverParams& p = shared_params;
    Shared s;
    s.p = &shared_params;
    s.base = smem;
    s.load_g = load;
    const u32 tid = threadIdx.x, bd = blockDim.x;
    const u32 R = p.ranks, E = p.experts, M = p.max_moves;

    u64* totals = s.u64s(p.sh_totals);
    u64* main_quota = s.u64s(p.sh_main_quota);
    u64* rank_load = s.u64s(p.sh_rank_load);
    u32* offsets = s.u32s(p.sh_main_offsets);
    u32* hottest = s.u32s(p.sh_hottest);
    u32* by_load = s.u32s(p.sh_by_load);
    u64* best_quota = s.u64s(p.sh_best);
    u32* best_expert = (u32*)(best_quota + M);
    u32* best_rank = best_expert + M;
    u64* sorted_quota = s.u64s(p.sh_sorted);
    u32* sorted_expert = (u32*)(sorted_quota + M);
    u32* sorted_rank = sorted_expert + M;
    u32* first_prefix = s.u32s(p.sh_first_prefix);
    u32* distinct = s.u32s(p.sh_distinct);

    // ---- Stage the inputs in shared memory.
    if (p.load_in_shared) {
        u64* load_s = s.u64s(p.sh_load);
        for (u64 i = tid; i < (u64)R * E; i += bd) load_s[i] = load[i];
    }
    for (u32 i = tid; i <= R; i += bd) offsets[i] = main_offsets[i];
    if (tid == 0) {
        ctl.status = 0;
        ctl.rounds = 0;
        ctl.probes = 0;
        ctl.evaluated = 0;
    }
    __syncthreads();

    // ---- load.rs LoadMatrix::expert_totals_into: lambda_e = sum_r load[r][e].
    for (u32 e = tid; e < E; e += bd) {
        u64 t = 0;
        for (u32 r = 0; r < R; ++r) t += s.load(r, e);
        totals[e] = t;
    }
    __syncthreads();

    // ---- load.rs main_rank_loads: L0[r]; quota.rs order_mains_hottest_first: each rank's mains
    // by (descending total, ascending expert), placed by counting the mains that sort before.
    for (u32 r = tid; r < R; r += bd) {
        u64 l = 0;
        for (u32 i = offsets[r]; i < offsets[r + 1]; ++i) l += totals[mains[i]];
        rank_load[r] = l;
    }
    for (u32 e = tid; e < E; e += bd) {
        const u32 r = home[e];
        const u64 te = totals[e];
        u32 pos = 0;
        for (u32 i = offsets[r]; i < offsets[r + 1]; ++i) {
            u32 m = mains[i];
            u64 tm = totals[m];
            pos += (tm > te || (tm == te && m < e)) ? 1u : 0u;
        }
        hottest[offsets[r] + pos] = e;
    }
    __syncthreads();

    // ---- quota.rs order_ranks_by_load: ranks by (descending L0, ascending rank).
    for (u32 r = tid; r < R; r += bd) {
        const u64 lr = rank_load[r];
        u32 pos = 0;
        for (u32 q = 0; q < R; ++q) {
            u64 lq = rank_load[q];
            pos += (lq > lr || (lq == lr && q < r)) ? 1u : 0u;
        }
        by_load[pos] = r;
    }

    // ---- metrics.rs lower_bound and quota.rs search_threshold's starting bracket.
    const u64 ranks64 = R;
    const u64 n_slot64 = p.n_slot;
    u64 part_total = 0, part_max = 0, part_bound = 0;
    const u64 max_instances = min_u64(ranks64, 1ull + n_slot64 * (ranks64 - 1ull));
    for (u32 r = tid; r < R; r += bd) {
        const u64 l0 = rank_load[r];
        part_total += l0;
        part_max = max_u64(part_max, l0);
        const u64 n_mains = offsets[r + 1] - offsets[r];
        part_bound = max_u64(part_bound, div_ceil_u64(l0, 1ull + (ranks64 - 1ull) * min_u64(n_slot64, n_mains)));
    }
    for (u32 e = tid; e < E; e += bd) part_bound = max_u64(part_bound, div_ceil_u64(totals[e], max_instances));
    const u64 total = block_sum_u64(part_total, ctl.scratch);
    const u64 hi0 = block_max_u64(part_max, ctl.scratch);
    const u64 bound_terms = block_max_u64(part_bound, ctl.scratch);
    if (tid == 0) {
        const u64 avg = div_ceil_u64(total, ranks64);
        const u64 bound = max_u64(avg, bound_terms);
        ctl.lower_bound = bound;
        ctl.hi = hi0;
#ifdef RACKFILL_HOST_EMULATOR
        // The emulator can switch packed keys off, to run both pick paths on one layer.
        ctl.key_shift = g_emu_packed_keys ? packed_key_shift(R, hi0) : NONE_U32;
#else
        ctl.key_shift = packed_key_shift(R, hi0);
#endif
        ctl.lo = max_u64(bound, avg);
        ctl.step = max_u64(ctl.lo / 1024ull, 1ull);
        ctl.galloping = 1;
        ctl.reached = 0;
        ctl.reached_load = 0;
        ctl.n_best = 0;
    }
    __syncthreads();

    // ---- quota.rs search_threshold, a speculative chain of probes per round.
    for (;;) {
        if (tid == 0) {
            // The thresholds the CPU probes next if every one of them turns out infeasible.
            u32 n = 0;
            u64 lo = ctl.lo, step = ctl.step;
            const u64 hi = ctl.hi;
            while (n < p.warps && lo < hi) {
                u64 tau = ctl.galloping ? min_u64(lo + step - 1ull, hi - 1ull) : lo + (hi - lo) / 2ull;
                ctl.taus[n++] = tau;
                lo = tau + 1ull;
                step = saturating_double(step);
            }
            ctl.n_taus = n;
        }
        __syncthreads();
        const u32 n_taus = ctl.n_taus;
        if (n_taus == 0) break;
        if (warp_id() < n_taus) probe(s, ctl, warp_id(), ctl.taus[warp_id()]);
        __syncthreads();
        if (tid == 0) {
            u32 first = n_taus;
            for (u32 w = 0; w < n_taus; ++w) {
                if (ctl.feasible[w]) {
                    first = w;
                    break;
                }
            }
            for (u32 w = 0; w < first; ++w) {  // infeasible: move up
                ctl.lo = ctl.taus[w] + 1ull;
                ctl.step = saturating_double(ctl.step);
            }
            ctl.best_warp = -1;
            if (first < n_taus) {  // feasible: keep its moves, lower hi to the load it reached
                ctl.hi = ctl.max_load[first];
                ctl.galloping = 0;
                ctl.reached = 1;
                ctl.reached_load = ctl.max_load[first];
                ctl.best_warp = (i32)first;
                ctl.n_best = ctl.n_moves[first];
            }
            ctl.rounds += 1;
            ctl.probes += first < n_taus ? first + 1 : n_taus;
            ctl.evaluated += n_taus;
        }
        __syncthreads();
        if (ctl.best_warp >= 0) {
            u8* region = s.warp((u32)ctl.best_warp);
            const u64* q = (const u64*)(region + p.w_quota);
            const u32* ex = (const u32*)(region + p.w_expert);
            const u32* rk = (const u32*)(region + p.w_rank);
            for (u32 i = tid; i < ctl.n_best; i += bd) {
                best_quota[i] = q[i];
                best_expert[i] = ex[i];
                best_rank[i] = rk[i];
            }
        }
        __syncthreads();
    }
    if (ctl.status != 0) {
        if (tid == 0) out_status[ST_STATUS] = ctl.status;
        return;
    }

    // ---- quota.rs QuotaPlanner::plan: main quotas are the totals minus what the replicas took.
    const u32 n_best = ctl.reached ? ctl.n_best : 0u;
    for (u32 e = tid; e < E; e += bd) main_quota[e] = totals[e];
    __syncthreads();
    for (u32 i = tid; i < n_best; i += bd) atomicAdd(&main_quota[best_expert[i]], 0ull - best_quota[i]);
    // ---- plan.rs Plan::assemble: replicas sorted by (expert, rank); a probe never puts one
    // expert twice on a rank, so the keys are distinct and counting places each one.
    for (u32 i = tid; i < n_best; i += bd) {
        const u32 ei = best_expert[i], ri = best_rank[i];
        u32 pos = 0;
        for (u32 j = 0; j < n_best; ++j) {
            u32 ej = best_expert[j], rj = best_rank[j];
            pos += (ej < ei || (ej == ei && rj < ri)) ? 1u : 0u;
        }
        sorted_quota[pos] = best_quota[i];
        sorted_expert[pos] = ei;
        sorted_rank[pos] = ri;
    }
    __syncthreads();
    if (tid == 0) {
        u32 firsts = 0;
        for (u32 i = 0; i < n_best; ++i) {
            first_prefix[i] = firsts;
            if (i == 0 || sorted_expert[i] != sorted_expert[i - 1]) distinct[firsts++] = sorted_expert[i];
        }
        first_prefix[n_best] = firsts;
        ctl.n_distinct = firsts;
    }
    __syncthreads();
    const u32 n_distinct = ctl.n_distinct;
    const u64 cumulative_len = (u64)R * (n_best + n_distinct);
    if (cumulative_len > p.cumulative_capacity) {
        if (tid == 0) out_status[ST_STATUS] = ERR_CUMULATIVE;
        return;
    }
    // Instance and split offsets: expert e starts after e mains and the replicas of lower
    // experts; its split block after R * |H(e')| entries per replicated lower expert.
    for (u32 e = tid; e <= E; e += bd) {
        u32 lo = 0, hi = n_best;  // first sorted replica with expert >= e
        while (lo < hi) {
            u32 mid = (lo + hi) >> 1;
            if (sorted_expert[mid] < e) lo = mid + 1; else hi = mid;
        }
        out_inst_offsets[e] = e + lo;
        out_split_offsets[e] = R * (lo + first_prefix[lo]);
        if (e < E) {
            out_inst_rank[e + lo] = home[e];
            out_inst_quota[e + lo] = main_quota[e];
        }
    }
    for (u32 i = tid; i < R * p.n_slot; i += bd) out_slots[i] = -1;
    for (u32 i = tid; i < n_best; i += bd) {
        out_inst_rank[sorted_expert[i] + 1 + i] = sorted_rank[i];
        out_inst_quota[sorted_expert[i] + 1 + i] = sorted_quota[i];
    }
    __syncthreads();
    // Slots fill in replica order: slot k of rank r holds its k-th replica by (expert, rank).
    for (u32 i = tid; i < n_best; i += bd) {
        const u32 ri = sorted_rank[i];
        u32 k = 0;
        for (u32 j = 0; j < i; ++j) k += sorted_rank[j] == ri ? 1u : 0u;
        out_slots[ri * p.n_slot + k] = (i32)sorted_expert[i];
    }
    // ---- reroute.rs split_locality_first, one warp per replicated expert.
    for (u32 k = warp_id(); k < n_distinct; k += p.warps) {
        const u32 e = distinct[k];
        split_expert(s, ctl, warp_id(), e, out_inst_offsets, out_inst_rank, out_inst_quota,
                     out_cumulative + out_split_offsets[e]);
    }
    __syncthreads();
    if (tid == 0) {
        out_status[ST_STATUS] = ctl.status;
        out_status[ST_REPLICAS] = n_best;
        out_status[ST_CUMULATIVE] = cumulative_len;
        out_status[ST_ROUNDS] = ctl.rounds;
        out_status[ST_PROBES] = ctl.probes;
        out_status[ST_EVALUATED] = ctl.evaluated;
        out_status[ST_REACHED] = ctl.reached ? ctl.reached_load : 0ull;
        out_status[ST_LOWER_BOUND] = ctl.lower_bound;
        out_status[ST_PACKED_KEYS] = ctl.key_shift != NONE_U32 ? 1ull : 0ull;
    }
}
