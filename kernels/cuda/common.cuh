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

// Tensor-core building blocks (sm_80 and newer), one warp at a time; fragment layouts are the
// PTX ISA's ("Matrix Fragments for mma.m16n8k16", "ldmatrix"). The host emulator (emu.h) runs
// its own warp-level versions of the same five operations.
//
// - mma_bf16_16816: D (16x8 f32) += A (16x16 bf16, row-major) . B (16x8 bf16, column-major).
//   Lane l (group g = l / 4, t = l % 4) holds A's rows g and g + 8, columns 2t, 2t + 1 and
//   2t + 8, 2t + 9 (a[0]: row g, a[1]: row g + 8, a[2], a[3]: the same rows 8 columns on);
//   B's rows 2t, 2t + 1 (b[0]) and 2t + 8, 2t + 9 (b[1]) of column g; D's rows g (d[0], d[1])
//   and g + 8 (d[2], d[3]) at columns 2t, 2t + 1.
// - ldmatrix_x4: four 8x8 bf16 matrices from shared memory, lanes 8i .. 8i + 7 giving the
//   addresses of matrix i's rows (16 bytes each, 16-byte aligned); r[i] holds row l / 4,
//   columns 2(l % 4), 2(l % 4) + 1 of matrix i: an A or B fragment. ldmatrix_x4_trans gives
//   the transposed matrices (rows 2(l % 4), 2(l % 4) + 1 of column l / 4).
// - cp_async_16: 16 bytes global -> shared without passing through registers, zeros when
//   `full` is false; visible only after cp_async_wait<N> (all but the N newest groups landed).
#ifndef RACKFILL_HOST_EMULATOR
__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(full ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// Memory ordering across devices and processes (peer memory, relay flags): an acquire load and
// a release store at system scope, and the global timer that bounds every wait on them.
#ifndef RACKFILL_HOST_EMULATOR
__device__ __forceinline__ u32 ld_acquire_sys_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys_u32(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Nanoseconds of the GPU's global timer.
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#else
// The host emulator (kernels/emulator/emu.h): C++ atomics (also across processes sharing the
// mapping); the host's clock.
inline u32 ld_acquire_sys_u32(const u32* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st_release_sys_u32(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline u64 global_ns() { return host_ns(); }
#endif

// Two floats as the packed bf16 pair of an A fragment register (low half: `lo`).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}
