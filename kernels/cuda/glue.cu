// Small data movements the whole-model path needs between the layer kernels and the GEMMs:
// strided f32 row copies and gathers.

// out[r, 0..cols) = x[r, 0..cols) for r < rows, with row strides (elements). Grid: rows blocks.
extern "C" __global__ void copy_rows_f32(const float* __restrict__ x, u32 x_stride, u32 rows, u32 cols,
                                         float* __restrict__ out, u32 out_stride) {
    const u32 r = blockIdx.x;
    if (r >= rows) return;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x)
        out[(u64)r * out_stride + c] = x[(u64)r * x_stride + c];
}

// out[i, :] = x[rows[i], :] for i < n; x is [*, dim] f32. Grid-stride over rows (any grid).
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, u32 dim, const u32* __restrict__ rows,
                                           u32 n, float* __restrict__ out) {
    for (u32 i = blockIdx.x; i < n; i += gridDim.x) {
        const float* src = x + (u64)rows[i] * dim;
        for (u32 c = threadIdx.x; c < dim; c += blockDim.x) out[(u64)i * dim + c] = src[c];
    }
}
