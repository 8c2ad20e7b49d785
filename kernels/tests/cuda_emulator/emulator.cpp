// Drives the real kernel sources under emu.h. `kernels.inc` (written by tests/cuda_emulated.rs)
// is the prelude plus every kernel file, with the few spellings a host compiler cannot take
// (dynamic shared memory declarations, inline PTX) replaced.
//
// Usage: emulator MODE WARPS [BLOCKS FENCE_DELAY_US STALL_MS] < input > output, MODE one of
// solver, send, recv, replicate, tiles, distribute, act; the last three shape tile_stream's grid
// (replicate, distribute; default 1, 0 and 50). `emulator solver WARPS 0` makes the solver pick
// targets by the shuffle tree even where packed keys fit. Inputs
// and outputs are whitespace-separated integers (floats as their IEEE bits); see each mode.
#include "emu.h"
#include "kernels.inc"

typedef unsigned long long u64;

template <class T> static std::vector<T> read(size_t n) {
    std::vector<T> v(std::max<size_t>(n, 1));
    for (size_t i = 0; i < n; ++i) std::cin >> v[i];
    return v;
}
static std::vector<float> read_f32(size_t n) {
    std::vector<float> v(std::max<size_t>(n, 1));
    for (size_t i = 0; i < n; ++i) {
        unsigned b;
        std::cin >> b;
        std::memcpy(&v[i], &b, 4);
    }
    return v;
}
template <class T> static void print(const char* name, const std::vector<T>& v, size_t n) {
    std::cout << name;
    for (size_t i = 0; i < n; ++i) std::cout << ' ' << +v[i];
    std::cout << '\n';
}
static void print_f32(const char* name, const std::vector<float>& v, size_t n) {
    std::cout << name;
    for (size_t i = 0; i < n; ++i) {
        unsigned b;
        std::memcpy(&b, &v[i], 4);
        std::cout << ' ' << b;
    }
    std::cout << '\n';
}

// solver: "R E n_slot u_min rule warps stage" / home[E] / load[R*E] / the 28 SolverParams
// offsets computed by the Rust host (sh_load .. w_rank, shared_bytes). Prints the outputs.
static void solver(unsigned warps) {
    u32 R, E, n_slot, rule, stage;
    u64 u_min;
    std::cin >> R >> E >> n_slot >> u_min >> rule >> stage;
    auto home = read<u32>(E);
    auto load = read<u64>((size_t)R * E);
    SolverParams p{};
    u64 shared_bytes;
    std::cin >> p.cumulative_capacity >> p.sh_load >> p.sh_totals >> p.sh_main_quota >> p.sh_rank_load >>
        p.sh_main_offsets >> p.sh_hottest >> p.sh_by_load >> p.sh_best >> p.sh_sorted >> p.sh_first_prefix >>
        p.sh_distinct >> p.sh_warps >> p.warp_stride >> p.w_a >> p.w_b >> p.w_c >> p.w_free >> p.w_quota >>
        p.w_expert >> p.w_rank >> shared_bytes;
    p.u_min = u_min;
    p.ranks = R;
    p.experts = E;
    p.n_slot = n_slot;
    p.rule = rule;
    p.warps = warps;
    p.max_moves = R * n_slot;
    p.load_in_shared = stage;
    std::vector<unsigned char> smem(shared_bytes + 16);
    g_smem = smem.data();
    std::vector<u32> offsets(R + 1, 0), mains;
    for (u32 r = 0; r < R; ++r) {
        offsets[r] = mains.size();
        for (u32 e = 0; e < E; ++e)
            if (home[e] == r) mains.push_back(e);
    }
    offsets[R] = mains.size();
    mains.push_back(0);
    u64 M = p.max_moves;
    std::vector<u64> status(ST_LEN, 0), quota(E + M + 1), cumulative(p.cumulative_capacity + 1);
    std::vector<i32> slots(std::max<u64>(1, (u64)R * n_slot));
    std::vector<u32> inst_offsets(E + 1), inst_rank(E + M + 1), split_offsets(E + 1);
    run_block(warps * 32, [&] {
        quota_solve(p, load.data(), offsets.data(), mains.data(), home.data(), status.data(), slots.data(),
                    inst_offsets.data(), inst_rank.data(), quota.data(), split_offsets.data(), cumulative.data());
    });
    print("status", status, ST_LEN);
    print("warp_ops", std::vector<u64>{g_max_warp_ops.load()}, 1);
    if (status[0] != 0) return;
    print("slots", slots, (size_t)R * n_slot);
    print("inst_offsets", inst_offsets, E + 1);
    print("inst_rank", inst_rank, inst_offsets[E]);
    print("inst_quota", quota, inst_offsets[E]);
    print("split_offsets", split_offsets, E + 1);
    print("cumulative", cumulative, split_offsets[E]);
}

