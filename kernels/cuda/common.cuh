// Shared prelude of every rackfill CUDA source. The host prepends it to each kernel file before
// handing the source to NVRTC (followed by a #line directive, so NVRTC logs keep the kernel
// file's own line numbers): NVRTC compiles one string per program and has no include path here.
//
// Everything in these files is plain CUDA C++ that NVRTC compiles without any CUDA header.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef int i32;
typedef unsigned char u8;

#define FULL_MASK 0xffffffffu
#define NONE_U32 0xffffffffu
#define U64_MAX 0xffffffffffffffffull

__device__ __forceinline__ u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }
__device__ __forceinline__ u64 max_u64(u64 a, u64 b) { return a > b ? a : b; }

// Rust's u64::div_ceil (no overflow for any a).
__device__ __forceinline__ u64 div_ceil_u64(u64 a, u64 b) { return a / b + (a % b != 0 ? 1ull : 0ull); }

// Rust's u64::saturating_mul(2).
__device__ __forceinline__ u64 saturating_double(u64 a) { return a > (U64_MAX >> 1) ? U64_MAX : a * 2ull; }

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v = max_u64(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ u32 warp_sum_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Warp-wide min / max of a u32, every lane gets it: one redux instruction on sm_80 and newer, a
// shuffle tree before.
__device__ __forceinline__ u32 warp_min_u32(u32 v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    return __reduce_min_sync(FULL_MASK, v);
#else
    for (int o = 16; o > 0; o >>= 1) {
        const u32 w = __shfl_xor_sync(FULL_MASK, v, o);
        v = w < v ? w : v;
    }
    return v;
#endif
}

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    return __reduce_max_sync(FULL_MASK, v);
#else
    for (int o = 16; o > 0; o >>= 1) {
        const u32 w = __shfl_xor_sync(FULL_MASK, v, o);
        v = w > v ? w : v;
    }
    return v;
#endif
}

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31u; }
__device__ __forceinline__ u32 warp_id() { return threadIdx.x >> 5; }

// Lanes below this one, for ranking within a warp.
__device__ __forceinline__ u32 lanemask_lt() { return (1u << lane_id()) - 1u; }

// Block-wide reductions over one value per thread. `scratch` holds one u64 per warp; every
// thread of the block must call them (they contain __syncthreads) and gets the result.
__device__ u64 block_sum_u64(u64 v, u64* scratch) {
    v = warp_sum_u64(v);
    if (lane_id() == 0) scratch[warp_id()] = v;
    __syncthreads();
    u32 warps = (blockDim.x + 31u) >> 5;
    u64 total = 0;
    for (u32 w = 0; w < warps; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

__device__ u64 block_max_u64(u64 v, u64* scratch) {
    v = warp_max_u64(v);
    if (lane_id() == 0) scratch[warp_id()] = v;
    __syncthreads();
    u32 warps = (blockDim.x + 31u) >> 5;
    u64 best = 0;
    for (u32 w = 0; w < warps; ++w) best = max_u64(best, scratch[w]);
    __syncthreads();
    return best;
}

// The replica-distribution task stream: built by plan_tiles (tile_plan.cu) or uploaded by the
// host (rackfill_kernels::cuda::tiles), consumed by tile_stream (replicate.cu).
struct TileTask {
    u64 src_offset;   // byte offset of this tile in the source buffer
    u64 tile_offset;  // byte offset of this tile inside its chunk (added to every destination)
    u32 src_rank;
    u32 src_kind;     // 0: the rank's home weights, 1: the rank's slot buffer (a relay)
    u32 len;          // bytes, <= tile_bytes
    u32 dst_begin;    // first TileDst of the task's group
    u32 n_dst;
    i32 wait_flag;    // ready counter on src_rank to wait for, -1: none
    u32 wait_target;  // tiles of the chunk: the counter's value once the chunk has landed
    u32 reserved;
};

struct TileDst {
    u64 offset;       // byte offset of the chunk in the destination rank's slot buffer
    u32 rank;
    i32 ready_flag;   // ready counter on `rank` to bump after the store, -1: none
};

// bf16 as raw bits (no CUDA header needed): the whole-model kernels keep weights, KV cache and
// GEMM inputs in bf16 and compute in f32.
typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even, NaN stays NaN: what torch's float -> bfloat16 conversion does.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_sum_f32(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max_f32(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide f32 maximum; `scratch` as for block_sum_f32.
__device__ float block_max_f32(float v, float* scratch) {
    v = warp_max_f32(v);
    if (lane_id() == 0) scratch[warp_id()] = v;
    __syncthreads();
    u32 warps = (blockDim.x + 31u) >> 5;
    float best = scratch[0];
    for (u32 w = 1; w < warps; ++w) best = fmaxf(best, scratch[w]);
    __syncthreads();
    return best;
}

// Block-wide f32 sum; `scratch` holds one float per warp; every thread must call it and gets
// the result. Warps are summed in a fixed order, so the result is the same on every launch.
__device__ float block_sum_f32(float v, float* scratch) {
    v = warp_sum_f32(v);
    if (lane_id() == 0) scratch[warp_id()] = v;
    __syncthreads();
    u32 warps = (blockDim.x + 31u) >> 5;
    float total = 0.0f;
    for (u32 w = 0; w < warps; ++w) total += scratch[w];
    __syncthreads();
    return total;
}
