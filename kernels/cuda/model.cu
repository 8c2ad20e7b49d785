// The dense parts of a decoder layer on the GPU (whole-model path): embedding gather, RMSNorm,
// rotary embeddings, residual and bias adds, bf16 conversions, row gathers, the gated activation
// on bf16 and the routers. Weights are bf16, arithmetic f32.
//
// Layouts: the residual stream x is f32 [T, H] row-major; GEMM inputs are bf16, GEMM outputs
// f32. Every kernel walks its rows grid-stride over blockIdx.x, so any grid size is correct.
// Kernels that reduce across a block (norms, routers) need blockDim.x a multiple of 32.
//
// Each kernel reproduces the CPU reference of rackfill-models (models/src/layers) operation by
// operation: where the CPU result is a sequence of separately rounded f32 operations the kernel
// uses __fmul_rn / __fadd_rn (NVRTC would otherwise fuse a multiply and an add into one FMA),
// and transcendental functions the CPU takes from libm are evaluated in double and rounded once,
// so the two agree to the bit except where a reduction order differs (the norms' sums of squares).

// -inf without any CUDA header.
#define MODEL_NEG_INF __uint_as_float(0xff800000u)

// The routers keep one row's scores in shared memory: at most this many experts (DeepSeek-V3
// has 256) and this many selected per token.
#define ROUTER_MAX_EXPERTS 1024u
#define ROUTER_MAX_K 32u

// The rotary kernel keeps one row's cos / sin in shared memory: at most 2 * ROPE_MAX_HALF
// rotated dimensions per head.
#define ROPE_MAX_HALF 256u

// e^x as libm's expf computes it (correctly rounded in all but rare cases): the routers'
// softmax and sigmoid use Rust's f32::exp, i.e. glibc's expf.
__device__ __forceinline__ float libm_expf(float x) { return (float)exp((double)x); }

// Rust `1.0 / (1.0 + (-l).exp())` (router.rs; candle's sigmoid adds in the other order, the
// same IEEE sum).
__device__ __forceinline__ float libm_sigmoidf(float l) { return 1.0f / (1.0f + libm_expf(-l)); }

// Block-wide f32 maximum (fmaxf: NaN-ignoring like Rust's f32::max); `scratch` holds one float
// per warp; every thread must call it and gets the result.
__device__ float router_block_max_f32(float v, float* scratch) {
    v = warp_max_f32(v);
    if (lane_id() == 0) scratch[warp_id()] = v;
    __syncthreads();
    const u32 warps = (blockDim.x + 31u) >> 5;
    float best = MODEL_NEG_INF;
    for (u32 w = 0; w < warps; ++w) best = fmaxf(best, scratch[w]);
    __syncthreads();
    return best;
}

// ---------------------------------------------------------------------------------------------
// Embedding, conversions, gathers.

// out [n, hidden] f32 = table [vocab, hidden] bf16 at rows ids [n]. One block per token.
extern "C" __global__ void embed_rows(const bf16* __restrict__ table, const u32* __restrict__ ids, u32 n,
                                      u32 hidden, float* __restrict__ out) {
    for (u32 i = blockIdx.x; i < n; i += gridDim.x) {
        const bf16* from = table + (u64)ids[i] * hidden;
        float* to = out + (u64)i * hidden;
        for (u32 h = threadIdx.x; h < hidden; h += blockDim.x) to[h] = bf16_to_f32(from[h]);
    }
}

// out [rows, cols] bf16 (row stride out_stride) = x [rows, cols] f32 (row stride x_stride),
// rounded to nearest even: a GEMM input from f32 activations (e.g. the attention output).
extern "C" __global__ void f32_to_bf16_rows(const float* __restrict__ x, u32 x_stride, u32 rows, u32 cols,
                                            bf16* __restrict__ out, u32 out_stride) {
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* from = x + (u64)r * x_stride;
        bf16* to = out + (u64)r * out_stride;
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) to[c] = f32_to_bf16(from[c]);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: candle_nn::ops::rms_norm (RmsNorm in models/src/layers/mod.rs), in f32:
// m = sqrt(sum(x^2) / dim + eps), y = x / m * w. The sum is a parallel reduction here (a
// sequential one on the CPU), the only source of difference.

