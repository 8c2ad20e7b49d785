// Weight conversions at load (whole-model path): a checkpoint's tensors arrive on the device as
// they are stored, byte for byte, and are converted here into the types the model computes with
// (bf16 weights, f32 routers), so the host never holds a converted copy.
//
// Element types (the `src_dtype` / `dst_dtype` codes, `ConvertDtype` in the host code):
//   0: f32, 1: bf16, 2: f16 (sources only), 3: float8_e4m3fn (sources only, with block scales).
// Every conversion is exact up to one rounding to the destination type (round to nearest even),
// so it gives bit for bit what the host's `f32_to_bf16` gives on the same values.
//
// Every kernel walks its elements grid-stride, so any grid and block size is correct.

#define CONVERT_F32 0u
#define CONVERT_BF16 1u
#define CONVERT_F16 2u

// IEEE binary16 bits to f32 (exact): normals, subnormals, infinities and NaNs.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    const u32 sign = ((u32)h & 0x8000u) << 16;
    const u32 e = ((u32)h >> 10) & 31u;
    const u32 m = (u32)h & 1023u;
    if (e == 0u) {
        // m * 2^-24, exact in f32.
        const float mag = __fmul_rn((float)m, __uint_as_float(0x33800000u));
        return __uint_as_float(__float_as_uint(mag) | sign);
    }
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// float8_e4m3fn bits to f32 (exact): bias 7, no infinities, S.1111.111 is NaN.
__device__ __forceinline__ float e4m3_to_f32(u8 v) {
    const u32 sign = ((u32)v & 0x80u) << 24;
    const u32 e = ((u32)v >> 3) & 15u;
    const u32 m = (u32)v & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u);
    if (e == 0u) {
        // m * 2^-9, exact in f32.
        const float mag = __fmul_rn((float)m, __uint_as_float(0x3b000000u));
        return __uint_as_float(__float_as_uint(mag) | sign);
    }
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

__device__ __forceinline__ float load_element(const void* src, u32 dtype, u64 i) {
    switch (dtype) {
        case CONVERT_F32: return ((const float*)src)[i];
        case CONVERT_BF16: return bf16_to_f32(((const bf16*)src)[i]);
        default: return f16_to_f32(((const unsigned short*)src)[i]);
    }
}

__device__ __forceinline__ void store_element(void* dst, u32 dtype, u64 i, float v) {
    if (dtype == CONVERT_F32)
        ((float*)dst)[i] = v;
    else
        ((bf16*)dst)[i] = f32_to_bf16(v);
}

// dst[i] = src[i] for i < n, from `src_dtype` (f32, bf16, f16) to `dst_dtype` (f32, bf16).
extern "C" __global__ void convert_elements(const void* __restrict__ src, u32 src_dtype, u64 n,
                                            void* __restrict__ dst, u32 dst_dtype) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        store_element(dst, dst_dtype, i, load_element(src, src_dtype, i));
}

// A block-quantized FP8 matrix (DeepSeek-V3's and Qwen3's format) dequantized:
// dst[r, c] = e4m3(src[r, c]) * scale_inv[r / block_rows, c / block_cols] for a row-major
// [rows, cols] matrix whose f32 scales are [ceil(rows / block_rows), ceil(cols / block_cols)]
// (the last blocks of each dimension may be partial). The product is one f32 multiplication,
// rounded once more to `dst_dtype` (f32 or bf16).
extern "C" __global__ void dequant_fp8_e4m3(const u8* __restrict__ src, const float* __restrict__ scale_inv,
                                            u32 rows, u32 cols, u32 block_rows, u32 block_cols,
                                            void* __restrict__ dst, u32 dst_dtype) {
    const u64 n = (u64)rows * cols;
    const u32 scale_cols = (cols + block_cols - 1u) / block_cols;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 r = (u32)(i / cols), c = (u32)(i % cols);
        const float scale = scale_inv[(u64)(r / block_rows) * scale_cols + c / block_cols];
        store_element(dst, dst_dtype, i, __fmul_rn(e4m3_to_f32(src[i]), scale));
    }
}

// A synthetic checkpoint's tensor (rackfill_models::Synthetic) generated in place: element i is
// `constant` when `uniform` is 0, else uniform in [-bound, bound) from a splitmix64 hash of
// (seed, first + i), rounded to bf16 (what the host's `Synthetic::value` gives bit for bit),
// stored as `dst_dtype` (f32 or bf16). No bytes cross the bus: a real-size model for benchmarks.
extern "C" __global__ void fill_synthetic(void* __restrict__ dst, u32 dst_dtype, u64 n, u64 seed, u64 first,
                                          float bound, float constant, u32 uniform) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = constant;
        if (uniform != 0u) {
            u64 z = seed + (first + i + 1ull) * 0x9e3779b97f4a7c15ull;
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            z ^= z >> 31;
            const float unit = __fmul_rn((float)(z >> 40), 1.0f / 16777216.0f);
            v = __fmul_rn(__fadd_rn(__fmul_rn(2.0f, unit), -1.0f), bound);
        }
        store_element(dst, dst_dtype, i, bf16_to_f32(f32_to_bf16(v)));
    }
}
