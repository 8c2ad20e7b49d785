// Attention on the GPU (whole-model path): new keys and values written into a paged KV cache
// (fixed-size blocks, per-sequence block tables), and causal prefill / decode attention over a
// chunk plus the cached context with an online softmax (no materialised score matrix).
//
// Layouts. The cache of one layer is `[num_blocks, block_size, kv_heads, dim]` bf16, addressed
// by slot = block * block_size + offset; a sequence's blocks are a row of the flat
// `[seqs, max_blocks]` block-table array (rackfill_kernels::paged builds both on the host).
// Queries are f32 rows (straight out of a GEMM), the attention output is bf16 (the o_proj
// GEMM's input). Every sum runs in a fixed order: results are the same on every launch.

// Launch geometry shared with the host (rackfill_kernels::paged::AttentionShape).
#define ATTN_WARPS 4u
#define QUERIES_PER_WARP 4u
#define QUERIES_PER_BLOCK 16u  // ATTN_WARPS * QUERIES_PER_WARP
#define KEYS_PER_TILE 16u      // half a warp: lane & 15 picks the key
#define MAX_V_PER_LANE 16u     // output columns a lane owns per query: v_dim <= 512
#define K_PAD 2u               // bf16 padding per shared K row, so the 16 lanes reading 16 keys
                               // at one column hit 16 different banks

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