// m of one row of `dim` values, reduced across the block; every thread gets it.
__device__ float rms_of_row(const float* x, u32 dim, float eps, float* scratch) {
    float sq = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) sq += x[c] * x[c];
    const float sum = block_sum_f32(sq, scratch);
    return sqrtf(sum / (float)dim + eps);
}

// out [rows, dim] bf16 (row stride out_stride) = rms_norm(x [rows, dim] f32 (row stride
// x_stride)) * weight [dim] bf16. A stride wider than dim normalises the first dim columns of
// wider rows (DeepSeek's kv_a_layernorm over the latent part of kv_a's output). One block per
// row, blockDim.x a multiple of 32.
extern "C" __global__ void rms_norm_to_bf16(const float* __restrict__ x, u32 x_stride, const bf16* __restrict__ weight,
                                            float eps, u32 rows, u32 dim, bf16* __restrict__ out, u32 out_stride) {
    __shared__ float scratch[32];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + (u64)r * x_stride;
        const float m = rms_of_row(row, dim, eps, scratch);
        bf16* to = out + (u64)r * out_stride;
        for (u32 c = threadIdx.x; c < dim; c += blockDim.x)
            to[c] = f32_to_bf16(row[c] / m * bf16_to_f32(weight[c]));
    }
}

// x [rows, dim] f32 (row stride `stride`) = rms_norm(x) * weight [dim] bf16, in place: Qwen3's
// per-head q_norm / k_norm (rows = tokens * heads, dim = head_dim, stride = head_dim). One warp
// per row (head_dim is 64..256), blockDim.x a multiple of 32.
extern "C" __global__ void rms_norm_inplace(float* __restrict__ x, u32 stride, const bf16* __restrict__ weight,
                                            float eps, u32 rows, u32 dim) {
    const u32 warps = blockDim.x >> 5;
    for (u32 r = blockIdx.x * warps + warp_id(); r < rows; r += gridDim.x * warps) {
        float* row = x + (u64)r * stride;
        float sq = 0.0f;
        for (u32 c = lane_id(); c < dim; c += 32u) sq += row[c] * row[c];
        const float m = sqrtf(warp_sum_f32(sq) / (float)dim + eps);
        for (u32 c = lane_id(); c < dim; c += 32u) row[c] = row[c] / m * bf16_to_f32(weight[c]);
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embeddings: models/src/layers/rope.rs Rope::tables + candle's rope / rope_i.

// In place on x [rows, *] f32 (row stride row_stride): for each of `heads` heads (head h starts
// at column h * head_stride), rotates columns [offset, offset + rot_dim) by the angles
// positions[row] * inv_freq[i], i < rot_dim / 2, with cos and sin multiplied by
// attention_factor (YaRN's magnitude; 1 otherwise). inv_freq [rot_dim / 2] f32 is Rope's own
// table (default, linear or YaRN schedule). Layouts: half-split (interleaved = 0, Qwen /
// Mixtral: pairs (i, i + rot_dim / 2)) or pairwise (interleaved = 1, DeepSeek: pairs (2i, 2i+1)).
// As on the CPU: angle = f32(pos) * inv_freq in f32, cos / sin of it in double rounded to f32,
// then times attention_factor, then x1 c - x2 s and x1 s + x2 c with every product rounded.
// DeepSeek: q's rope part is offset = qk_nope_head_dim in each of the heads (head_stride =
// nope + rope); k's is the one head at offset = kv_lora_rank of kv_a's output rows.
// One block per row; rot_dim <= 2 * ROPE_MAX_HALF.
extern "C" __global__ void rope(float* __restrict__ x, u32 row_stride, u32 heads, u32 head_stride, u32 offset,
                                u32 rot_dim, const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                                float attention_factor, u32 interleaved, u32 rows) {
    __shared__ float cos_t[ROPE_MAX_HALF];
    __shared__ float sin_t[ROPE_MAX_HALF];
    const u32 half = rot_dim >> 1;
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float pos = (float)positions[r];
        for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
            const double angle = (double)__fmul_rn(pos, inv_freq[i]);
            cos_t[i] = __fmul_rn((float)cos(angle), attention_factor);
            sin_t[i] = __fmul_rn((float)sin(angle), attention_factor);
        }
        __syncthreads();
        float* row = x + (u64)r * row_stride + offset;
        for (u32 j = threadIdx.x; j < heads * half; j += blockDim.x) {
            const u32 h = j / half, i = j % half;
            float* head = row + (u64)h * head_stride;
            const u32 a = interleaved ? 2u * i : i;
            const u32 b = interleaved ? 2u * i + 1u : i + half;
            const float x1 = head[a], x2 = head[b], c = cos_t[i], s = sin_t[i];
            head[a] = __fadd_rn(__fmul_rn(x1, c), -__fmul_rn(x2, s));
            head[b] = __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c));
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise.

// x [n] += y [n], f32: the residual adds.
extern "C" __global__ void add_inplace(float* __restrict__ x, const float* __restrict__ y, u32 n) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) x[i] = __fadd_rn(x[i], y[i]);
}