static void rank_by_key(const std::vector<u32>& keys, u32 n, u32 n_keys, unsigned warps, std::vector<u32>& pos,
                        std::vector<u32>& offsets, u32& bad) {
    pos.assign(std::max<u32>(n, 1), 0);
    offsets.assign(n_keys + 1, 0);
    bad = 0;
    std::vector<u32> shared((size_t)(warps + 1) * n_keys + 1);
    g_smem = (unsigned char*)shared.data();
    run_block(warps * 32, [&] { stable_rank_by_key(keys.data(), n, n_keys, pos.data(), offsets.data(), &bad); });
}

// send / recv read the plan arrays first: "R E n_instances n_cumulative", inst_offsets,
// inst_rank, split_offsets, cumulative.
struct PlanIn {
    u32 R, E;
    std::vector<u32> inst_offsets, inst_rank, split_offsets;
    std::vector<u64> cumulative;
    void read_in() {
        u32 n_inst, n_cum;
        std::cin >> R >> E >> n_inst >> n_cum;
        inst_offsets = read<u32>(E + 1);
        inst_rank = read<u32>(n_inst);
        split_offsets = read<u32>(E + 1);
        cumulative = read<u64>(n_cum);
    }
};

// send: plan / "hidden top_k src n_pairs" / experts / x bits / weights bits. Prints the send
// buffer and the combine of the send rows themselves (identity experts).
static void send(unsigned warps) {
    PlanIn plan;
    plan.read_in();
    u32 hidden, top_k, src, n;
    std::cin >> hidden >> top_k >> src >> n;
    auto experts = read<u32>(n);
    auto x = read_f32((size_t)(n / top_k) * hidden);
    auto weights = read_f32(n);
    std::vector<u32> occ, unused, pos, dest_offsets, inst(n + 1), dest(n + 1);
    u32 bad;
    // As the host does, the ranking by expert is not checked: an expert out of range gets no
    // instance and no destination, and the ranking by destination counts it.
    rank_by_key(experts, n, plan.E, warps, occ, unused, bad);
    run_block(1, [&] {
        lookup_instance(experts.data(), occ.data(), n, src, plan.E, plan.inst_offsets.data(), plan.inst_rank.data(),
                        plan.split_offsets.data(), plan.cumulative.data(), inst.data(), dest.data());
    });
    rank_by_key(dest, n, plan.R, warps, pos, dest_offsets, bad);
    if (bad) { std::cout << "bad " << bad << "\n"; return; }
    std::vector<float> rows((size_t)n * hidden + 1);
    std::vector<u32> pairs(n + 1), out_experts(n + 1), out_inst(n + 1), row_of(n + 1);
    run_block(7, [&] {
        scatter_rows(x.data(), n, hidden, top_k, dest.data(), pos.data(), dest_offsets.data(), experts.data(),
                     inst.data(), rows.data(), pairs.data(), out_experts.data(), out_inst.data(), row_of.data());
    });
    print("dest_offsets", dest_offsets, plan.R + 1);
    print("pairs", pairs, n);
    print("experts", out_experts, n);
    print("instances", out_inst, n);
    print_f32("rows", rows, (size_t)n * hidden);
    u32 tokens = n / top_k;
    std::vector<float> out((size_t)tokens * hidden + 1);
    run_block(5, [&] { combine_topk(rows.data(), row_of.data(), weights.data(), tokens, top_k, hidden, out.data()); });
    print_f32("combined", out, (size_t)tokens * hidden);
}

