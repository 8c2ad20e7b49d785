//! The side channel of vLLM's NixlConnector (0.33): a ZMQ ROUTER socket on which a decode
//! instance asks for this engine's NIXL metadata before it READs a request's KV blocks.
//!
//! Request: one frame, msgpack `(b"get_meta_msg", pp_rank, tp_rank)` (a later vLLM adds a
//! `pcp_rank` before `tp_rank`). Reply: two frames after the envelope, the msgpack
//! `NixlHandshakePayload` map and a msgpack float (the sender's monotonic clock, seconds).

use std::collections::HashMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// `NIXL_CONNECTOR_VERSION` of vLLM 0.33.
pub const CONNECTOR_VERSION: u32 = 15;

/// The request tag of a metadata request.
const GET_META: &[u8] = b"get_meta_msg";

/// vLLM's `NixlAgentMetadata`, encoded as a map keyed by field name as msgspec does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentMetadata {
    pub engine_id: String,
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// One base address per region (a layer's KV).
    pub kv_caches_base_addr: Vec<u64>,
    pub device_id: u32,
    pub num_blocks: u64,
    /// Bytes of one block, per region.
    pub block_lens: Vec<u64>,
    /// Bytes between consecutive blocks, per region.
    pub block_strides: Vec<u64>,
    pub kv_cache_layout: String,
    pub block_size: u32,
    pub ssm_sizes: (u64, u64),
    pub attn_backend_name: String,
    pub physical_blocks_per_logical_kv_block: u32,
    pub region_num_blocks: Option<Vec<u64>>,
    pub region_group_ids: Option<Vec<u32>>,
    pub region_names: Option<Vec<String>>,
    pub region_mem_types: Option<Vec<String>>,
    pub dcp_size: u32,
    pub pcp_size: u32,
    pub ple_block_len: Option<u64>,
    pub region_members: Vec<Vec<String>>,
    pub packed_member_layouts: HashMap<String, (u64, u64)>,
}

/// vLLM's `NixlHandshakePayload`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandshakePayload {
    pub compatibility_hash: String,
    #[serde(with = "serde_bytes")]
    pub agent_metadata_bytes: Vec<u8>,
}

/// Why a side-channel message was refused or could not be served.
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    #[error("side channel: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("side channel: cannot encode the metadata: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
}

/// The ranks' `(pp_rank, tp_rank)` a request asks for, if it is a metadata request.
pub fn parse_request(frame: &[u8]) -> Option<(u32, u32)> {
    let value: rmpv::Value = rmpv::decode::read_value(&mut &frame[..]).ok()?;
    let items = value.as_array()?;
    let tag = items.first()?;
    let tag = tag.as_slice().or_else(|| tag.as_str().map(str::as_bytes))?;
    if tag != GET_META {
        return None;
    }
    let int = |i: usize| items.get(i)?.as_u64().map(|v| v as u32);
    match items.len() {
        3 => Some((int(1)?, int(2)?)),
        4 => Some((int(1)?, int(3)?)),
        _ => None,
    }
}

/// The handshake payload for `metadata` under `compatibility_hash`.
pub fn encode_payload(
    metadata: &AgentMetadata,
    compatibility_hash: &str,
) -> Result<Vec<u8>, SideChannelError> {
    let payload = HandshakePayload {
        compatibility_hash: compatibility_hash.into(),
        agent_metadata_bytes: rmp_serde::to_vec_named(metadata)?,
    };
    Ok(rmp_serde::to_vec_named(&payload)?)
}

/// Serves metadata requests on `endpoint` (`tcp://host:port`) until the task is dropped:
/// `payload` answers `(pp 0, tp 0)`; a request for a rank this engine does not have gets no
/// answer (the decode side times out and says so), as vLLM's own prefill side does.
pub async fn serve(endpoint: &str, payload: Vec<u8>) -> Result<(), SideChannelError> {
    let mut socket = zeromq::RouterSocket::new();
    socket.bind(endpoint).await?;
    let started = Instant::now();
    loop {
        let message = socket.recv().await?;
        let frames: Vec<_> = message.into_vec();
        // ROUTER: [identity, empty delimiter (from REQ), request].
        let (Some(identity), Some(request)) = (frames.first(), frames.last()) else {
            continue;
        };
        match parse_request(request) {
            Some((0, 0)) => {
                let clock = rmp_serde::to_vec(&started.elapsed().as_secs_f64())?;
                let mut reply = ZmqMessage::from(identity.clone());
                reply.push_back(Vec::<u8>::new().into());
                reply.push_back(payload.clone().into());
                reply.push_back(clock.into());
                socket.send(reply).await?;
            }
            other => tracing::warn!(?other, "side channel: a request this engine cannot serve"),
        }
    }
}
