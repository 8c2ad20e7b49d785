"""Two processes: 'prefill' (plays the Rust engine: nixl agent + ZMQ ROUTER side channel,
vLLM 0.33.0 wire format) and 'decode' (stand-in for vLLM's NixlPullConnectorWorker)."""
import sys, time, msgspec, zmq, numpy as np
sys.path.insert(0, "/tmp/nixl-research"); from msgspec_check import NixlAgentMetadata, NixlHandshakePayload
from nixl._api import nixl_agent, nixl_agent_config
PORT, L, NB, BLEN = 5601, 2, 8, 4096          # 2 layers, 8 blocks, 4 KiB per block
GET_META_MSG = b"get_meta_msg"

def prefill():
    ag = nixl_agent("prefill-agent", nixl_agent_config(backends=["UCX"]))
    kv = np.zeros((L, NB, BLEN), dtype=np.uint8)                 # one region per layer
    for l in range(L):
        for b in range(NB): kv[l, b, :] = (l * 16 + b) & 0xFF
    ag.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
    md = NixlAgentMetadata(engine_id="engine-P", agent_metadata=ag.get_agent_metadata(),
        kv_caches_base_addr=[kv[l].ctypes.data for l in range(L)], device_id=0, num_blocks=NB,
        block_lens=[BLEN] * L, block_strides=[BLEN] * L, kv_cache_layout="LBHNC", block_size=16,
        ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1,
        region_mem_types=["DRAM"] * L)
    payload = msgspec.msgpack.encode(NixlHandshakePayload("nohash", msgspec.msgpack.encode(md)))
    sock = zmq.Context().socket(zmq.ROUTER); sock.bind(f"tcp://127.0.0.1:{PORT}")
    ident, empty, msg = sock.recv_multipart()
    tag, pp, tp = msgspec.msgpack.decode(msg); assert tag == GET_META_MSG and (pp, tp) == (0, 0)
    sock.send_multipart([ident, b"", payload, msgspec.msgpack.encode(time.perf_counter())])
    t0 = time.time()
    while time.time() - t0 < 20:
        for agent, msgs in ag.get_new_notifs().items():
            for m in msgs:
                req, n = m.decode().rsplit(":", 1); print("PREFILL: notif from", agent, "->", req, n, "=> free blocks"); return
        time.sleep(0.01)
    print("PREFILL: timeout (would free blocks after lease)")

def decode():
    ag = nixl_agent("decode-agent", nixl_agent_config(backends=["UCX"]))
    kv = np.zeros((L, NB, BLEN), dtype=np.uint8)
    ag.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
    s = zmq.Context().socket(zmq.REQ); s.setsockopt(zmq.RCVTIMEO, 5000); s.connect(f"tcp://127.0.0.1:{PORT}")
    s.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0))); parts = s.recv_multipart(); assert len(parts) == 2
    hp = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    md = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(hp.agent_metadata_bytes)
    remote = ag.add_remote_agent(md.agent_metadata)
    # Nx5 strided descs (addr, len, dev, stride, count) exactly like _build_fa_remote/_build_fa_local
    rdesc = np.array([[a, md.block_lens[i], md.device_id, md.block_strides[i], NB] for i, a in enumerate(md.kv_caches_base_addr)], dtype=np.uint64)
    ldesc = np.array([[kv[l].ctypes.data, BLEN, 0, BLEN, NB] for l in range(L)], dtype=np.uint64)
    rh = ag.prep_xfer_dlist(remote, rdesc, mem_type=md.region_mem_types[0])
    lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", ldesc, mem_type="DRAM")
    remote_blocks, local_blocks = [3, 5], [0, 1]            # remote_block_ids=[[3,5]]
    ids = lambda blocks: (np.arange(L)[:, None] * NB + np.array(blocks)[None, :]).ravel()  # _compute_desc_ids
    h = ag.make_prepped_xfer("READ", lh, ids(local_blocks), rh, ids(remote_blocks), notif_msg=b"req-42:1")
    st = ag.transfer(h)
    while st == "PROC": st = ag.check_xfer_state(h)
    ok = all((kv[l, lb] == (l * 16 + rb)).all() for l in range(L) for lb, rb in zip(local_blocks, remote_blocks))
    print("DECODE: xfer", st, "data ok:", ok); time.sleep(1)

if __name__ == "__main__":
    prefill() if sys.argv[1] == "p" else decode()
