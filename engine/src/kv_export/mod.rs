//! Disaggregated prefill (work in progress, issue 36): handing a prompt's KV cache to a decode
//! engine over NIXL, in the protocol of vLLM's NixlConnector.

pub mod nixl;
pub mod side_channel;
