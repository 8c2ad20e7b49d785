//! The side channel of vLLM's NixlConnector (0.33): a ZMQ ROUTER socket on which a decode
//! instance asks for this engine's NIXL metadata before it READs a request's KV blocks.
//!
//! Request: one frame, msgpack `(b"get_meta_msg", pp_rank, tp_rank)` (a later vLLM adds a
//! `pcp_rank` before `tp_rank`). Reply: two frames after the envelope, the msgpack
//! `NixlHandshakePayload` map and a msgpack float (the sender's monotonic clock, seconds).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::error::KvExportError;
use super::layout::KvDtype;

/// The vLLM release whose NixlConnector this side channel speaks.
pub const VLLM_VERSION: &str = "0.33.0";

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
) -> Result<Vec<u8>, KvExportError> {
    let encode = |e: rmp_serde::encode::Error| {
        KvExportError::SideChannel(format!("cannot encode the metadata: {e}"))
    };
    let payload = HandshakePayload {
        compatibility_hash: compatibility_hash.into(),
        agent_metadata_bytes: rmp_serde::to_vec_named(metadata).map_err(encode)?,
    };
    rmp_serde::to_vec_named(&payload).map_err(encode)
}

/// The inputs of vLLM's NIXL compatibility hash that depend on the model and the decode's
/// configuration (the rest are constants of vLLM 0.33).
pub struct CompatFactors<'a> {
    /// The model name the decode instance serves.
    pub model: &'a str,
    pub dtype: KvDtype,
    /// Every KV head of the model (not one rank's).
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub num_hidden_layers: usize,
    pub attn_backend_name: &'a str,
}

/// vLLM 0.33's `compute_nixl_compatibility_hash`: the SHA-256 of the factors as Python's
/// `json.dumps(factors, sort_keys=True)` writes them. A decode instance that enforces the check
/// refuses the handshake unless its own factors give the same hash.
pub fn compatibility_hash(f: &CompatFactors<'_>) -> String {
    let json = format!(
        "{{\"attn_backend_name\": {}, \"cache_dtype\": \"auto\", \"dtype\": \"{}\", \
         \"head_size\": {}, \"is_hma_enabled\": true, \"model\": {}, \
         \"nixl_connector_version\": {CONNECTOR_VERSION}, \"num_hidden_layers\": {}, \
         \"num_kv_heads\": {}, \"speculative_config\": null, \"transfer_mode\": \"pull\", \
         \"vllm_version\": \"{VLLM_VERSION}\"}}",
        python_json_string(f.attn_backend_name),
        f.dtype.torch_name(),
        f.head_size,
        python_json_string(f.model),
        f.num_hidden_layers,
        f.num_kv_heads,
    );
    Sha256::digest(json.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A string as Python's `json.dumps` writes it (`ensure_ascii`: every non-ASCII character as
/// `\uXXXX`, astral ones as a surrogate pair).
fn python_json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl AgentMetadata {
    /// The metadata of an agent whose KV is host memory: one region per layer at
    /// `region_addresses`, each `num_blocks` blocks of `block_bytes`, layout `LBHNC`.
    pub fn for_host_regions(
        engine_id: &str,
        agent_metadata: Vec<u8>,
        region_addresses: Vec<u64>,
        num_blocks: usize,
        block_bytes: usize,
        block_size: usize,
        attn_backend_name: &str,
    ) -> Self {
        let regions = region_addresses.len();
        Self {
            engine_id: engine_id.into(),
            agent_metadata,
            kv_caches_base_addr: region_addresses,
            device_id: 0,
            num_blocks: num_blocks as u64,
            block_lens: vec![block_bytes as u64; regions],
            block_strides: vec![block_bytes as u64; regions],
            kv_cache_layout: "LBHNC".into(),
            block_size: block_size as u32,
            ssm_sizes: (0, 0),
            attn_backend_name: attn_backend_name.into(),
            physical_blocks_per_logical_kv_block: 1,
            region_num_blocks: None,
            region_group_ids: None,
            region_names: None,
            region_mem_types: Some(vec!["DRAM".into(); regions]),
            dcp_size: 1,
            pcp_size: 1,
            ple_block_len: None,
            region_members: Vec::new(),
            packed_member_layouts: HashMap::new(),
        }
    }
}

/// The side channel's thread.
pub struct SideChannel;

impl SideChannel {
    /// Binds `tcp://host:port` for `metadata` under `compatibility_hash` on a thread of its
    /// own, which then answers metadata requests and calls `every_tick` every `tick` for as
    /// long as the process runs. Returns once the socket is bound: a port in use fails here, at
    /// start. A request for a rank this engine does not have gets no answer (the decode side
    /// times out and says so), as vLLM's own prefill side does; a malformed one is logged and
    /// dropped.
    pub fn spawn(
        host: &str,
        port: u16,
        metadata: &AgentMetadata,
        compatibility_hash: &str,
        tick: Duration,
        every_tick: impl FnMut() + Send + 'static,
    ) -> Result<(), KvExportError> {
        let payload = encode_payload(metadata, compatibility_hash)?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let endpoint = format!("tcp://{host}:{port}");
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("rackfill-kv-export".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = bound_tx.send(Err(format!("cannot start its runtime: {e}")));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let mut socket = zeromq::RouterSocket::new();
                    if let Err(e) = socket.bind(&endpoint).await {
                        let _ = bound_tx.send(Err(format!("cannot bind {endpoint}: {e}")));
                        return;
                    }
                    let _ = bound_tx.send(Ok(()));
                    tokio::join!(answer(socket, payload), ticks(tick, every_tick));
                });
            })
            .map_err(|e| KvExportError::SideChannel(format!("cannot start its thread: {e}")))?;
        bound_rx
            .recv()
            .map_err(|_| KvExportError::SideChannel("its thread ended at start".into()))?
            .map_err(KvExportError::SideChannel)
    }
}

