#!/usr/bin/env python3
"""A vLLM 0.33.0 decode instance (NixlConnector, kv_role kv_consumer), played step by step.

Given the top-level `kv_transfer_params` a prefill server returned, this pulls the prompt's KV
cache over NIXL (the official `nixl` package, UCX backend, host memory) exactly as vLLM's
NixlPullConnectorWorker would, and writes what it pulled as float32. File references are to the
vLLM 0.33.0 wheel, `vllm/distributed/kv_transfer/kv_connector/v1/nixl/` unless said otherwise
(docs/disaggregation.md has the protocol).

 1. Params (`pull_scheduler.py:59-65,135-184`, `metadata.py:320-346`): `do_remote_prefill` plus
    remote_engine_id/request_id/host/port/block_ids are required; `remote_block_ids` holds one
    list per KV-cache group (one group here). D allocates cdiv(T, block_size) blocks and reads the
    tail `remote_block_ids[0][-n:]` (`base_worker.py:_apply_prefix_caching`).
 2. Handshake (`base_worker.py:1145-1235`): ZMQ REQ to tcp://remote_host:remote_port, RCVTIMEO
    5000 ms, one frame msgpack `(b"get_meta_msg", pp_rank=0, tp_rank=0)`; the reply is exactly 2
    frames `[NixlHandshakePayload, msgpack(perf_counter)]`, decoded with msgspec strict decoders
    of vLLM's own dataclasses (`metadata.py:58-100`, copied below).
 3. Compatibility hash (`metadata.py:146-216`, `vllm/config/utils.py:hash_factors`): sha256 of
    `json.dumps(factors, sort_keys=True)`, compared before NixlAgentMetadata is decoded, unless
    `--no-compat-check` (= `enforce_handshake_compat: false`).
 4. Checks (`_validate_remote_parallel_config`, engine id, `add_remote_agent` then
    `_validate_remote_agent_handshake`, `base_worker.py:1042-1061, 2389-2979`,
    `kv_connector/utils.py:block_size_ratio`): block-size ratio, kv_cache_layout (not for MLA),
    one region per layer, per-region block_len, strides, region list lengths, one memory type.
 5. Descriptors (`_build_fa_local`/`_build_fa_remote`/`_pack_strided_descs`, `base_worker.py:
    2123-2248`): one Nx5 uint64 row `(addr, block_len, dev, stride, count)` per region; ids are
    `region_offset[r] + block_id`, region-major (`_compute_desc_ids`, `base_worker.py:140-230`).
 6. READ (`pull_worker.py:401-583`): `make_prepped_xfer("READ", ..., notif_msg=
    f"{remote_request_id}:1")` then poll to DONE. A full prefix hit sends the same message with
    `send_notif` and reads nothing (`--notify standalone`). Heartbeats are `send_notif(b"HB:" +
    ",".join(ids))` (`base_worker.py:3517-3549`).
 7. Cache bytes (`v1/attention/backends/flash_attn.py:1201-1257`, `mla/flashattn_mla.py`): GQA
    layer = [blocks, kv_heads, block_size, 2*head_size] with K then V in the last dim ("LBHNC");
    MLA layer = [blocks, block_size, kv_lora_rank + qk_rope_head_dim].

Usage (venv: nixl nixl-cu12 numpy msgspec pyzmq safetensors):
  nixl_decode_standin.py --params resp.json --model-dir DIR --model-name NAME [--out kv.safetensors]
  Options: --block-size N, --dtype, --attn-backend, --no-compat-check, --num-tokens T,
  --notify read|none|standalone, --heartbeat, --die-after handshake|read, --repeat N, --timeout S,
  --print-hash (print D's hash factors and hash as JSON, then exit 0; needs no params).
Output: one JSON line {"engine_id", "request_id", "blocks", "bytes", "read_seconds" (mean per
READ, after the first when --repeat > 1), "read_gbps" (GB/s = 1e9 bytes/s), "memcpy_gbps" (with --repeat), "notified", ...}.
--out tensors (float32): GQA `k_{l}`/`v_{l}` [kv_heads, T, head_dim]; MLA `latent_{l}` [T, width].
Exit codes: 0 ok; 1 unexpected error; 2 invalid params/usage ("invalid kv_transfer_params: ...");
3 "handshake error: ..."; 4 "transfer error: ..."; 5 "timeout: ..." (overall --timeout).
The process ends with os._exit: the nixl wheel's bundled libnl crashes in its exit handlers.
"""
import argparse, hashlib, json, logging, math, os, signal, sys, time, uuid
from dataclasses import dataclass, field

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # vLLM sets this before importing nixl
import msgspec, numpy as np, zmq

