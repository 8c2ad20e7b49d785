// Expert MLP pieces between the two grouped GEMMs (the GEMMs themselves are cuBLAS).
//
// gated_mlp_rows (models/src/layers/mod.rs) computes, per row, gate_up = x · W_gate_up (2I wide:
// the gate in columns 0..I, the up projection in I..2I), then act = silu(gate) * up, then
// act · W_down. `silu_mul` is the middle step for `rows` rows at once.

// act[r * inter + j] = silu(gate_up[r * 2 * inter + j]) * gate_up[r * 2 * inter + inter + j].
extern "C" __global__ void silu_mul(const float* __restrict__ gate_up, u32 rows, u32 inter,
                                    float* __restrict__ act) {
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* gate = gate_up + (u64)r * 2u * inter;
        const float* up = gate + inter;
        float* out = act + (u64)r * inter;
        for (u32 j = threadIdx.x; j < inter; j += blockDim.x) {
            const float g = gate[j];
            out[j] = g / (1.0f + expf(-g)) * up[j];
        }
    }
}