/// Answers every metadata request on `socket` with `payload`.
async fn answer(mut socket: zeromq::RouterSocket, payload: Vec<u8>) {
    let started = Instant::now();
    loop {
        let message = match socket.recv().await {
            Ok(message) => message,
            Err(err) => {
                tracing::warn!(%err, "KV export side channel: a bad message");
                continue;
            }
        };
        let frames: Vec<_> = message.into_vec();
        // ROUTER: [identity, empty delimiter (from REQ), request].
        let (Some(identity), Some(request)) = (frames.first(), frames.last()) else {
            continue;
        };
        match parse_request(request) {
            Some((0, 0)) => {
                let clock = rmp_serde::to_vec(&started.elapsed().as_secs_f64()).unwrap_or_default();
                let mut reply = ZmqMessage::from(identity.clone());
                reply.push_back(Vec::<u8>::new().into());
                reply.push_back(payload.clone().into());
                reply.push_back(clock.into());
                if let Err(err) = socket.send(reply).await {
                    tracing::warn!(%err, "KV export side channel: cannot answer");
                }
            }
            other => tracing::warn!(
                request = ?other,
                "KV export side channel: not a metadata request for pp 0, tp 0 (this engine has \
                 no other ranks to offer); no answer"
            ),
        }
    }
}

/// Calls `every_tick` every `tick`, forever.
async fn ticks(tick: Duration, mut every_tick: impl FnMut()) {
    loop {
        every_tick();
        tokio::time::sleep(tick).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compatibility_hash_is_vllms_for_the_same_factors() {
        // vLLM 0.33.0's hash for Qwen/Qwen3-0.6B in bf16 on FLASH_ATTN (from its own
        // `compute_nixl_compatibility_hash`, notes of this issue).
        let hash = compatibility_hash(&CompatFactors {
            model: "Qwen/Qwen3-0.6B",
            dtype: KvDtype::Bf16,
            num_kv_heads: 8,
            head_size: 128,
            num_hidden_layers: 28,
            attn_backend_name: "FLASH_ATTN",
        });
        assert!(
            hash.starts_with("cde24c48") && hash.ends_with("e549"),
            "{hash}"
        );
    }

    #[test]
    fn strings_are_escaped_as_pythons_json_dumps_does() {
        assert_eq!(python_json_string("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(python_json_string("é😀"), r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn metadata_requests_of_three_and_four_fields_parse_and_others_do_not() {
        let three = rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META), 0u32, 0u32)).unwrap();
        assert_eq!(parse_request(&three), Some((0, 0)));
        let four =
            rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META), 1u32, 0u32, 2u32)).unwrap();
        assert_eq!(parse_request(&four), Some((1, 2)));
        assert_eq!(parse_request(b"\x93garbage"), None);
        let other = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"nope"), 0u32, 0u32)).unwrap();
        assert_eq!(parse_request(&other), None);
    }
}