VLLM_VERSION, NIXL_CONNECTOR_VERSION = "0.33.0", 15
GET_META_MSG = b"get_meta_msg"
DTYPES = {"float32": (np.float32, 4), "bfloat16": (np.uint16, 2), "float16": (np.float16, 2)}


@dataclass
class NixlAgentMetadata:  # vLLM 0.33.0 nixl/metadata.py:58-83
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
class NixlHandshakePayload:  # vLLM 0.33.0 nixl/metadata.py:86-100
    compatibility_hash: str
    agent_metadata_bytes: bytes


class Fail(Exception):
    """One line for stderr plus an exit code."""
    def __init__(self, code, line):
        super().__init__(line)
        self.code, self.line = code, line


OUT = sys.stdout  # main() moves fd 1 to stderr: nixl logs INFO lines to stdout; the JSON stays alone


def finish(code, line=None, out=None):
    if out is not None:
        print(json.dumps(out), file=OUT)
    if line:
        print(line, file=sys.stderr)
    sys.stdout.flush(); sys.stderr.flush(); OUT.flush()
    os._exit(code)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, kw in [("--params", dict(help='JSON file with kv_transfer_params ("-" = stdin)')),
                     ("--model-dir", dict(required=True)), ("--model-name", dict(required=True)),
                     ("--block-size", dict(type=int, default=16)), ("--dtype", dict(choices=sorted(DTYPES))),
                     ("--attn-backend", {}), ("--no-compat-check", dict(action="store_true")),
                     ("--num-tokens", dict(type=int)), ("--out", {}),
                     ("--notify", dict(choices=["read", "none", "standalone"], default="read")),
                     ("--heartbeat", dict(action="store_true")), ("--die-after", dict(choices=["handshake", "read"])),
                     ("--repeat", dict(type=int, default=1)), ("--timeout", dict(type=float, default=30.0)),
                     ("--print-hash", dict(action="store_true"))]:
        p.add_argument(flag, **kw)
    a = p.parse_args()
    if not a.print_hash and not a.params:
        p.error("--params is required")
    if a.repeat < 1 or a.block_size < 1:
        p.error("--repeat and --block-size must be >= 1")
    return a


