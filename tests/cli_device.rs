//! `rackfill serve --device`: the whole-model GPU path behind the real HTTP server, run on the
//! host emulator (`--device emulator`, the same CUDA kernels on the CPU), answers like the CPU
//! path: every prompt token's logprob (echo) within 0.05 of `--device cpu`'s, at EP 1 and EP 2
//! (the MoE layers on the device's data plane), and a decode after the prompt; with the defaults
//! it runs one data plane and uploads each expert once. Needs a C++ compiler for the emulator;
//! without one it says so and passes.

mod common;

use common::{rackfill, Server};
use serde_json::Value;

/// bf16 weights, activations and KV cache against the CPU's f32, on the built-in model (a bf16
/// checkpoint: its logits differ by under 1% relative L2, see models/tests/gpu_forward.rs).
const LOGPROB_TOLERANCE: f64 = 0.05;

fn has_cxx() -> bool {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let found = std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok();
    if !found {
        eprintln!("skipped: no C++ compiler ({cxx}) for the host emulator");
    }
    found
}

/// Each prompt token's logprob (the first is null) and the completion's text.
fn echo(server: &Server, max_tokens: u32) -> (Vec<Option<f64>>, String) {
    let body = format!(
        r#"{{"prompt": "Balancing experts across a rack keeps every GPU busy", "max_tokens": {max_tokens}, "echo": true, "logprobs": 1, "temperature": 0}}"#
    );
    let (status, text) = server.request("POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let choice = &v["choices"][0];
    let logprobs = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(Value::as_f64)
        .collect();
    (logprobs, choice["text"].as_str().unwrap().to_string())
}

#[test]
fn the_gpu_path_serves_like_the_cpu_at_ep_1_and_2() {
    if !has_cxx() {
        return;
    }
    for ep in ["1", "2"] {
        let cpu = Server::start(&["--ep-size", ep, "--device", "cpu"]);
        let gpu = Server::start(&["--ep-size", ep, "--device", "emulator"]);
        let (want, _) = echo(&cpu, 1);
        let (got, text) = echo(&gpu, 3);
        assert!(
            !text.is_empty(),
            "EP {ep}: the emulated GPU path decoded nothing"
        );
        // Prompt tokens plus the generated ones: compare the prompt's.
        assert!(got.len() >= want.len() - 1, "EP {ep}: {got:?} vs {want:?}");
        let mut worst = 0f64;
        for (i, (g, w)) in got.iter().zip(&want).enumerate().take(want.len() - 1) {
            match (g, w) {
                (None, None) => assert_eq!(i, 0),
                (Some(g), Some(w)) => {
                    worst = worst.max((g - w).abs());
                    assert!(
                        (g - w).abs() <= LOGPROB_TOLERANCE,
                        "EP {ep}, token {i}: logprob {g} on the GPU path, {w} on the CPU"
                    );
                }
                _ => panic!("EP {ep}, token {i}: {g:?} vs {w:?}"),
            }
        }
        eprintln!("EP {ep}: prompt logprobs within {worst:.4} of the CPU path's");
    }
}

#[test]
fn a_bad_device_gets_one_line() {
    for bad in ["gpu", "cuda:x", "tpu"] {
        let out = rackfill(&["serve", "--port", "0", "--device", bad]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{bad}: {stderr}");
        assert!(stderr.contains("--device"), "{bad}: {stderr}");
    }
}

/// `rackfill serve --device emulator` with every other default (EP 8 in one process, quota, the
/// `ultraep` schedule) runs one MoE data plane, on the device, and uploads each of the built-in
/// model's experts once: the home experts on the device are the 4 MoE layers x 32 experts x
/// (3 x 128 x 64 bf16 values), and everything written from the host while loading fits in the
/// checkpoint's own bytes (a bf16 checkpoint: nothing is uploaded twice).
#[test]
fn the_defaults_on_the_emulator_run_one_plane_and_upload_each_expert_once() {
    if !has_cxx() {
        return;
    }
    let server = Server::start(&["--device", "emulator"]);
    server.complete("Once upon a time");
    let path = server.metric_when("rackfill:moe_data_path{path=\"device\"}", |v| v == 1.0);
    assert_eq!(path, 1.0);
    let experts = server.metric_when("rackfill:device_weight_bytes{part=\"home_experts\"}", |v| {
        v > 0.0
    });
    assert_eq!(experts, (4 * 32 * 3 * 128 * 64 * 2) as f64);
    let uploaded = server.metric_when("rackfill:device_weight_bytes{part=\"uploaded\"}", |v| {
        v > 0.0
    });
    let checkpoint = std::fs::metadata(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/builtin/model.safetensors"
    ))
    .unwrap()
    .len() as f64;
    assert!(
        uploaded >= experts && uploaded <= checkpoint,
        "{uploaded} bytes uploaded for a {checkpoint}-byte checkpoint holding {experts} bytes of experts"
    );
    let (_, text) = server.request("GET", "/metrics", "");
    assert!(
        !text.contains("rackfill:moe_data_path{path=\"cpu\"}"),
        "one data plane only:\n{text}"
    );
}
