// Grouped expert GEMMs on tensor cores: every expert instance of a layer in one launch of each
// half of the expert MLP, instead of a cuBLAS GEMM pair (and an activation kernel) per instance.
//
// - grouped_gate_up_silu: act[r, :] = bf16(silu(x[r] . gate^T) * (x[r] . up^T)), gate and up
//   read from the expert's bf16 [2I, H] block (gate rows, then up rows);
// - grouped_down: out[r, :] = act[r] . down^T into f32, down the expert's bf16 [H, I] block.
//
// Rows are grouped by instance (a group: consecutive rows, one expert's weights). The host cuts
// each group into tiles of at most TILE_ROWS rows and uploads one ExpertTile per row tile
// (grouped_gemm.rs): blockIdx.x picks the row tile, blockIdx.y the column tile, so a launch is
// exactly the tiles of its groups (an empty group has none, a group of one row one) and blocks
// never search for their work. Rows past a tile's end are zero-filled in shared memory, never
// read from global memory nor written.
//
// A block (4 warps, 2 x 2) computes 64 rows against a B tile of 128 weight rows: for the
// gate-up kernel 64 gate columns and the 64 matching up columns, so each thread holds the gate
// and up of the same outputs and SiLU-mul is the epilogue (the f32 GEMM outputs never reach
// global memory); for the down kernel 128 output columns. K runs in steps of 32, double
// buffered: cp.async copies step s + 1 into shared memory while the tensor cores multiply step s.
// Shared rows are padded by 8 bf16 (80 bytes): 16-byte aligned for ldmatrix and cp.async, and
// the 8 rows of an ldmatrix phase fall in distinct banks. Weights are stored "out x in", so a
// plain ldmatrix on weight rows gives mma's column-major B fragments.
//
// Needs H and I multiples of 8 and 16-byte aligned buffers (a 16-byte copy never straddles the
// end of a row); the host falls back to per-instance GEMMs otherwise.

#define TILE_ROWS 64u
#define TILE_COLS 128u  // weight rows per B tile
#define K_STEP 32u
#define SMEM_ROW (K_STEP + 8u)  // bf16 per shared row
#define GEMM_THREADS 128u
#define A_STAGE (TILE_ROWS * SMEM_ROW)
#define B_STAGE (TILE_COLS * SMEM_ROW)

// One row tile of a group (host: grouped_gemm.rs GroupTile).
struct ExpertTile {
    u64 gate_up;  // device address of the expert's bf16 [2I, H]
    u64 down;     // device address of its bf16 [H, I]
    u32 row0;     // the tile's first row among the grouped rows
    u32 rows;     // rows of the tile, 1 ..= TILE_ROWS
};

// Which weight rows a B tile holds: row j < 64 is weight row first[0] + j, row j >= 64 weight
// row first[1] + j - 64; rows at or past count[half] in their half are zero.
struct BRows {
    u32 first[2];
    u32 count[2];
};

// Queues the copies of one K step into a stage: the tile's rows of a ([*, k_dim], from row0)
// and the B tile's weight rows; a's rows past `rows`, B's rows past their count and columns past
// k_dim are zero-filled.
__device__ __forceinline__ void load_step(const bf16* a, u32 row0, u32 rows, const bf16* w, BRows b, u32 k_dim,
                                          u32 k0, bf16* sa, bf16* sb) {
    for (u32 c = threadIdx.x; c < TILE_ROWS * (K_STEP / 8u); c += GEMM_THREADS) {
        const u32 r = c / (K_STEP / 8u), k = k0 + (c % (K_STEP / 8u)) * 8u;
        const bool full = r < rows && k < k_dim;
        const bf16* src = full ? a + (u64)(row0 + r) * k_dim + k : a;
        cp_async_16(sa + r * SMEM_ROW + (k - k0), src, full);
    }
    for (u32 c = threadIdx.x; c < TILE_COLS * (K_STEP / 8u); c += GEMM_THREADS) {
        const u32 j = c / (K_STEP / 8u), k = k0 + (c % (K_STEP / 8u)) * 8u;
        const u32 half = j / (TILE_COLS / 2u), in_half = j % (TILE_COLS / 2u);
        const bool full = in_half < (half ? b.count[1] : b.count[0]) && k < k_dim;
        const bf16* src = full ? w + (u64)((half ? b.first[1] : b.first[0]) + in_half) * k_dim + k : w;
        cp_async_16(sb + j * SMEM_ROW + (k - k0), src, full);
    }
    cp_async_commit();
}

