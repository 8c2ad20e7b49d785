# Re-declares vLLM 0.33.0 nixl/metadata.py structs (lines 58-100) to check wire format.
from dataclasses import dataclass, field
import msgspec
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
md = NixlAgentMetadata("eng-p", b"\x01\x02", [0x7f0000000000], 0, 100, [4096], [4096], "LBHNC", 16, (0, 0), "FLASH_ATTN", 1)
enc = msgspec.msgpack.encode(md)
print("metadata msgpack:", enc.hex())
print("decoded generic:", msgspec.msgpack.decode(enc))
p = msgspec.msgpack.encode(NixlHandshakePayload("abc", enc))
print("payload generic:", msgspec.msgpack.decode(p).keys())
print("request msg:", msgspec.msgpack.encode((b"get_meta_msg", 0, 0)).hex(), msgspec.msgpack.decode(msgspec.msgpack.encode((b"get_meta_msg", 0, 0))))
print("ts:", msgspec.msgpack.encode(123.5).hex())
# Minimal map (only required fields, arbitrary order, extra key, str vs bin) — what does the decoder accept?

D = msgspec.msgpack.Decoder(NixlAgentMetadata)
def tryit(name, obj):
    try:
        r = D.decode(msgspec.msgpack.encode(obj)); print(name, "OK", r.region_num_blocks, r.ssm_sizes)
    except Exception as e:
        print(name, "FAIL", type(e).__name__, e)
base = dict(engine_id="e", agent_metadata=b"x", kv_caches_base_addr=[1], device_id=0, num_blocks=4,
            block_lens=[8], block_strides=[8], kv_cache_layout="LBHNC", block_size=16, ssm_sizes=[0,0],
            attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1)
tryit("minimal-map", base)
tryit("extra-key", {**base, "zzz": 1})
tryit("nil-optionals", {**base, "region_num_blocks": None, "region_mem_types": None})
tryit("agent_metadata-as-str", {**base, "agent_metadata": "x"})
tryit("u64 addr", {**base, "kv_caches_base_addr": [2**63 + 5]})
b2 = dict(base); del b2["block_strides"]; tryit("missing block_strides", b2)
tryit("array-form", list(base.values()))
