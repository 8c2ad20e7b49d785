// The gated activation's arithmetic, shared by model.cu's silu_mul_to_bf16 and grouped_gemm.cu's
// fused epilogue, so the two round the same f32 gate and up to the same bf16 (nvrtc.rs prepends
// this to both; the guard keeps one copy where the host emulator joins every source).
#ifndef RACKFILL_FASTMATH_CUH
#define RACKFILL_FASTMATH_CUH

// The branch-free e^x of models/src/layers/fastmath.rs (Cephes expf), operation by operation
// with the same f32 constants, so silu matches the CPU's bit for bit.
__device__ __forceinline__ float fastmath_expf(float x) {
    const float round = 12582912.0f;  // 1.5 * 2^23
    x = x < -87.33655f ? -87.33655f : x;
    x = x > 88.72283f ? 88.72283f : x;
    const float n = __fadd_rn(__fadd_rn(__fmul_rn(x, 1.44269504088896340736f), round), -round);
    float r = __fadd_rn(x, -__fmul_rn(n, 0.69314575f));
    r = __fadd_rn(r, -__fmul_rn(n, 1.4286068e-6f));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float er = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    i32 e = (i32)n + 127;
    e = e < 0 ? 0 : e;
    return __fmul_rn(er, __uint_as_float((u32)e << 23));
}

// bf16(silu(g) * u): fastmath.rs silu_mul, g / (1 + e^-g) * u with its e^x, each operation
// rounded in f32, then rounded once to bf16 as the input of the down projection.
__device__ __forceinline__ bf16 silu_mul_to_bf16_value(float g, float u) {
    return f32_to_bf16(__fmul_rn(g / __fadd_rn(1.0f, fastmath_expf(-g)), u));
}

#endif