// recv: plan / "hidden rank n" / experts / instances / rows bits. Prints the group offsets, the
// grouped rows, and the grouped rows routed back to received order.
static void recv(unsigned warps) {
    PlanIn plan;
    plan.read_in();
    u32 hidden, rank, n;
    std::cin >> hidden >> rank >> n;
    auto experts = read<u32>(n);
    auto instances = read<u32>(n);
    auto rows = read_f32((size_t)n * hidden);
    std::vector<u32> keys(n + 1), pos, offsets;
    u32 bad;
    run_block(3, [&] {
        instance_keys(experts.data(), instances.data(), n, plan.E, rank, plan.inst_offsets.data(),
                      plan.inst_rank.data(), keys.data());
    });
    u32 n_keys = plan.inst_offsets[plan.E];
    rank_by_key(keys, n, n_keys, warps, pos, offsets, bad);
    if (bad) { std::cout << "bad " << bad << "\n"; return; }
    std::vector<float> grouped((size_t)n * hidden + 1), back((size_t)n * hidden + 1);
    std::vector<u32> origin(n + 1), row_of(n + 1);
    run_block(9, [&] {
        scatter_rows(rows.data(), n, hidden, 1, keys.data(), pos.data(), offsets.data(), nullptr, nullptr,
                     grouped.data(), origin.data(), nullptr, nullptr, row_of.data());
    });
    run_block(4, [&] { gather_rows(grouped.data(), row_of.data(), n, hidden, back.data()); });
    print("offsets", offsets, n_keys + 1);
    print_f32("grouped", grouped, (size_t)n * hidden);
    print_f32("back", back, (size_t)n * hidden);
}

// How tile_stream's grid runs: `blocks` concurrent blocks of `warps` warps (argv), how long
// each system-scope fence stalls (argv; 0: none) to make relay consumers in other blocks wait,
// and after how many milliseconds a relay wait counts as a stall (argv).
struct Grid {
    unsigned warps = 1, blocks = 1, fence_delay_us = 0, stall_ms = 50;
};

// Every rank's home weights, slot buffer and ready counters, as tile_stream addresses them:
// "slot_len" then per rank "n_flags n_home home bytes...".
struct RankMemory {
    std::vector<std::vector<u8>> homes;
    std::vector<u32> n_flags;
    u64 slot_len = 0;
    void read_in(u32 R) {
        std::cin >> slot_len;
        homes.resize(R), n_flags.resize(R);
        for (u32 r = 0; r < R; ++r) {
            u32 n_home;
            std::cin >> n_flags[r] >> n_home;
            homes[r].resize(n_home + 1);
            for (u32 i = 0; i < n_home; ++i) {
                unsigned v;
                std::cin >> v;
                homes[r][i] = (u8)v;
            }
        }
    }
    // Runs tile_stream as `grid` says over `tasks` (`count` of them), every buffer the blocks
    // share copied into device memory (slots and ready counters zeroed); prints the stall word,
    // how often a block backed off waiting for a relay chunk, then every slot buffer, then per
    // rank the landed-byte counters, counted here per `tile_bytes` of slot buffer.
    void stream(const Grid& grid, const TileTask* tasks, u32 count, const TileDst* dsts, u32 n_dsts,
                u32 tile_bytes) {
        const u32 R = (u32)homes.size();
        size_t bytes = (count + n_dsts + 8) * sizeof(TileTask) + 3 * R * sizeof(u64) + 256 + 16 * 8 * R;
        const u32 n_landed = (u32)(slot_len / tile_bytes) + 1;
        for (u32 r = 0; r < R; ++r) bytes += homes[r].size() + slot_len + 4 * (n_flags[r] + 1) + 4 * n_landed;
        DeviceMemory dev(bytes);
        const TileTask* d_tasks = dev.copy(tasks, count);
        const TileDst* d_dsts = dev.copy(dsts, n_dsts);
        u32* d_count = dev.copy(&count, 1);
        u32* next = dev.alloc<u32>(2);  // claim counter, stall word
        g_backoffs = dev.alloc<unsigned long long>(1);
        u64* home_base = dev.alloc<u64>(R);
        u64* slot_base = dev.alloc<u64>(R);
        u64* flag_base = dev.alloc<u64>(R);
        std::vector<u8*> slots(R);
        for (u32 r = 0; r < R; ++r) {
            home_base[r] = (u64)dev.copy(homes[r].data(), homes[r].size());
            slots[r] = dev.alloc<u8>(slot_len);
            slot_base[r] = (u64)slots[r];
            flag_base[r] = (u64)dev.alloc<u32>(n_flags[r] + 1);
        }
        u32* landed = dev.alloc<u32>((size_t)R * n_landed);
        g_fence_delay_us = grid.fence_delay_us;
        g_tile_stall_ns = (unsigned long long)grid.stall_ms * 1000000ull;
        const bool ok = run_grid(grid.blocks, grid.warps * 32, 2 * tile_bytes, [&] {
            tile_stream(d_tasks, d_count, d_dsts, next, home_base, slot_base, flag_base, tile_bytes, landed,
                        (u64)tile_bytes, n_landed);
        });
        if (!ok) {
            std::fprintf(stderr, "emulator: a tile_stream block died\n");
            std::exit(5);
        }
        print("stalled", std::vector<u32>{next[1]}, 1);
        print("backoffs", std::vector<u64>{*g_backoffs}, 1);
        for (u32 r = 0; r < R; ++r) print("slots", std::vector<u8>(slots[r], slots[r] + slot_len), slot_len);
        for (u32 r = 0; r < R; ++r)
            print("landed", std::vector<u32>(landed + (size_t)r * n_landed, landed + (size_t)(r + 1) * n_landed),
                  n_landed);
    }
};

