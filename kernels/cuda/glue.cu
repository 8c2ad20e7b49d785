// Small data movements the whole-model path needs between the layer kernels and the GEMMs:
// strided f32 row copies and gathers, and the sigmoid gate of Qwen2-MoE's shared expert.

// out[r, 0..cols) = x[r, 0..cols) for r < rows, with row strides (elements). Grid: rows blocks.
extern "C" __global__ void copy_rows_f32(const float* __restrict__ x, u32 x_stride, u32 rows, u32 cols,
                                         float* __restrict__ out, u32 out_stride) {
    const u32 r = blockIdx.x;
    if (r >= rows) return;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x)
        out[(u64)r * out_stride + c] = x[(u64)r * x_stride + c];
}

// out[i, :] = x[rows[i], :] for i < n; x is [*, dim] f32. Grid: n blocks.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, u32 dim, const u32* __restrict__ rows,
                                           u32 n, float* __restrict__ out) {
    const u32 i = blockIdx.x;
    if (i >= n) return;
    const float* src = x + (u64)rows[i] * dim;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) out[(u64)i * dim + c] = src[c];
}

// y[r, :] *= sigmoid(gate[r]) for r < rows; y is [rows, cols] f32, gate [rows] f32 logits.
// Grid: rows blocks.
extern "C" __global__ void scale_rows_by_sigmoid(float* __restrict__ y, const float* __restrict__ gate,
                                                 u32 rows, u32 cols) {
    const u32 r = blockIdx.x;
    if (r >= rows) return;
    const float s = 1.0f / (1.0f + expf(-gate[r]));
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) y[(u64)r * cols + c] *= s;
}
