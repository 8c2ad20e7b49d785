//! The NixlConnector side channel against a decode side written like vLLM 0.33's: a ZMQ REQ
//! socket asks for `(b"get_meta_msg", 0, 0)` and decodes the reply with msgspec's strict typed
//! decoders of vLLM's own `NixlHandshakePayload` and `NixlAgentMetadata` definitions. Skipped
//! where Python lacks pyzmq or msgspec.

use std::collections::HashMap;
use std::process::Command;

use rackfill_engine::kv_export::side_channel::{
    encode_payload, parse_request, serve, AgentMetadata,
};

const DECODE: &str = r#"
import sys, zmq, msgspec
from dataclasses import dataclass, field
@dataclass
class NixlAgentMetadata:
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)
@dataclass
class NixlHandshakePayload:
    compatibility_hash: str
    agent_metadata_bytes: bytes
sock = zmq.Context().socket(zmq.REQ)
sock.setsockopt(zmq.RCVTIMEO, 5000)
sock.connect(sys.argv[1])
sock.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
parts = sock.recv_multipart()
assert len(parts) == 2, len(parts)
payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
clock = msgspec.msgpack.decode(parts[1])
assert isinstance(clock, float)
print(payload.compatibility_hash, meta.engine_id, meta.agent_metadata.hex(), meta.kv_caches_base_addr,
      meta.block_lens, meta.block_strides, meta.kv_cache_layout, meta.block_size, meta.ssm_sizes,
      meta.region_mem_types, meta.packed_member_layouts)
"#;

fn python_with_zmq() -> Option<String> {
    let python = std::env::var("RACKFILL_NIXL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import zmq, msgspec"])
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(python)
}

#[test]
fn a_vllm_style_decode_side_decodes_the_handshake() {
    let Some(python) = python_with_zmq() else {
        eprintln!("skipped: python3 lacks pyzmq or msgspec");
        return;
    };
    let metadata = AgentMetadata {
        engine_id: "rackfill-prefill-0".into(),
        agent_metadata: vec![0xde, 0xad, 0xbe, 0xef],
        kv_caches_base_addr: vec![0x7f00_0000_0000, u64::MAX - 7],
        device_id: 0,
        num_blocks: 64,
        block_lens: vec![4096, 4096],
        block_strides: vec![4096, 8192],
        kv_cache_layout: "LBHNC".into(),
        block_size: 16,
        ssm_sizes: (0, 0),
        attn_backend_name: "FLASH_ATTN".into(),
        physical_blocks_per_logical_kv_block: 1,
        region_num_blocks: None,
        region_group_ids: None,
        region_names: None,
        region_mem_types: Some(vec!["DRAM".into(), "DRAM".into()]),
        dcp_size: 1,
        pcp_size: 1,
        ple_block_len: None,
        region_members: Vec::new(),
        packed_member_layouts: HashMap::new(),
    };
    let payload = encode_payload(&metadata, "f00d").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.spawn({
        let endpoint = endpoint.clone();
        async move { serve(&endpoint, payload).await }
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let out = Command::new(&python)
        .args(["-c", DECODE, &endpoint])
        .output()
        .unwrap();
    server.abort();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        line.trim(),
        format!(
            "f00d rackfill-prefill-0 deadbeef [{}, {}] [4096, 4096] [4096, 8192] LBHNC 16 (0, 0) \
             ['DRAM', 'DRAM'] {{}}",
            0x7f00_0000_0000u64,
            u64::MAX - 7
        )
    );
}

#[test]
fn metadata_requests_of_both_vllm_shapes_are_recognised() {
    let three = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"get_meta_msg"), 0, 1)).unwrap();
    let four = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"get_meta_msg"), 0, 0, 2)).unwrap();
    let other = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"hello"), 0, 0)).unwrap();
    assert_eq!(parse_request(&three), Some((0, 1)));
    assert_eq!(parse_request(&four), Some((0, 2)));
    assert_eq!(parse_request(&other), None);
    assert_eq!(parse_request(b"\xff garbage"), None);
}