// replicate: "R n_tasks n_dsts tile_bytes" / tasks (9 fields each) / dsts (3 fields each) /
// RankMemory. Prints the stall word, the back-off count and every slot buffer.
static void replicate(const Grid& grid) {
    u32 R, n_tasks, n_dsts, tile_bytes;
    std::cin >> R >> n_tasks >> n_dsts >> tile_bytes;
    std::vector<TileTask> tasks(n_tasks + 1);
    std::vector<TileDst> dsts(n_dsts + 1);
    for (u32 i = 0; i < n_tasks; ++i) {
        auto& t = tasks[i];
        std::cin >> t.src_offset >> t.tile_offset >> t.src_rank >> t.src_kind >> t.len >> t.dst_begin >> t.n_dst >>
            t.wait_flag >> t.wait_target;
    }
    for (u32 i = 0; i < n_dsts; ++i) std::cin >> dsts[i].offset >> dsts[i].rank >> dsts[i].ready_flag;
    RankMemory memory;
    memory.read_in(R);
    memory.stream(grid, tasks.data(), n_tasks, dsts.data(), n_dsts, tile_bytes);
}

// plan_tiles's inputs: the 14 TilePlanParams fields up to arena_in_shared / "guard arena_bytes" /
// slots[R*n_slot] / inst_offsets[E+1] / inst_rank[inst_offsets[E]] / home_offsets[E].
struct TilePlan {
    TilePlanParams p{};
    u64 guard = 0, arena_bytes = 0;
    std::vector<i32> slots;
    std::vector<u32> inst_offsets, inst_rank, header, flags;
    std::vector<u64> home_offsets;
    std::vector<TileTask> tasks;
    std::vector<TileDst> dsts;
    void read_in() {
        std::cin >> p.expert_bytes >> p.slot_bytes >> p.chunk_bytes >> p.n_chunks >> p.tile_bytes >> p.ranks >>
            p.experts >> p.n_slot >> p.threshold >> p.task_capacity >> p.dst_capacity >> p.flag_capacity >>
            p.edge_capacity >> p.arena_in_shared;
        std::cin >> guard >> arena_bytes;
        slots = read<i32>((size_t)p.ranks * p.n_slot);
        inst_offsets = read<u32>(p.experts + 1);
        inst_rank = read<u32>(inst_offsets[p.experts]);
        home_offsets = read<u64>(p.experts);
    }
    // Runs plan_tiles; exits 3 if it wrote past TilePlanParams::arena_bytes.
    void run(unsigned warps) {
        // The arena, 8-byte aligned; it stands for shared or global memory as the parameters
        // say. 64 canary bytes after it catch a carve that outgrows arena_bytes.
        std::vector<u64> arena(arena_bytes / 8 + 9);
        unsigned char* bytes = (unsigned char*)arena.data();
        std::memset(bytes + arena_bytes, 0xA5, 64);
        g_smem = bytes;
        header.assign(4, 0);
        flags.assign(p.ranks + 1, 0);
        tasks.assign(p.task_capacity + 1, TileTask{});
        dsts.assign(p.dst_capacity + 1, TileDst{});
        run_block(warps * 32, [&] {
            plan_tiles(p, &guard, slots.data(), inst_offsets.data(), inst_rank.data(), home_offsets.data(), bytes,
                       tasks.data(), dsts.data(), header.data(), flags.data());
        });
        for (int i = 0; i < 64; ++i)
            if (bytes[arena_bytes + i] != 0xA5) {
                std::cout << "overrun " << i << "\n";
                std::exit(3);
            }
    }
};