// Copies keys t0 .. t0 + KEYS_PER_TILE of one KV head into a shared tile of row stride
// `row_stride` (bf16), zeros past `keys` (so masked keys never feed NaN garbage into P.V).
__device__ void load_tile(bf16* tile, u32 row_stride, const bf16* __restrict__ cache, u32 token_stride,
                          u64 head_offset, u32 dim, const u32* table, u32 block_size, u32 t0, u32 keys) {
    for (u32 e = threadIdx.x; e < KEYS_PER_TILE * dim; e += blockDim.x) {
        const u32 j = e / dim;
        const u32 d = e - j * dim;
        const u32 t = t0 + j;
        bf16 value = 0;
        if (t < keys) value = cache[token_slot(table, t, block_size) * token_stride + head_offset + d];
        tile[j * row_stride + d] = value;
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
// out: bf16 [rows, q_heads, v_dim]. Requires v_dim <= 512.
//
// Grid: (ceil(max q_len * group / QUERIES_PER_BLOCK), kv_heads, seqs), 128 threads, dynamic
// shared memory KEYS_PER_TILE * ((qk_dim + K_PAD + v_dim) * 2) + QUERIES_PER_BLOCK *
// KEYS_PER_TILE * 4 bytes (35 KB at DeepSeek's 576 / 512: under the default 48 KB).
//
// Why this grid: a block owns 16 *query vectors* (one query row of one head) of one KV head of
// one sequence, taken in (row, head within the group) order. Every key and value tile it loads
// into shared memory then serves all 16: the heads of a GQA group share one load (DeepSeek's
// absorbed MLA has a single latent head shared by all heads, so decode still gets 16 heads per
// block), and the vectors' rows are consecutive, so their causal limits are nearly equal and the
// block stops at the last key its last row sees: almost no work on masked keys. Blocks past a
// shorter sequence's chunk exit at once. Within a block each warp owns 4 vectors; a 16-key tile
// is split over the lanes (lane & 15 the key, lane >> 4 the even or odd dims), so a score is an
// in-register dot product plus one shuffle and the softmax statistics one warp reduction per
// vector and tile; for P.V each lane owns the output columns lane, lane + 32, ... (coalesced
// shared reads, accumulators in registers). The online softmax keeps a running maximum and sum
// per vector and rescales the accumulators when the maximum grows: no score matrix is ever
// stored, and shared memory does not grow with the context. Q is read from global memory (L1
// holds a block's 16 vectors), which keeps DeepSeek-sized K and V tiles within 48 KB.
// Not done: tensor cores, and a split-key decode kernel (with a small group, q_len 1 leaves most
// of a block's warps idle and long contexts use few blocks).
extern "C" __global__ void paged_attention(const float* __restrict__ q, u32 q_row_stride,
                                           const bf16* __restrict__ k_cache, u32 k_token_stride,
                                           u32 k_head_stride, const bf16* __restrict__ v_cache,
                                           u32 v_token_stride, u32 v_head_stride,
                                           const u32* __restrict__ block_tables, u32 max_blocks,
                                           u32 block_size, const u32* __restrict__ q_start,
                                           const u32* __restrict__ q_len, const u32* __restrict__ ctx_len,
                                           bf16* __restrict__ out, u32 q_heads, u32 kv_heads, u32 qk_dim,
                                           u32 v_dim, float scale) {
    extern __shared__ __align__(16) u8 smem[];
    const u32 seq = blockIdx.z;
    const u32 kv_head = blockIdx.y;
    const u32 group = q_heads / kv_heads;
    const u32 vectors = q_len[seq] * group;
    const u32 first = blockIdx.x * QUERIES_PER_BLOCK;
    if (first >= vectors) return;  // the whole block: past this sequence's chunk
    const u32 ctx = ctx_len[seq];
    const u32 row0 = q_start[seq];
    const u32* table = block_tables + (u64)seq * max_blocks;
    // Keys the block's last vector sees: the most any of its vectors sees.
    const u32 last = min(first + QUERIES_PER_BLOCK, vectors) - 1u;
    const u32 keys = ctx + last / group + 1u;

    const u32 k_row = qk_dim + K_PAD;
    bf16* k_tile = (bf16*)smem;
    bf16* v_tile = k_tile + KEYS_PER_TILE * k_row;
    float* probs = (float*)(v_tile + KEYS_PER_TILE * v_dim);

    const u32 lane = lane_id();
    const u32 key = lane & 15u;
    const u32 half = lane >> 4;
    const float neg_inf = __uint_as_float(0xff800000u);

    // This warp's vectors: keys each sees (0: no such vector), its query and its output row.
    u32 limit[QUERIES_PER_WARP];
    const float* query[QUERIES_PER_WARP];
    u64 out_at[QUERIES_PER_WARP];
    float run_max[QUERIES_PER_WARP];
    float run_sum[QUERIES_PER_WARP];
    float acc[QUERIES_PER_WARP][MAX_V_PER_LANE];
#pragma unroll
    for (u32 i = 0; i < QUERIES_PER_WARP; ++i) {
        const u32 vec = first + warp_id() * QUERIES_PER_WARP + i;
        const u32 row = vec / group;
        const u32 head = kv_head * group + vec % group;
        limit[i] = vec < vectors ? ctx + row + 1u : 0u;
        query[i] = q + (u64)(row0 + row) * q_row_stride + (u64)head * qk_dim;
        out_at[i] = ((u64)(row0 + row) * q_heads + head) * v_dim;
        run_max[i] = neg_inf;
        run_sum[i] = 0.0f;
#pragma unroll
        for (u32 c = 0; c < MAX_V_PER_LANE; ++c) acc[i][c] = 0.0f;
    }

    for (u32 t0 = 0; t0 < keys; t0 += KEYS_PER_TILE) {
        __syncthreads();  // every warp is done with the previous tile
        load_tile(k_tile, k_row, k_cache, k_token_stride, (u64)kv_head * k_head_stride, qk_dim, table,
                  block_size, t0, keys);
        load_tile(v_tile, v_dim, v_cache, v_token_stride, (u64)kv_head * v_head_stride, v_dim, table,
                  block_size, t0, keys);
        __syncthreads();
#pragma unroll
        for (u32 i = 0; i < QUERIES_PER_WARP; ++i) {
            // Warp-uniform: the vector sees no key of this tile (or does not exist).
            if (t0 >= limit[i]) continue;
            float s = 0.0f;
            const bf16* k_j = k_tile + key * k_row;
            for (u32 d = half; d < qk_dim; d += 2u) s += query[i][d] * bf16_to_f32(k_j[d]);
            s += __shfl_xor_sync(FULL_MASK, s, 16);
            const bool seen = t0 + key < limit[i];
            s = seen ? s * scale : neg_inf;
            // Finite: key t0 is seen. The first tile's correction is exp(-inf) = 0.
            const float new_max = fmaxf(run_max[i], warp_max_f32(s));
            const float p = seen ? expf(s - new_max) : 0.0f;
            const float correction = expf(run_max[i] - new_max);
            run_sum[i] = run_sum[i] * correction + warp_sum_f32(half == 0u ? p : 0.0f);
            run_max[i] = new_max;
            float* p_row = probs + (warp_id() * QUERIES_PER_WARP + i) * KEYS_PER_TILE;
            if (half == 0u) p_row[key] = p;
            __syncwarp();
            const u32 seen_keys = min(KEYS_PER_TILE, limit[i] - t0);
#pragma unroll
            for (u32 c = 0; c < MAX_V_PER_LANE; ++c) {
                const u32 col = lane + 32u * c;
                if (col >= v_dim) break;
                float a = acc[i][c] * correction;
                for (u32 j = 0; j < seen_keys; ++j) a += p_row[j] * bf16_to_f32(v_tile[j * v_dim + col]);
                acc[i][c] = a;
            }
        }
    }

#pragma unroll
    for (u32 i = 0; i < QUERIES_PER_WARP; ++i) {
        if (limit[i] == 0u) continue;
        const float inv = 1.0f / run_sum[i];
#pragma unroll
        for (u32 c = 0; c < MAX_V_PER_LANE; ++c) {
            const u32 col = lane + 32u * c;
            if (col >= v_dim) break;
            out[out_at[i] + col] = f32_to_bf16(acc[i][c] * inv);
        }
    }
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