def load_model(a):
    """D's own KV geometry, from config.json the way vLLM's ModelArchConfigConvertor reads it."""
    with open(os.path.join(a.model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    dtype = a.dtype or cfg.get("dtype") or cfg.get("torch_dtype")
    if dtype not in DTYPES:
        raise Fail(2, f"invalid model config: dtype {dtype!r} (use --dtype float32|bfloat16|float16)")
    heads = cfg["num_attention_heads"]
    m = dict(layers=cfg["num_hidden_layers"], dtype=dtype, mla=cfg.get("kv_lora_rank") is not None,
             total_kv_heads=cfg.get("num_key_value_heads") or heads)
    if m["mla"]:  # one latent+rope row per token, no head dim (MLA "becomes MQA")
        m.update(heads=1, width=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], rank=cfg["kv_lora_rank"])
        m["head_size"] = m["width"]  # get_head_size(): kv_lora_rank + qk_rope_head_dim
        m["backend"] = a.attn_backend or "FLASHMLA"
    else:
        m.update(heads=m["total_kv_heads"], head_size=cfg.get("head_dim") or cfg["hidden_size"] // heads)
        m["width"] = 2 * m["head_size"]  # [K | V] in the last dim
        m["backend"] = a.attn_backend or "FLASH_ATTN"
    m["block_len"] = m["heads"] * a.block_size * m["width"] * DTYPES[dtype][1]
    return m


def compat_factors(a, m):
    # num_kv_heads is get_total_num_kv_heads(): config's num_key_value_heads, also for MLA.
    return {"vllm_version": VLLM_VERSION, "nixl_connector_version": NIXL_CONNECTOR_VERSION,
            "model": a.model_name, "dtype": f"torch.{m['dtype']}", "num_kv_heads": m["total_kv_heads"],
            "head_size": m["head_size"], "num_hidden_layers": m["layers"],
            "attn_backend_name": m["backend"], "cache_dtype": "auto", "is_hma_enabled": True,
            "speculative_config": None, "transfer_mode": "pull"}


def compat_hash(factors):
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def load_params(a):
    try:
        text = sys.stdin.read() if a.params == "-" else open(a.params).read()
        kp = json.loads(text)
    except (OSError, ValueError) as e:
        raise Fail(2, f"invalid kv_transfer_params: cannot read {a.params}: {e}")
    if isinstance(kp, dict) and "do_remote_prefill" not in kp and isinstance(kp.get("kv_transfer_params"), dict):
        kp = kp["kv_transfer_params"]  # a whole response was given
    if not isinstance(kp, dict):
        raise Fail(2, "invalid kv_transfer_params: not a JSON object")
    if kp.get("do_remote_prefill") is not True:
        raise Fail(2, f"invalid kv_transfer_params: do_remote_prefill is {kp.get('do_remote_prefill')!r}")
    for k, t in [("remote_engine_id", str), ("remote_request_id", str), ("remote_host", str), ("remote_port", int)]:
        if not isinstance(kp.get(k), t) or isinstance(kp.get(k), bool):
            raise Fail(2, f"invalid kv_transfer_params: {k} is {kp.get(k)!r}, expected {t.__name__}")
    ids = kp.get("remote_block_ids")
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list)
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids[0])):
        raise Fail(2, f"invalid kv_transfer_params: remote_block_ids {ids!r} is not a list of one list of block ids")
    if kp.get("tp_size", 1) != 1:
        raise Fail(2, f"invalid kv_transfer_params: tp_size {kp.get('tp_size')!r} (this stand-in is D TP=1 and reads one P rank)")
    t = a.num_tokens if a.num_tokens is not None else kp.get("remote_num_tokens")
    if not isinstance(t, int) or t < 1:
        raise Fail(2, f"invalid kv_transfer_params: remote_num_tokens {t!r} (or pass --num-tokens)")
    return kp, t