// B tile row of this warp's n-tile pair p (0..3, 16 weight rows each): pairs 0, 1 in the first
// half, 2, 3 the same places in the second, so for the gate-up kernel n-tile j (gate) and j + 4
// (up) are the same output columns.
__device__ __forceinline__ u32 pair_row(u32 p) {
    return (p >> 1) * (TILE_COLS / 2u) + (warp_id() >> 1) * 32u + (p & 1u) * 16u;
}

// acc[m][n][4] += the tile's 64 x 128 product over k_dim: warp (wm, wn) = (warp & 1, warp >> 1)
// owns rows wm * 32 .. + 32 (two m16 tiles) and the 8 n-tiles of pair_row. `smem` holds two
// stages of A then two of B.
__device__ __forceinline__ void tile_product(const bf16* a, u32 row0, u32 rows, const bf16* w, BRows b, u32 k_dim,
                                             bf16* smem, float (*acc)[8][4]) {
    bf16* sa = smem;
    bf16* sb = smem + 2u * A_STAGE;
    const u32 lane = lane_id(), wm = warp_id() & 1u;
    const u32 steps = (k_dim + K_STEP - 1u) / K_STEP;
    load_step(a, row0, rows, w, b, k_dim, 0, sa, sb);
    for (u32 s = 0; s < steps; ++s) {
        const u32 stage = s & 1u;
        if (s + 1u < steps) {
            const u32 next = stage ^ 1u;
            load_step(a, row0, rows, w, b, k_dim, (s + 1u) * K_STEP, sa + next * A_STAGE,
                      sb + next * B_STAGE);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* ta = sa + stage * A_STAGE;
        const bf16* tb = sb + stage * B_STAGE;
#pragma unroll
        for (u32 kk = 0; kk < K_STEP; kk += 16u) {
            u32 af[2][4], bf[8][2];
            // A: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), lane l gives row l % 16, k 8 (l / 16).
#pragma unroll
            for (u32 m = 0; m < 2u; ++m)
                ldmatrix_x4(af[m], ta + (wm * 32u + m * 16u + (lane & 15u)) * SMEM_ROW + kk + (lane >> 4) * 8u);
            // B: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
#pragma unroll
            for (u32 p = 0; p < 4u; ++p) {
                u32 r[4];
                ldmatrix_x4(r, tb + (pair_row(p) + (lane & 7u) + (lane >> 4) * 8u) * SMEM_ROW + kk +
                                   ((lane >> 3) & 1u) * 8u);
                bf[2u * p][0] = r[0];
                bf[2u * p][1] = r[1];
                bf[2u * p + 1u][0] = r[2];
                bf[2u * p + 1u][1] = r[3];
            }
#pragma unroll
            for (u32 m = 0; m < 2u; ++m)
#pragma unroll
                for (u32 n = 0; n < 8u; ++n) mma_bf16_16816(acc[m][n], af[m], bf[n]);
        }
        __syncthreads();  // the next step's copies overwrite this stage
    }
}

// x bf16 [*, hidden], act bf16 [*, inter]; grid (tiles, ceil(inter / 64)), GEMM_THREADS threads,
// 2 * (A_STAGE + B_STAGE) bf16 of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
grouped_gate_up_silu(const ExpertTile* __restrict__ tiles, const bf16* __restrict__ x, u32 hidden, u32 inter,
                     bf16* __restrict__ act) {
    extern __shared__ __align__(16) u8 smem[];
    const ExpertTile t = tiles[blockIdx.x];
    if (t.rows == 0u) return;  // past the last tile of a table built on the device
    const u32 n0 = blockIdx.y * (TILE_COLS / 2u);
    const u32 cols = min(inter - n0, TILE_COLS / 2u);
    const BRows b = {{n0, inter + n0}, {cols, cols}};
    float acc[2][8][4] = {};
    tile_product(x, t.row0, t.rows, (const bf16*)t.gate_up, b, hidden, (bf16*)smem, acc);
    const u32 lane = lane_id(), wm = warp_id() & 1u;
#pragma unroll
    for (u32 m = 0; m < 2u; ++m)
#pragma unroll
        for (u32 half = 0; half < 2u; ++half) {
            const u32 r = wm * 32u + m * 16u + (lane >> 2) + half * 8u;
            if (r >= t.rows) continue;
            bf16* row = act + (u64)(t.row0 + r) * inter;
#pragma unroll
            for (u32 n = 0; n < 4u; ++n) {
                const u32 c = pair_row(n >> 1) + (n & 1u) * 8u + (lane & 3u) * 2u;  // < 64: gate half
                if (c >= cols) continue;  // cols is a multiple of 8: c + 1 is in range too
                const float* g = acc[m][n] + 2u * half;
                const float* u = acc[m][n + 4u] + 2u * half;
                const u32 lo = silu_mul_to_bf16_value(g[0], u[0]), hi = silu_mul_to_bf16_value(g[1], u[1]);
                *(u32*)(row + n0 + c) = lo | (hi << 16);
            }
        }
}

// act bf16 [*, inter], out f32 [*, hidden]; grid (tiles, ceil(hidden / 128)), as above.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
grouped_down(const ExpertTile* __restrict__ tiles, const bf16* __restrict__ act, u32 hidden, u32 inter,
             float* __restrict__ out) {
    extern __shared__ __align__(16) u8 smem[];
    const ExpertTile t = tiles[blockIdx.x];
    if (t.rows == 0u) return;  // past the last tile of a table built on the device
    const u32 n0 = blockIdx.y * TILE_COLS;
    const u32 cols = min(hidden - n0, TILE_COLS);
    const u32 half_cols = TILE_COLS / 2u;
    const BRows b = {{n0, n0 + half_cols}, {min(cols, half_cols), cols > half_cols ? cols - half_cols : 0u}};
    float acc[2][8][4] = {};
    tile_product(act, t.row0, t.rows, (const bf16*)t.down, b, inter, (bf16*)smem, acc);
    const u32 lane = lane_id(), wm = warp_id() & 1u;
#pragma unroll
    for (u32 m = 0; m < 2u; ++m)
#pragma unroll
        for (u32 half = 0; half < 2u; ++half) {
            const u32 r = wm * 32u + m * 16u + (lane >> 2) + half * 8u;
            if (r >= t.rows) continue;
            float* row = out + (u64)(t.row0 + r) * hidden + n0;
#pragma unroll
            for (u32 n = 0; n < 8u; ++n) {
                const u32 c = pair_row(n >> 1) + (n & 1u) * 8u + (lane & 3u) * 2u;
                if (c >= cols) continue;
                row[c] = acc[m][n][2u * half];
                row[c + 1u] = acc[m][n][2u * half + 1u];
            }
        }
}

// The tile table of groups whose rows were grouped on the device (the whole-model path ranks
// its pairs by expert there, so the host never sees the counts): expert e owns grouped rows
// offsets[e] .. offsets[e + 1] and the weights weights[2e] (gate-up) and weights[2e + 1]
// (down). Writes its ceil(count / TILE_ROWS) tiles in expert order from tiles[0]; the caller's
// table holds ceil(rows / TILE_ROWS) + n_experts entries, zeroed, and launches over all of them:
// the blocks past the last tile read a zero-row tile and return at once.
// One block; dynamic shared memory n_experts u32 (each expert's first tile).
extern "C" __global__ void expert_tiles(const u32* __restrict__ offsets, const u64* __restrict__ weights,
                                        u32 n_experts, ExpertTile* __restrict__ tiles) {
    extern __shared__ u32 shm[];
    if (threadIdx.x == 0) {
        u32 run = 0;
        for (u32 e = 0; e < n_experts; ++e) {
            shm[e] = run;
            run += (offsets[e + 1] - offsets[e] + TILE_ROWS - 1u) / TILE_ROWS;
        }
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < n_experts; e += blockDim.x) {
        const u32 end = offsets[e + 1];
        u32 at = shm[e];
        for (u32 r = offsets[e]; r < end; r += TILE_ROWS, ++at) {
            ExpertTile t;
            t.gate_up = weights[2u * e];
            t.down = weights[2u * e + 1u];
            t.row0 = r;
            t.rows = min(end - r, TILE_ROWS);
            tiles[at] = t;
        }
    }
}
