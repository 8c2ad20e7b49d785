// Attention on the GPU (whole-model path): new keys and values written into a paged KV cache
// (fixed-size blocks, per-sequence block tables), and causal prefill / decode attention over a
// chunk plus the cached context: flash attention on tensor cores (bf16 MMAs, f32 accumulate,
// online softmax, no materialised score matrix).
//
// Layouts. The cache of one layer is `[num_blocks, block_size, kv_heads, dim]` bf16, addressed
// by slot = block * block_size + offset; a sequence's blocks are a row of the flat
// `[seqs, max_blocks]` block-table array (rackfill_kernels::kv_blocks builds both on the host).
// Queries are f32 rows (straight out of a GEMM), the attention output is bf16 (the o_proj
// GEMM's input). Every sum runs in a fixed order: results are the same on every launch.

// Writes the new tokens' keys (and values, unless `v` is null) into the paged cache, one row of
// `rows` per new token: key row r is `k[r * k_row_stride + k_col ..][.. kv_heads * k_dim]` (so
// keys and values can be read straight out of a fused qkv GEMM output), rounded to bf16 at
// `k_cache[slots[r] * kv_heads * k_dim ..]`; likewise values. A slot of NONE_U32 (padding, the
// host's paged::NO_SLOT) is skipped. DeepSeek's MLA caches one latent row per token (kv_heads 1,
// k_dim = kv_lora_rank + qk_rope_head_dim) and no V: pass a null `v` (and `v_cache`).
//
// Launch: 1-D blocks of any size (128), any grid.x (rows is grid-strided; min(rows, 1024) is
// plenty); a block writes one row at a time, its threads on consecutive elements (coalesced).
extern "C" __global__ void kv_write(const float* __restrict__ k, u32 k_row_stride, u32 k_col,
                                    const float* __restrict__ v, u32 v_row_stride, u32 v_col,
                                    const u32* __restrict__ slots, u32 rows,
                                    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                    u32 kv_heads, u32 k_dim, u32 v_dim) {
    const u32 k_width = kv_heads * k_dim;
    const u32 v_width = kv_heads * v_dim;
    for (u32 row = blockIdx.x; row < rows; row += gridDim.x) {
        const u32 slot = slots[row];
        if (slot == NONE_U32) continue;
        const float* key = k + (u64)row * k_row_stride + k_col;
        bf16* k_dst = k_cache + (u64)slot * k_width;
        for (u32 e = threadIdx.x; e < k_width; e += blockDim.x) k_dst[e] = f32_to_bf16(key[e]);
        if (v != nullptr) {
            const float* value = v + (u64)row * v_row_stride + v_col;
            bf16* v_dst = v_cache + (u64)slot * v_width;
            for (u32 e = threadIdx.x; e < v_width; e += blockDim.x) v_dst[e] = f32_to_bf16(value[e]);
        }
    }
}

// Cache index of token `t` of the sequence whose block-table row is `table`.
__device__ __forceinline__ u64 token_slot(const u32* table, u32 t, u32 block_size) {
    return (u64)table[t / block_size] * block_size + t % block_size;
}

// Flash attention on tensor cores (FlashAttention-2's work split: each warp owns 16 query rows,
// keys stream through shared memory in tiles, softmax online in registers).
#define FLASH_THREADS 128  // four warps
#define FLASH_ROWS 64u     // query vectors per block: 16 per warp, one m16 MMA row tile
#define FLASH_PAD 8u       // bf16 per shared row beyond the data: rows stay 16-byte aligned, and
                           // the 8 rows one ldmatrix reads start in 8 different bank groups

// Starts copying `rows` shared rows of `width` bf16 (a multiple of 16, zero past `dim`) from
// the paged cache: row j is token t0 + j (zeros past `keys`), columns col0 .. col0 + width of
// head `head_offset`. 16-byte cp.async pieces (dim and strides are multiples of 8 bf16).
__device__ __forceinline__ void load_rows_async(bf16* tile, u32 stride, u32 rows, u32 width,
                                                const bf16* __restrict__ cache, u32 token_stride,
                                                u64 head_offset, u32 col0, u32 dim, const u32* table,
                                                u32 block_size, u32 t0, u32 keys) {
    const u32 pieces = width / 8u;
    for (u32 e = threadIdx.x; e < rows * pieces; e += blockDim.x) {
        const u32 j = e / pieces;
        const u32 c = (e - j * pieces) * 8u;
        const u32 t = t0 + j;
        const bool full = t < keys && col0 + c < dim;
        const bf16* src = cache;
        if (full) src = cache + token_slot(table, t, block_size) * token_stride + head_offset + col0 + c;
        cp_async_16(tile + j * stride + c, src, full);
    }
}