def handshake(kp, a, m):
    """Steps 2-3: the side-channel request, both decoders and the hash check."""
    path = f"tcp://[{kp['remote_host']}]:{kp['remote_port']}" if ":" in kp["remote_host"] \
        else f"tcp://{kp['remote_host']}:{kp['remote_port']}"
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    if ":" in kp["remote_host"]:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(path)
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        parts = sock.recv_multipart()
    except zmq.ZMQError as e:
        raise Fail(3, f"handshake error: no reply from {path}: {e}")
    finally:
        sock.close()
    if len(parts) != 2:
        raise Fail(3, f"handshake error: expected 2 reply frames, got {len(parts)} (assert len(reply_parts) == 2)")
    try:
        msgspec.msgpack.decode(parts[1], type=float)
        hp = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise Fail(3, "handshake error: Failed to decode NixlHandshakePayload. This likely indicates "
                      f"an incompatibility between connector version. Error: {e}")
    local = compat_hash(compat_factors(a, m))
    if not a.no_compat_check and hp.compatibility_hash != local:
        raise Fail(3, f"handshake error: NIXL compatibility hash mismatch. Local: {local}, "
                      f"Remote: {hp.compatibility_hash}. Prefill and decode instances have incompatible "
                      "configurations. This may be due to: different vLLM versions, models, dtypes, KV cache "
                      "layouts, attention backends, etc. Both instances must use identical configurations."
                      "Disable this check using --kv-transfer-config "
                      "'{\"kv_connector_extra_config\": {\"enforce_handshake_compat\": false}}'")
    try:
        md = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(hp.agent_metadata_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise Fail(3, f"handshake error: Failed to decode NixlAgentMetadata. Error: {e}")
    if md.pcp_size > 1 and md.dcp_size not in (1, md.pcp_size):
        raise Fail(3, "handshake error: Remote NixlConnector PCP+DCP does not span the full PCP group. "
                      f"Remote PCP/DCP={md.pcp_size}/{md.dcp_size}.")
    if md.engine_id != kp["remote_engine_id"]:
        raise Fail(3, f"handshake error: Remote NIXL agent engine ID mismatch. "
                      f"Expected {kp['remote_engine_id']},received {md.engine_id}.")
    return md, local


def validate(md, a, m):
    """Step 4: _validate_remote_agent_handshake for D TP = P TP = 1, one KV-cache group."""
    def check(ok, msg):
        if not ok:
            raise Fail(3, "handshake error: " + msg)
    L = m["layers"]
    check(md.block_size > 0 and a.block_size % md.block_size == 0,
          f"Local block size {a.block_size} is not divisible by remote block size {md.block_size} or vice versa.")
    bsr = a.block_size // md.block_size
    check(bsr == 1, f"heterogeneous block sizes (local {a.block_size}, remote {md.block_size}, "
                    f"block_size_ratio {bsr}) are valid in vLLM but not supported by this stand-in")
    check(m["mla"] or md.kv_cache_layout == "LBHNC",
          f"Heterogeneous TP expects same kv_cache_layout (local LBHNC, remote {md.kv_cache_layout}). "
          "Or enable experimental feature to receive LBHNC into a local LBNHC cache by setting "
          "'enable_permute_local_kv'=True in --kv-transfer-config.")
    check(len(md.block_lens) == L, f"Number of KV layers must match between prefill and decode "
                                   f"(local {L}, remote {len(md.block_lens)})")
    for i, remote_len in enumerate(md.block_lens):
        local_len = m["block_len"]
        if m["mla"]:
            check(local_len // bsr == remote_len, "KV cache sizes must match between P and D when "
                  f"replicated (region {i}: local={local_len}, remote={remote_len}, bsr={bsr}).")
        else:
            h = m["heads"]
            check(remote_len == local_len * h // h // bsr, f"SPLIT region {i}: remote P KV block_len {remote_len} "
                  f"must equal local {local_len} * remote_heads {h} // local_heads {h} // block_size_ratio {bsr}.")
    check(len(md.kv_caches_base_addr) == L, f"len(kv_caches_base_addr) {len(md.kv_caches_base_addr)} != {L} regions")
    check(md.region_num_blocks is None or len(md.region_num_blocks) == L,
          f"len(region_num_blocks) {len(md.region_num_blocks or [])} != {L} regions")
    check(len(md.block_strides) == L, f"len(block_strides) {len(md.block_strides)} != {L} regions")
    check(all(s >= b for s, b in zip(md.block_strides, md.block_lens)),
          f"every block stride must be >= its block_len (strides {md.block_strides}, lens {md.block_lens})")
    check(md.region_group_ids is None or len(md.region_group_ids) == L, "len(region_group_ids) != regions")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    check(md.region_names is None or md.region_names == names,
          "NIXL transfer regions must name the same model caches in the same order")
    check(md.region_mem_types is None or len(md.region_mem_types) == L, "len(region_mem_types) != regions")
    mem = set(md.region_mem_types or ["DRAM"])  # None: D assumes its own type (DRAM here)
    check(len(mem) == 1, "NIXL pull does not yet support a mixed-memory producer")
    return mem.pop()


def strided(bases, block_len, dev, strides, counts):
    """_pack_strided_descs: Nx5 uint64 (addr, len, dev_id, stride, count), one row per region."""
    return np.array([(b, block_len, dev, s, c) for b, s, c in zip(bases, strides, counts)], dtype=np.uint64).reshape(-1, 5)


def desc_ids(blocks, region_num_blocks):
    """_compute_desc_ids, all-attention fast path: region-major region_offset[r] + block_id."""
    offsets = np.cumsum([0, *region_num_blocks[:-1]])
    return (offsets[:, None] + np.asarray(blocks, dtype=np.int64)[None, :]).ravel()


def to_f32(raw, dtype):
    if dtype == "bfloat16":  # no ml_dtypes: bf16 is the top half of an f32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def wait_done(ag, h, deadline):
    st = ag.transfer(h)
    while st == "PROC":
        if time.monotonic() > deadline:
            raise Fail(4, "transfer error: READ still in progress at the --timeout deadline")
        st = ag.check_xfer_state(h)
    if st != "DONE":
        raise Fail(4, f"transfer error: READ ended in state {st}")


def main():
    global OUT
    a = parse_args()
    sys.stdout.flush()
    OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    m = load_model(a)
    if a.print_hash:
        f = compat_factors(a, m)
        finish(0, out={"factors": f, "json": json.dumps(f, sort_keys=True), "compatibility_hash": compat_hash(f)})
    signal.signal(signal.SIGALRM, lambda *_: finish(5, f"timeout: overall --timeout {a.timeout}s exceeded"))
    signal.setitimer(signal.ITIMER_REAL, a.timeout)
    deadline = time.monotonic() + a.timeout
    kp, T = load_params(a)
    rid = kp["remote_request_id"]
    md, local_hash = handshake(kp, a, m)

    from nixl._api import nixl_agent, nixl_agent_config
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("nixl")] + ["nixl"]:
        logging.getLogger(name).setLevel(logging.WARNING)  # keep stderr to warnings and our one line
    ag = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
    remote = ag.add_remote_agent(md.agent_metadata)  # NIXL loadRemoteMD; vLLM validates after it
    remote_mem = validate(md, a, m)
    n = math.ceil(T / a.block_size)  # D allocates cdiv(T, block_size) blocks (equal block sizes here)
    if len(kp["remote_block_ids"][0]) < n:
        raise Fail(2, f"invalid kv_transfer_params: remote_block_ids has {len(kp['remote_block_ids'][0])} "
                      f"blocks, {T} tokens need {n} at block size {a.block_size}")
    if a.heartbeat:
        ag.send_notif(remote, b"HB:" + rid.encode())
    if a.die_after == "handshake":
        finish_kill("handshake")
    notif = f"{rid}:1".encode()
    out = {"engine_id": md.engine_id, "request_id": rid, "num_tokens": T, "blocks": 0, "bytes": 0,
           "read_seconds": None, "read_gbps": None, "notified": a.notify != "none", "compat_hash": local_hash}
    if a.notify == "standalone":  # full prefix-cache hit on D: notify, read nothing
        ag.send_notif(remote, notif)
        time.sleep(0.3)
        finish(0, out=out)

    # D's own paged cache in host memory: one region per layer, blocks 0..n-1 used by this request.
    L, bl = m["layers"], m["block_len"]
    kv = np.zeros((L, n, bl), dtype=np.uint8)
    ag.register_memory([(kv[l].ctypes.data, kv[l].nbytes, 0, "") for l in range(L)], "DRAM")
    rnb = md.region_num_blocks or [md.num_blocks] * L
    rdesc = strided(md.kv_caches_base_addr, bl, md.device_id, md.block_strides, rnb)  # _build_fa_remote
    ldesc = strided([kv[l].ctypes.data for l in range(L)], bl, 0, [bl] * L, [n] * L)  # _build_fa_local
    remote_blocks = kp["remote_block_ids"][0][-n:]  # _apply_prefix_caching: the tail
    try:
        rh = ag.prep_xfer_dlist(remote, rdesc, mem_type=remote_mem)
        lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", ldesc, mem_type="DRAM")
        lids, rids = desc_ids(range(n), [n] * L), desc_ids(remote_blocks, rnb)
        times = []
        for i in range(a.repeat):
            last = i == a.repeat - 1
            h = ag.make_prepped_xfer("READ", lh, lids, rh, rids,
                                     notif_msg=notif if (last and a.notify == "read") else b"")
            t0 = time.perf_counter()
            wait_done(ag, h, deadline)
            times.append(time.perf_counter() - t0)
            ag.release_xfer_handle(h)
    except Exception as e:  # nixl raises its own exception types (e.g. bad descriptor index)
        raise e if isinstance(e, Fail) else Fail(4, f"transfer error: {type(e).__name__}: {e}")
    if a.notify == "read":
        time.sleep(0.3)  # let UCX flush the notification before this process may vanish
    if a.die_after == "read":
        finish_kill("read")

    nbytes = kv.nbytes
    warm = times[1:] or times  # the first READ also sets up the UCX endpoint
    mean = sum(warm) / len(warm)
    out.update(blocks=n, bytes=nbytes, read_seconds=mean, read_gbps=nbytes / mean / 1e9, repeat=a.repeat,
               first_read_seconds=times[0])
    if a.repeat > 1:
        dst = np.empty_like(kv)
        t0 = time.perf_counter()
        for _ in range(a.repeat):
            np.copyto(dst, kv)
        out["memcpy_gbps"] = nbytes * a.repeat / (time.perf_counter() - t0) / 1e9
    if a.out:
        write_out(a.out, kv, T, m, md, rid)
    finish(0, out=out)


