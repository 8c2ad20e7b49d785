// Attention on the GPU (whole-model path): new keys and values written into a paged KV cache
// (fixed-size blocks, per-sequence block tables), and causal prefill / decode attention over a
// chunk plus the cached context with an online softmax (no materialised score matrix).
