// The dense parts of a decoder layer on the GPU (whole-model path): embedding gather, RMSNorm,
// rotary embeddings, residual and bias adds, bf16 conversions, row gathers, the gated activation
// on bf16 and the routers. Weights are bf16, arithmetic f32.