// x [rows, cols] f32 (row stride `stride`) += bias [cols] bf16 on every row: Linear's bias
// (Qwen2's q/k/v projections, attention_bias / attention_out_bias).
extern "C" __global__ void add_bias_rows(float* __restrict__ x, u32 stride, const bf16* __restrict__ bias, u32 rows,
                                         u32 cols) {
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* row = x + (u64)r * stride;
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) row[c] = __fadd_rn(row[c], bf16_to_f32(bias[c]));
    }
}

// x [rows, cols] f32 (row stride `stride`) *= sigmoid(logits[r * logit_stride]) row by row:
// Qwen2-MoE's gated shared expert, out * sigmoid(shared_expert_gate(x)) (moe.rs SharedExpert).
extern "C" __global__ void sigmoid_scale_rows(float* __restrict__ x, u32 stride, const float* __restrict__ logits,
                                              u32 logit_stride, u32 rows, u32 cols) {
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float s = libm_sigmoidf(logits[(u64)r * logit_stride]);
        float* row = x + (u64)r * stride;
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) row[c] = __fmul_rn(row[c], s);
    }
}

// out [rows, inter] bf16 = silu(gate) * up of gate_up [rows, 2 * inter] f32 (gate in columns
// 0..inter, up in inter..2 * inter): fastmath.rs silu_mul, g / (1 + e^-g) * u with its e^x,
// then rounded to bf16 as the input of the down projection.
extern "C" __global__ void silu_mul_to_bf16(const float* __restrict__ gate_up, u32 rows, u32 inter,
                                            bf16* __restrict__ out) {
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* gate = gate_up + (u64)r * 2u * inter;
        const float* up = gate + inter;
        bf16* to = out + (u64)r * inter;
        for (u32 j = threadIdx.x; j < inter; j += blockDim.x) {
            to[j] = silu_mul_to_bf16_value(gate[j], up[j]);
        }
    }
}

