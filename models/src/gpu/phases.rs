//! The phases `rackfill bench forward` splits a device forward into, from the name of each
//! operation the model queues (a kernel's entry point, or the executor's GEMM and copy): the
//! classifier a [`rackfill_kernels::cuda::exec::Profiled`] executor files device time with.

use rackfill_kernels::cuda::exec::GEMM;

/// Flash attention and the KV cache writes.
pub const ATTENTION: &str = "attention";
/// The routed experts' gate-up, activation and down projections.
pub const EXPERT_GEMMS: &str = "expert GEMMs";
/// Every cuBLAS GEMM: attention projections, dense and shared-expert MLPs, routers, LM head.
pub const DENSE_GEMMS: &str = "dense GEMMs";
/// Top-k routing, grouping rows by expert and the weighted combine.
pub const ROUTING: &str = "routing and balancing";
/// Norms, rotary embeddings, residual adds, conversions and copies.
pub const ELEMENTWISE: &str = "norms and elementwise";

/// The phase of operation `op`.
pub fn forward_phase(op: &str) -> &'static str {
    if op == GEMM {
        DENSE_GEMMS
    } else if op.starts_with("flash_attention") || op == "kv_write" {
        ATTENTION
    } else if op.starts_with("grouped_") || op == "silu_mul_to_bf16" {
        EXPERT_GEMMS
    } else if op.starts_with("router_")
        || op.starts_with("combine_")
        || op.starts_with("gather_rows")
        || op.starts_with("scatter_rows")
        || op.contains("rank_by_key")
        || op == "lookup_instance"
        || op == "instance_keys"
        || op == "sigmoid_scale_rows"
    {
        ROUTING
    } else {
        ELEMENTWISE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_of_the_forward_has_its_phase() {
        assert_eq!(forward_phase(GEMM), DENSE_GEMMS);
        assert_eq!(forward_phase("flash_attention_k64_v128"), ATTENTION);
        assert_eq!(forward_phase("router_softmax_topk"), ROUTING);
        assert_eq!(forward_phase("combine_topk_rows"), ROUTING);
        assert_eq!(forward_phase("rms_norm_to_bf16"), ELEMENTWISE);
        assert_eq!(forward_phase("copy"), ELEMENTWISE);
    }
}
