import time, numpy as np
from nixl._api import nixl_agent, nixl_agent_config
cfg = nixl_agent_config(backends=["UCX"])
prefill = nixl_agent("prefill", cfg)          # owns the "KV cache"
decode  = nixl_agent("decode",  nixl_agent_config(backends=["UCX"]))
print("plugins:", prefill.get_plugin_list())
src = np.arange(4*4096, dtype=np.uint8).reshape(4, 4096)  # 4 "blocks" of 4 KiB
dst = np.zeros_like(src)
prefill.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
decode.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
name = decode.add_remote_agent(prefill.get_agent_metadata())   # decode learns prefill
decode_name = None
print("remote agent:", name, decode_name)
blk = 4096
# per-block descriptors, like vLLM's prepped dlists
local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data + i*blk, blk, 0) for i in range(4)], "DRAM")
remote = decode.prep_xfer_dlist(name, [(src.ctypes.data + i*blk, blk, 0) for i in range(4)], "DRAM")
h = decode.make_prepped_xfer("READ", local, [0, 1, 2], remote, [3, 1, 0], notif_msg=b"req-123")
st = decode.transfer(h)
t0 = time.time()
while st == "PROC" and time.time() - t0 < 10:
    st = decode.check_xfer_state(h)
print("xfer state:", st)
assert (dst[0] == src[3]).all() and (dst[1] == src[1]).all() and (dst[2] == src[0]).all() and (dst[3] == 0).all()
notifs = {}
t0 = time.time()
while not notifs and time.time() - t0 < 10:
    notifs = prefill.get_new_notifs()
print("prefill got notifs:", notifs)
decode.send_notif(name, b"standalone-notif")
n2 = {}
t0 = time.time()
while not n2 and time.time() - t0 < 10:
    n2 = prefill.get_new_notifs()
print("standalone notif:", n2)
decode.release_xfer_handle(h); decode.release_dlist_handle(local); decode.release_dlist_handle(remote)
decode.remove_remote_agent(name)
print("OK, metadata bytes:", len(prefill.get_agent_metadata()))