// out [tokens, hidden] f32 += the routed experts' weighted sum: for each token t, acc = 0 then
// acc += weights[p] * expert_out[pair_row[p]] for p = t * k + j, j = 0..k in order, every
// product and sum rounded (kernels/src/permute.rs combine, which MoeBlock::forward_routed
// runs), then out[t] = out[t] + acc. expert_out [pairs, hidden] f32 holds the experts' outputs
// in grouped order; pair_row [tokens * k] maps (token, j) to its row there. `out` holds the
// shared experts' output (or zeros) and must not be the residual stream: the CPU adds
// routed + shared first, then the residual.
extern "C" __global__ void combine_topk_rows(const float* __restrict__ expert_out, const u32* __restrict__ pair_row,
                                             const float* __restrict__ weights, u32 tokens, u32 k, u32 hidden,
                                             float* __restrict__ out) {
    for (u32 t = blockIdx.x; t < tokens; t += gridDim.x) {
        for (u32 h = threadIdx.x; h < hidden; h += blockDim.x) {
            float acc = 0.0f;
            for (u32 j = 0; j < k; ++j) {
                const u64 p = (u64)t * k + j;
                acc = __fadd_rn(acc, __fmul_rn(weights[p], expert_out[(u64)pair_row[p] * hidden + h]));
            }
            float* o = out + (u64)t * hidden + h;
            *o = __fadd_rn(*o, acc);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Routers: models/src/layers/router.rs on f32 logits [rows, experts]; outputs ids [rows, k] and
// weights [rows, k] in selection order (largest first, ties to the lower expert id, Rust's
// f32::total_cmp order). One block per token, blockDim.x a multiple of 32;
// experts <= ROUTER_MAX_EXPERTS, k <= ROUTER_MAX_K (the host checks).

// f32 bits to a u32 whose unsigned order is f32::total_cmp's.
__device__ __forceinline__ u32 total_cmp_key(float v) {
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k largest of v [n] (shared), largest first, ties to the lower index: k rounds of a
// block-wide max over (value, reversed index) keys. `taken` [n] (shared) is scratch. Every
// thread calls it; thread 0 gets the indices in `chosen`.
__device__ void router_top_k(const float* v, u32 n, u32 k, u8* taken, u64* scratch, u32* chosen) {
    for (u32 e = threadIdx.x; e < n; e += blockDim.x) taken[e] = 0;
    __syncthreads();
    for (u32 j = 0; j < k; ++j) {
        u64 best = 0;
        for (u32 e = threadIdx.x; e < n; e += blockDim.x) {
            const u64 key = ((u64)total_cmp_key(v[e]) << 32) | (u64)(NONE_U32 - e);
            if (!taken[e] && key > best) best = key;
        }
        best = block_max_u64(best, scratch);
        const u32 e = NONE_U32 - (u32)best;
        if (threadIdx.x == 0 && e < n) {
            chosen[j] = e;
            taken[e] = 1;
        }
        __syncthreads();
    }
}

// router.rs softmax_top_k: p = softmax(logits) (max-subtracted, e^x as libm, the sum in expert
// order), the k largest p, then, if renormalise, each divided by their sum (in selection order).
// Qwen2/3-MoE (renormalise = norm_topk_prob) and Mixtral (renormalise = 1).
extern "C" __global__ void router_softmax_topk(const float* __restrict__ logits, u32 rows, u32 experts, u32 k,
                                               u32 renormalise, u32* __restrict__ ids,
                                               float* __restrict__ weights) {
    __shared__ float probs[ROUTER_MAX_EXPERTS];
    __shared__ u8 taken[ROUTER_MAX_EXPERTS];
    __shared__ u64 scratch[32];
    __shared__ float fscratch[32];
    __shared__ float total;
    __shared__ u32 chosen[ROUTER_MAX_K];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* l = logits + (u64)r * experts;
        float m = MODEL_NEG_INF;
        for (u32 e = threadIdx.x; e < experts; e += blockDim.x) m = fmaxf(m, l[e]);
        m = router_block_max_f32(m, fscratch);
        for (u32 e = threadIdx.x; e < experts; e += blockDim.x) probs[e] = libm_expf(l[e] - m);
        __syncthreads();
        if (threadIdx.x == 0) {
            float s = 0.0f;
            for (u32 e = 0; e < experts; ++e) s += probs[e];
            total = s;
        }
        __syncthreads();
        for (u32 e = threadIdx.x; e < experts; e += blockDim.x) probs[e] = probs[e] / total;
        __syncthreads();
        router_top_k(probs, experts, k, taken, scratch, chosen);
        if (threadIdx.x == 0) {
            float sum = 0.0f;
            for (u32 j = 0; j < k; ++j) sum += probs[chosen[j]];
            for (u32 j = 0; j < k; ++j) {
                const float w = probs[chosen[j]];
                ids[(u64)r * k + j] = chosen[j];
                weights[(u64)r * k + j] = renormalise ? w / sum : w;
            }
        }
        __syncthreads();
    }
}

// router.rs sigmoid_grouped_top_k + Router::route (DeepSeek-V3): s = sigmoid(logits); experts
// are chosen on c = s + correction_bias (null: no bias) among the topk_groups of the `groups`
// equal expert groups whose two best c sum highest (experts of the other groups compete with
// c = 0, as in transformers); the weights are the chosen s, if renormalise divided by their sum
// + 1e-20, then times scaling. experts % groups == 0.
extern "C" __global__ void router_sigmoid_grouped_topk(const float* __restrict__ logits,
                                                       const float* __restrict__ correction_bias, u32 rows,
                                                       u32 experts, u32 groups, u32 topk_groups, u32 k,
                                                       u32 renormalise, float scaling, u32* __restrict__ ids,
                                                       float* __restrict__ weights) {
    __shared__ float scores[ROUTER_MAX_EXPERTS];
    __shared__ float choice[ROUTER_MAX_EXPERTS];
    __shared__ float group_score[ROUTER_MAX_EXPERTS];
    __shared__ u8 taken[ROUTER_MAX_EXPERTS];
    __shared__ u64 scratch[32];
    __shared__ u32 chosen[ROUTER_MAX_K];
    const u32 per_group = experts / groups;
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* l = logits + (u64)r * experts;
        for (u32 e = threadIdx.x; e < experts; e += blockDim.x) {
            const float s = libm_sigmoidf(l[e]);
            scores[e] = s;
            choice[e] = correction_bias ? s + correction_bias[e] : s;
        }
        __syncthreads();
        // Group score: its best corrected score plus its second best (one thread per group).
        for (u32 g = threadIdx.x; g < groups; g += blockDim.x) {
            const float* c = choice + g * per_group;
            u32 first = 0;
            for (u32 i = 1; i < per_group; ++i)
                if (total_cmp_key(c[i]) > total_cmp_key(c[first])) first = i;
            float sum = c[first];
            if (per_group > 1) {
                u32 second = first == 0 ? 1u : 0u;
                for (u32 i = 0; i < per_group; ++i)
                    if (i != first && total_cmp_key(c[i]) > total_cmp_key(c[second])) second = i;
                sum = sum + c[second];
            }
            group_score[g] = sum;
        }
        __syncthreads();
        router_top_k(group_score, groups, topk_groups, taken, scratch, chosen);
        // taken[g] now marks the kept groups; zero the others' experts.
        for (u32 e = threadIdx.x; e < experts; e += blockDim.x)
            if (!taken[e / per_group]) choice[e] = 0.0f;
        __syncthreads();
        router_top_k(choice, experts, k, taken, scratch, chosen);
        if (threadIdx.x == 0) {
            float sum = 0.0f;
            for (u32 j = 0; j < k; ++j) sum += scores[chosen[j]];
            sum = sum + 1e-20f;
            for (u32 j = 0; j < k; ++j) {
                float w = scores[chosen[j]];
                if (renormalise) w = w / sum;
                ids[(u64)r * k + j] = chosen[j];
                weights[(u64)r * k + j] = __fmul_rn(w, scaling);
            }
        }
        __syncthreads();
    }
}