// tiles: plan_tiles's inputs. Prints the header, the ready counters per rank, then every task
// (9 fields) and destination (3 fields) flattened.
static void tiles(unsigned warps) {
    TilePlan plan;
    plan.read_in();
    plan.run(warps);
    print("header", plan.header, 4);
    print("flags", plan.flags, plan.p.ranks);
    std::vector<u64> t, d;
    for (u32 i = 0; i < plan.header[1]; ++i) {
        const TileTask& k = plan.tasks[i];
        for (u64 v : {k.src_offset, k.tile_offset, (u64)k.src_rank, (u64)k.src_kind, (u64)k.len, (u64)k.dst_begin,
                      (u64)k.n_dst, (u64)(i64)k.wait_flag, (u64)k.wait_target})
            t.push_back(v);
    }
    for (u32 i = 0; i < plan.header[2]; ++i)
        for (u64 v : {plan.dsts[i].offset, (u64)plan.dsts[i].rank, (u64)(i64)plan.dsts[i].ready_flag})
            d.push_back(v);
    print("tasks", t, t.size());
    print("dsts", d, d.size());
}

// distribute: plan_tiles's inputs / RankMemory. plan_tiles, then tile_stream reading the task
// count plan_tiles wrote (as on the GPU, where it stays in device memory). Prints the header,
// then what `replicate` prints.
static void distribute(const Grid& grid) {
    TilePlan plan;
    plan.read_in();
    RankMemory memory;
    memory.read_in(plan.p.ranks);
    plan.run(grid.warps);
    print("header", plan.header, 4);
    memory.stream(grid, plan.tasks.data(), plan.header[1], plan.dsts.data(), plan.header[2], plan.p.tile_bytes);
}

// act: "rows inter" / gate_up bits (rows x 2 inter). Prints silu(gate) * up (rows x inter).
static void act(unsigned warps) {
    u32 rows, inter;
    std::cin >> rows >> inter;
    auto gate_up = read_f32((size_t)rows * 2 * inter);
    std::vector<float> out((size_t)rows * inter + 1);
    run_block(warps * 32, [&] { silu_mul(gate_up.data(), rows, inter, out.data()); });
    print_f32("act", out, (size_t)rows * inter);
}

int main(int argc, char** argv) {
    if (argc < 3) return 2;
    std::string mode = argv[1];
    unsigned warps = (unsigned)atoi(argv[2]);
    Grid grid;
    grid.warps = warps;
    if (argc >= 6) {
        grid.blocks = (unsigned)atoi(argv[3]);
        grid.fence_delay_us = (unsigned)atoi(argv[4]);
        grid.stall_ms = (unsigned)atoi(argv[5]);
    }
    if (mode == "solver") {
        if (argc >= 4) g_emu_packed_keys = atoi(argv[3]) != 0;
        solver(warps);
    }
    else if (mode == "send") send(warps);
    else if (mode == "recv") recv(warps);
    else if (mode == "replicate") replicate(grid);
    else if (mode == "tiles") tiles(warps);
    else if (mode == "distribute") distribute(grid);
    else if (mode == "act") act(warps);
    else return 2;
    return 0;
}