// Causal attention of a batch of sequences over their paged caches. Sequence s has ctx_len[s]
// tokens cached before this step and q_len[s] new ones, whose query rows are q_start[s] ..
// q_start[s] + q_len[s] of the step and whose keys and values kv_write has already cached; query
// row i sits at position ctx_len[s] + i and sees keys 0 ..= ctx_len[s] + i.
//
// q: f32, head h of row r at q[r * q_row_stride + h * qk_dim ..][.. qk_dim]. Keys: head j of
// token t at k_cache[slot(t) * k_token_stride + j * k_head_stride ..][.. qk_dim]; values
// likewise with their own pointer and strides, so V can be read out of the K cache (MLA's
// absorbed form: V is the first kv_lora_rank columns of the cached latent, v_cache = k_cache).
// Query head h reads KV head h / (q_heads / kv_heads) (grouped-query attention). The scale is a
// parameter: MLA's is set by the unabsorbed head width (and YaRN), not by qk_dim.
// out: bf16 [rows, q_heads, v_dim]. qk_dim, v_dim and the strides are multiples of 8.
//
// Grid: (ceil(max q_len * group / FLASH_ROWS), kv_heads * ceil(v_dim / V_COLS), seqs), 128
// threads; dynamic shared memory (FLASH_ROWS + 2 KEYS) * (qk + FLASH_PAD) * 2 + 2 KEYS *
// (V_COLS + FLASH_PAD) * 2 bytes, qk = qk_dim rounded up to 16 (kv_blocks::FlashTiles).
//
// Work split. A block owns 64 *query vectors* (one query row of one head) of one KV head of
// one sequence, in (row, head within the group) order, and V_COLS output columns: the heads of
// a GQA group share every key and value tile it loads (DeepSeek's absorbed MLA has one latent
// head for all heads), and its rows are consecutive, so their causal limits are nearly equal
// and the block stops at the last key its last row sees. Value heads wider than V_COLS (MLA's
// 512) take several blocks, each recomputing the scores: the accumulators of 16 rows x V_COLS
// columns live in registers.
//
// Per key tile (KEYS keys, double-buffered: tile i + 1 streams in by cp.async while tile i
// computes), each warp: S = Q K^T for its 16 rows by m16n8k16 MMAs (Q and K fragments by
// ldmatrix from shared memory; K rows are the B operand as stored), the causal mask, the online
// softmax in the log2 domain (running max and sum per row, accumulators rescaled when the max
// grows), then O += P V with P taken straight from the S accumulators as bf16 A fragments
// (FlashAttention-2's register reuse) and V fragments by ldmatrix.trans. Row sums stay per
// thread and are reduced across the 4 lanes of a row once, at the end. Every sum runs in a
// fixed order and tile boundaries sit at fixed key positions, so a row's result does not depend
// on the chunk or batch it came in.
template <u32 KEYS, u32 V_COLS>
__device__ void flash_attention(const float* __restrict__ q, u32 q_row_stride,
                                const bf16* __restrict__ k_cache, u32 k_token_stride, u32 k_head_stride,
                                const bf16* __restrict__ v_cache, u32 v_token_stride, u32 v_head_stride,
                                const u32* __restrict__ block_tables, u32 max_blocks, u32 block_size,
                                const u32* __restrict__ q_start, const u32* __restrict__ q_len,
                                const u32* __restrict__ ctx_len, bf16* __restrict__ out, u32 q_heads,
                                u32 kv_heads, u32 qk_dim, u32 v_dim, float scale) {
    extern __shared__ __align__(16) u8 smem[];
    const u32 seq = blockIdx.z;
    const u32 v_chunks = (v_dim + V_COLS - 1u) / V_COLS;
    const u32 kv_head = blockIdx.y / v_chunks;
    const u32 v_col0 = (blockIdx.y - kv_head * v_chunks) * V_COLS;
    const u32 group = q_heads / kv_heads;
    const u32 vectors = q_len[seq] * group;
    const u32 first = blockIdx.x * FLASH_ROWS;
    if (first >= vectors) return;  // the whole block: past this sequence's chunk
    const u32 ctx = ctx_len[seq];
    const u32 row0 = q_start[seq];
    const u32* table = block_tables + (u64)seq * max_blocks;
    // Keys the block's last vector sees: the most any of its vectors sees.
    const u32 keys = ctx + (min(first + FLASH_ROWS, vectors) - 1u) / group + 1u;

    const u32 qk = (qk_dim + 15u) & ~15u;
    const u32 qk_stride = qk + FLASH_PAD;
    const u32 v_stride = V_COLS + FLASH_PAD;
    bf16* q_tile = (bf16*)smem;
    bf16* k_tiles = q_tile + FLASH_ROWS * qk_stride;
    bf16* v_tiles = k_tiles + 2u * KEYS * qk_stride;

    const u32 lane = lane_id();
    const u32 warp = warp_id();
    const u64 k_head = (u64)kv_head * k_head_stride;
    const u64 v_head = (u64)kv_head * v_head_stride;
    auto load_kv = [&](u32 tile, u32 stage) {
        const u32 t0 = tile * KEYS;
        load_rows_async(k_tiles + stage * KEYS * qk_stride, qk_stride, KEYS, qk, k_cache, k_token_stride,
                        k_head, 0u, qk_dim, table, block_size, t0, keys);
        load_rows_async(v_tiles + stage * KEYS * v_stride, v_stride, KEYS, V_COLS, v_cache, v_token_stride,
                        v_head, v_col0, v_dim, table, block_size, t0, keys);
        cp_async_commit();
    };
    const u32 tiles = (keys + KEYS - 1u) / KEYS;
    load_kv(0u, 0u);

    // The block's queries, rounded to bf16 (zeros past qk_dim and past the last vector).
    for (u32 e = threadIdx.x; e < FLASH_ROWS * qk; e += blockDim.x) {
        const u32 r = e / qk;
        const u32 d = e - r * qk;
        const u32 vec = first + r;
        float value = 0.0f;
        if (vec < vectors && d < qk_dim) {
            const u32 head = kv_head * group + vec % group;
            value = q[(u64)(row0 + vec / group) * q_row_stride + (u64)head * qk_dim + d];
        }
        q_tile[r * qk_stride + d] = f32_to_bf16(value);
    }

    // This thread's two rows (lane / 4 and lane / 4 + 8 of the warp's 16) and the keys each
    // sees; a row past the last vector sees key 0 only (finite statistics, never written).
    const u32 vec_lo = first + warp * 16u + lane / 4u;
    u32 limit[2];
#pragma unroll
    for (u32 h = 0; h < 2u; ++h) {
        const u32 vec = vec_lo + 8u * h;
        limit[h] = vec < vectors ? ctx + vec / group + 1u : 1u;
    }
    // Warp-uniform: the keys the warp's first and last existing rows see.
    const u32 warp_first = first + warp * 16u;
    const bool warp_live = warp_first < vectors;
    const u32 warp_min_keys = ctx + warp_first / group + 1u;
    const u32 warp_max_keys = ctx + (min(warp_first + 16u, vectors) - 1u) / group + 1u;

    const float neg_inf = __uint_as_float(0xff800000u);
    const float scale_log2 = scale * 1.4426950408889634f;
    float row_max[2] = {neg_inf, neg_inf};
    float row_sum[2] = {0.0f, 0.0f};
    float acc[V_COLS / 8u][4];
#pragma unroll
    for (u32 n = 0; n < V_COLS / 8u; ++n)
#pragma unroll
        for (u32 i = 0; i < 4u; ++i) acc[n][i] = 0.0f;
    // Value column pairs of 16 this block computes (the rest of V_COLS are past v_dim).
    const u32 v_pairs = (min(V_COLS, v_dim - v_col0) + 15u) / 16u;

    for (u32 tile = 0; tile < tiles; ++tile) {
        const u32 stage = tile & 1u;
        if (tile + 1u < tiles) {
            load_kv(tile + 1u, stage ^ 1u);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile `tile` (and the queries) visible to every warp
        const u32 t0 = tile * KEYS;
        if (warp_live && t0 < warp_max_keys) {
            const bf16* k_tile = k_tiles + stage * KEYS * qk_stride;
            const bf16* v_tile = v_tiles + stage * KEYS * v_stride;
            float s[KEYS / 8u][4];
#pragma unroll
            for (u32 n = 0; n < KEYS / 8u; ++n)
#pragma unroll
                for (u32 i = 0; i < 4u; ++i) s[n][i] = 0.0f;
            // Lane l gives the address of row l % 16 (A: rows 0-7 then 8-15) at column
            // 8 (l / 16) of the 16x16 piece; for K, key 8 (l / 16) + l % 8 at column 8 ((l / 8) % 2).
            const bf16* q_row = q_tile + (warp * 16u + (lane & 15u)) * qk_stride + (lane >> 4) * 8u;
            const bf16* k_row = k_tile + ((lane >> 4) * 8u + (lane & 7u)) * qk_stride + ((lane >> 3) & 1u) * 8u;
            for (u32 d0 = 0; d0 < qk; d0 += 16u) {
                u32 a[4];
                ldmatrix_x4(a, q_row + d0);
#pragma unroll
                for (u32 n = 0; n < KEYS / 16u; ++n) {
                    u32 b[4];
                    ldmatrix_x4(b, k_row + n * 16u * qk_stride + d0);
                    mma_bf16_16816(s[2u * n], a, b);
                    mma_bf16_16816(s[2u * n + 1u], a, b + 2);
                }
            }
            // Scale, mask, and the online softmax's statistics (a row's 4 lanes agree).
            const bool masked = t0 + KEYS > warp_min_keys;
            float tile_max[2] = {neg_inf, neg_inf};
#pragma unroll
            for (u32 n = 0; n < KEYS / 8u; ++n)
#pragma unroll
                for (u32 i = 0; i < 4u; ++i) {
                    const u32 key = t0 + n * 8u + 2u * (lane & 3u) + (i & 1u);
                    float v = s[n][i] * scale_log2;
                    if (masked && key >= limit[i >> 1]) v = neg_inf;
                    s[n][i] = v;
                    tile_max[i >> 1] = fmaxf(tile_max[i >> 1], v);
                }
            float correction[2];
#pragma unroll
            for (u32 h = 0; h < 2u; ++h) {
                float m = tile_max[h];
                m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 1));
                m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 2));
                const float new_max = fmaxf(row_max[h], m);  // finite: every row saw key 0
                correction[h] = exp2f(row_max[h] - new_max);
                row_max[h] = new_max;
                row_sum[h] *= correction[h];
            }
