//! The `kv_transfer_params` of a prefill response, in vLLM 0.33's fields.

use serde::{Deserialize, Serialize};

/// What the prefill side returns so that a vLLM decode instance pulls the KV: the top-level
/// `kv_transfer_params` of the OpenAI response, in vLLM 0.33's fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    pub do_remote_prefill: bool,
    pub do_remote_decode: bool,
    /// One list per KV-cache group (one group here): the block ids holding the prompt.
    pub remote_block_ids: Vec<Vec<u32>>,
    pub remote_engine_id: String,
    /// What the decode side's notification names.
    pub remote_request_id: String,
    pub remote_host: String,
    pub remote_port: u16,
    pub remote_num_tokens: usize,
    pub tp_size: u32,
    pub pp_size: u32,
    pub dcp_size: u32,
    pub remote_blocks_expiry_time: Option<f64>,
    pub remote_registration_generation: u32,
    pub transfer_mode: String,
}