def write_out(path, kv, T, m, md, rid):
    """Step 7: unpack D's cache bytes into per-layer float32 tensors."""
    from safetensors.numpy import save_file
    np_dt, L, n = DTYPES[m["dtype"]][0], m["layers"], kv.shape[1]
    tensors = {}
    for l in range(L):
        vals = to_f32(kv[l].view(np_dt), m["dtype"])
        if m["mla"]:  # [blocks, block_size, width] -> [T, width]
            tensors[f"latent_{l}"] = np.ascontiguousarray(vals.reshape(-1, m["width"])[:T])
        else:  # [blocks, H, block_size, 2*hs] -> [H, T, 2*hs]
            hs, H = m["head_size"], m["heads"]
            x = vals.reshape(n, H, -1, 2 * hs).transpose(1, 0, 2, 3).reshape(H, -1, 2 * hs)[:, :T]
            tensors[f"k_{l}"] = np.ascontiguousarray(x[..., :hs])
            tensors[f"v_{l}"] = np.ascontiguousarray(x[..., hs:])
    save_file(tensors, path, metadata={"generator": "scripts/nixl_decode_standin.py", "engine_id": md.engine_id,
                                       "request_id": rid, "dtype": m["dtype"], "num_tokens": str(T)})


def finish_kill(step):
    time.sleep(0.3)  # let UCX deliver what was already sent (heartbeat, READ notification)
    print(f"nixl_decode_standin: SIGKILL after {step}", file=sys.stderr)
    sys.stdout.flush(); sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    try:
        main()
    except Fail as e:
        finish(e.code, e.line)
    except Exception as e:
        finish(1, f"error: {type(e).__name__}: {e}")
