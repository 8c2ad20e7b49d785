//! The NIXL binding against the official `nixl` Python package: a decode-side agent READs
//! blocks of host memory this process registered, and notifies it. Skipped (with a line saying
//! so) where the `nixl-cu12`/`nixl-cu13` wheel is not installed.

use std::io::Write;
use std::time::{Duration, Instant};

use rackfill_engine::kv_export::nixl::{find_library, Agent};

const DECODE: &str = r#"
import os, sys, time, numpy as np
from nixl._api import nixl_agent, nixl_agent_config
md = open(sys.argv[1], "rb").read()
base, block, blocks = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
decode = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
dst = np.zeros((2, block), dtype=np.uint8)
decode.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
name = decode.add_remote_agent(md)
local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data + i * block, block, 0) for i in range(2)], "DRAM")
remote = decode.prep_xfer_dlist(name, [(base + i * block, block, 0) for i in range(blocks)], "DRAM")
h = decode.make_prepped_xfer("READ", local, [0, 1], remote, [3, 1], notif_msg=b"req-1:1")
state = decode.transfer(h)
t0 = time.time()
while state == "PROC" and time.time() - t0 < 10:
    state = decode.check_xfer_state(h)
assert state == "DONE", state
for i, b in enumerate([3, 1]):
    want = (np.arange(block, dtype=np.uint32) * 7 + b * 131) % 251
    assert (dst[i] == want.astype(np.uint8)).all(), (i, b)
print("READ OK", flush=True)
decode.release_xfer_handle(h)
decode.release_dlist_handle(local)
decode.release_dlist_handle(remote)
decode.remove_remote_agent(name)
# NIXL 1.5's UCX teardown at interpreter exit crashes (signal 11) once a remote agent was
# loaded; everything above is released, so leave without it.
os._exit(0)
"#;

#[test]
fn a_nixl_decode_agent_reads_registered_blocks_and_notifies() {
    let Ok(lib) = find_library() else {
        eprintln!("skipped: the nixl wheel is not installed (pip install nixl-cu12)");
        return;
    };
    let python = std::env::var("RACKFILL_NIXL_PYTHON").unwrap_or_else(|_| "python3".into());
    let (block, blocks) = (4096usize, 4usize);
    let mut host = vec![0u8; block * blocks];
    for (b, chunk) in host.chunks_mut(block).enumerate() {
        for (i, byte) in chunk.iter_mut().enumerate() {
            *byte = ((i * 7 + b * 131) % 251) as u8;
        }
    }
    let agent = Agent::new(&lib, "prefill").expect("agent");
    // SAFETY: `host` outlives the registration.
    let registered =
        unsafe { agent.register_host(host.as_ptr() as usize, host.len()) }.expect("register");
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("prefill.md");
    std::fs::File::create(&md)
        .unwrap()
        .write_all(&agent.metadata().unwrap())
        .unwrap();
    let script = dir.path().join("decode.py");
    std::fs::write(&script, DECODE).unwrap();
    let decode = std::process::Command::new(&python)
        .arg(&script)
        .arg(&md)
        .arg((host.as_ptr() as usize).to_string())
        .arg(block.to_string())
        .arg(blocks.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python decode side");
    let started = Instant::now();
    let mut seen = Vec::new();
    while seen.is_empty() && started.elapsed() < Duration::from_secs(30) {
        seen = agent.take_notifications().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = decode.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("READ OK"));
    assert_eq!(seen, vec![("decode".to_string(), b"req-1:1".to_vec())]);
    drop(registered);
}