#pragma unroll
            for (u32 n = 0; n < KEYS / 8u; ++n)
#pragma unroll
                for (u32 i = 0; i < 4u; ++i) {
                    const float p = exp2f(s[n][i] - row_max[i >> 1]);
                    s[n][i] = p;
                    row_sum[i >> 1] += p;
                }
#pragma unroll
            for (u32 n = 0; n < V_COLS / 8u; ++n)
#pragma unroll
                for (u32 i = 0; i < 4u; ++i) acc[n][i] *= correction[i >> 1];
            // O += P V: lane l gives key 8 ((l / 8) % 2) + l % 8 of the 16, columns 8 (l / 16).
            const bf16* v_row = v_tile + (((lane >> 3) & 1u) * 8u + (lane & 7u)) * v_stride + (lane >> 4) * 8u;
#pragma unroll
            for (u32 kk = 0; kk < KEYS / 16u; ++kk) {
                const u32 p[4] = {pack_bf16(s[2u * kk][0], s[2u * kk][1]), pack_bf16(s[2u * kk][2], s[2u * kk][3]),
                                  pack_bf16(s[2u * kk + 1u][0], s[2u * kk + 1u][1]),
                                  pack_bf16(s[2u * kk + 1u][2], s[2u * kk + 1u][3])};
#pragma unroll
                for (u32 n = 0; n < V_COLS / 16u; ++n) {
                    if (n >= v_pairs) break;
                    u32 b[4];
                    ldmatrix_x4_trans(b, v_row + kk * 16u * v_stride + n * 16u);
                    mma_bf16_16816(acc[2u * n], p, b);
                    mma_bf16_16816(acc[2u * n + 1u], p, b + 2);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    if (!warp_live) return;
#pragma unroll
    for (u32 h = 0; h < 2u; ++h) {
        float total = row_sum[h];
        total += __shfl_xor_sync(FULL_MASK, total, 1);
        total += __shfl_xor_sync(FULL_MASK, total, 2);
        const u32 vec = vec_lo + 8u * h;
        if (vec >= vectors) continue;
        const float inv = 1.0f / total;
        const u32 head = kv_head * group + vec % group;
        bf16* dst = out + ((u64)(row0 + vec / group) * q_heads + head) * v_dim + v_col0;
#pragma unroll
        for (u32 n = 0; n < V_COLS / 8u; ++n) {
            const u32 col = n * 8u + 2u * (lane & 3u);
            if (v_col0 + col >= v_dim) break;
            *(u32*)(dst + col) = pack_bf16(acc[n][2u * h] * inv, acc[n][2u * h + 1u] * inv);
        }
    }
}

// The tile shapes `rackfill bench attention` sweeps; the host picks one per shape
// (kv_blocks::FlashTiles): keys per shared tile, value columns per block.
#define FLASH_ARGS                                                                                           \
    const float *__restrict__ q, u32 q_row_stride, const bf16 *__restrict__ k_cache, u32 k_token_stride,     \
        u32 k_head_stride, const bf16 *__restrict__ v_cache, u32 v_token_stride, u32 v_head_stride,          \
        const u32 *__restrict__ block_tables, u32 max_blocks, u32 block_size, const u32 *__restrict__ q_start, \
        const u32 *__restrict__ q_len, const u32 *__restrict__ ctx_len, bf16 *__restrict__ out, u32 q_heads,  \
        u32 kv_heads, u32 qk_dim, u32 v_dim, float scale
#define FLASH_PASS                                                                                          \
    q, q_row_stride, k_cache, k_token_stride, k_head_stride, v_cache, v_token_stride, v_head_stride,        \
        block_tables, max_blocks, block_size, q_start, q_len, ctx_len, out, q_heads, kv_heads, qk_dim, v_dim, \
        scale
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
flash_attention_k64_v64(FLASH_ARGS) {
    flash_attention<64, 64>(FLASH_PASS);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
flash_attention_k64_v128(FLASH_ARGS) {
    flash_attention<64, 128>(FLASH_PASS);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
flash_attention_k32_v128(FLASH_ARGS) {
    flash_attention<32, 128>(FLASH_PASS);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS)
flash_attention_k32_v256(FLASH_ARGS) {
    flash_attention<32, 256>(FLASH_PASS);
}

// The unfused baseline `rackfill bench attention` measures paged_attention against: the scores
// come from one cuBLAS GEMM, this kernel turns them into probabilities, a second GEMM applies
// them to the values. Row r of `scores` (`rows x keys`, f32) holds query position
// ctx + (r % q_len) against keys 0..keys; later keys are masked. Writes softmax(scale * scores)
// in bf16 (masked keys 0). Grid: one block per row (grid-stride).
extern "C" __global__ void causal_softmax_to_bf16(const float* __restrict__ scores, u32 rows, u32 q_len,
                                                  u32 keys, u32 ctx, float scale, bf16* __restrict__ out) {
    __shared__ float scratch[32];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* s = scores + (u64)r * keys;
        bf16* o = out + (u64)r * keys;
        const u32 visible = min(keys, ctx + r % q_len + 1u);
        float m = -3.0e38f;
        for (u32 c = threadIdx.x; c < visible; c += blockDim.x) m = fmaxf(m, s[c] * scale);
        m = block_max_f32(m, scratch);
        float sum = 0.0f;
        for (u32 c = threadIdx.x; c < visible; c += blockDim.x) sum += expf(s[c] * scale - m);
        const float inv = 1.0f / block_sum_f32(sum, scratch);
        for (u32 c = threadIdx.x; c < keys; c += blockDim.x)
            o[c] = f32_to_bf16(c < visible ? expf(s[c] * scale - m) * inv : 0.0f);
    }
}
