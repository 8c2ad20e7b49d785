//! Disaggregated prefill for real: `rackfill serve --kv-export` answers `do_remote_decode`
//! requests with vLLM's `kv_transfer_params`, and a vLLM-0.33-protocol decode side written on the
//! official `nixl` package (`scripts/nixl_decode_standin.py`: side-channel handshake,
//! `add_remote_agent`, READ of the named blocks, notification) pulls the prompt's KV, which must
//! equal transformers' `past_key_values` for the same prompt (MLA: the compressed latent) within
//! [`KV_TOLERANCE`], for every model family, in one process and under `mpirun -np 3`.
//!
//! The decode side needs a Python with `nixl` (the `nixl-cu12` wheel), `msgspec`, `pyzmq`,
//! `numpy` and `safetensors`: `$RACKFILL_NIXL_PYTHON`, else `python3` (`.ci/run` installs them).
//! Where it is missing those tests skip, saying so; the refusals without NIXL always run.

mod mpi_common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use mpi_common::{tokenizer_fixture, Served};
use safetensors::SafeTensors;
use serde_json::{json, Value};

/// Pulled KV against transformers' f32 KV: 2e-3, plus the rounding of the exported dtype (the
/// checkpoint's: bf16 keeps 8 bits of mantissa, f16 11), relative to the value.
const KV_TOLERANCE: f32 = 2e-3;

/// Tokens per block, on both sides: small, so the reference prompts (5, 11 and 16 tokens) span
/// several blocks and end inside one.
const BLOCK: &str = "4";

/// The model families, by conformance fixture.
const FAMILIES: [&str; 4] = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"];

/// The Python that runs the decode side, if it has what the decode side imports.
fn decode_python() -> Option<String> {
    let python = std::env::var("RACKFILL_NIXL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args([
            "-c",
            "import nixl._api, msgspec, zmq, numpy, safetensors.numpy",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "skipped: {python} lacks nixl/msgspec/pyzmq/numpy/safetensors for the decode side \
             (pip install nixl-cu12 msgspec pyzmq numpy safetensors; or set RACKFILL_NIXL_PYTHON)"
        );
    }
    ok.then_some(python)
}

/// A free TCP port for a side channel (rank r of a group takes `port + r`: `span` in a row).
fn free_ports(span: u16) -> u16 {
    loop {
        let base = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let all_free = (0..span).all(|r| {
            base.checked_add(r)
                .is_some_and(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if all_free {
            return base;
        }
    }
}

/// One reference prompt: its ids and, per layer, transformers' `[heads, T, row]` rows as the
/// exported blocks hold them (keys then values per head, or MLA's latent as one head).
struct Reference {
    ids: Vec<u32>,
    layers: Vec<(Vec<usize>, Vec<f32>)>,
}

fn f32s(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// `[heads, T, a]` and `[heads, T, b]` side by side: `[heads, T, a + b]`.
fn concat_rows(shape: &[usize], k: &[f32], v: &[f32]) -> (Vec<usize>, Vec<f32>) {
    let (heads, tokens, dim) = (shape[0], shape[1], shape[2]);
    let mut out = Vec::with_capacity(k.len() * 2);
    for row in 0..heads * tokens {
        out.extend_from_slice(&k[row * dim..(row + 1) * dim]);
        out.extend_from_slice(&v[row * dim..(row + 1) * dim]);
    }
    (vec![heads, tokens, 2 * dim], out)
}

/// Per layer `(shape, rows)` of `file` for prefix `prefix` (`""` for the decode side's output,
/// `"{i}_"` for reference prompt `i`); `None` when it has no layer 0.
fn layer_rows(file: &SafeTensors<'_>, prefix: &str) -> Option<Vec<(Vec<usize>, Vec<f32>)>> {
    let mut layers = Vec::new();
    for layer in 0.. {
        if let Ok(latent) = file.tensor(&format!("latent_{prefix}{layer}")) {
            let shape = latent.shape();
            layers.push((vec![1, shape[0], shape[1]], f32s(&latent)));
            continue;
        }
        let (Ok(k), Ok(v)) = (
            file.tensor(&format!("k_{prefix}{layer}")),
            file.tensor(&format!("v_{prefix}{layer}")),
        ) else {
            break;
        };
        layers.push(concat_rows(k.shape(), &f32s(&k), &f32s(&v)));
    }
    (!layers.is_empty()).then_some(layers)
}

fn references(family: &str) -> Vec<Reference> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/tests/fixtures")
        .join(family)
        .join("kv_reference.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = SafeTensors::deserialize(&bytes).expect("kv reference");
    (0..)
        .map_while(|i| {
            let ids = file.tensor(&format!("input_ids_{i}")).ok()?;
            let ids = ids
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect();
            let layers = layer_rows(&file, &format!("{i}_")).expect("reference layers");
            Some(Reference { ids, layers })
        })
        .collect()
}

/// The relative rounding of the checkpoint's dtype (what the export is in).
fn dtype_rounding(model: &Path) -> f32 {
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    match config["dtype"].as_str().or(config["torch_dtype"].as_str()) {
        Some("bfloat16") => 2f32.powi(-8),
        Some("float16") => 2f32.powi(-11),
        _ => 0.0,
    }
}

/// The decode side, run to its end.
struct Decode {
    python: String,
    model: PathBuf,
    model_name: String,
    dir: PathBuf,
}

impl Decode {
    fn new(python: &str, model: &Path, model_name: &str, tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("rackfill-kv-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            python: python.into(),
            model: model.into(),
            model_name: model_name.into(),
            dir,
        }
    }

    /// Runs the decode side on `params` with `extra` flags; `out` names its output file.
    fn run(&self, params: &Value, out: &str, extra: &[&str]) -> (Output, PathBuf) {
        let params_file = self.dir.join(format!("{out}.json"));
        std::fs::write(&params_file, params.to_string()).unwrap();
        let out = self.dir.join(format!("{out}.safetensors"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/nixl_decode_standin.py");
        let output = Command::new(&self.python)
            .arg(script)
            .arg("--params")
            .arg(&params_file)
            .arg("--model-dir")
            .arg(&self.model)
            .args(["--model-name", &self.model_name, "--block-size", BLOCK])
            .arg("--out")
            .arg(&out)
            .args(extra)
            .output()
            .expect("the decode side runs");
        (output, out)
    }

    /// Pulls `params` the vLLM way, which must succeed; the pulled layers.
    fn pull(&self, params: &Value, out: &str) -> Vec<(Vec<usize>, Vec<f32>)> {
        let (output, file) = self.run(params, out, &[]);
        assert!(
            output.status.success(),
            "decode side failed ({:?}): {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout)
        );
        let bytes = std::fs::read(file).expect("pulled KV");
        layer_rows(&SafeTensors::deserialize(&bytes).unwrap(), "").expect("pulled layers")
    }
}

impl Drop for Decode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `pulled` equals `want` within [`KV_TOLERANCE`] plus the export dtype's rounding.
fn assert_kv_equal(what: &str, pulled: &[(Vec<usize>, Vec<f32>)], want: &Reference, rounding: f32) {
    assert_eq!(pulled.len(), want.layers.len(), "{what}: layers");
    for (layer, ((got_shape, got), (want_shape, want))) in
        pulled.iter().zip(&want.layers).enumerate()
    {
        assert_eq!(got_shape, want_shape, "{what}: layer {layer} shape");
        let worst = got
            .iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs() - rounding * w.abs())
            .fold(f32::MIN, f32::max);
        assert!(
            worst <= KV_TOLERANCE,
            "{what}: layer {layer} differs from transformers by {worst} beyond the rounding"
        );
    }
}

/// A completion asking for the prompt's KV to be exported (what vLLM's proxy sends a prefill
/// instance).
fn export_request(ids: &[u32]) -> Value {
    json!({
        "prompt": ids, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {
            "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null
        }
    })
}

fn export(served: &Served, ids: &[u32]) -> Value {
    let (status, body) = served
        .try_complete(&export_request(ids))
        .expect("the server answers");
    assert_eq!(status, 200, "{body}");
    let response: Value = serde_json::from_str(&body).unwrap();
    let params = response["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{response}");
    assert_eq!(params["remote_num_tokens"], ids.len(), "{response}");
    response
}

/// `rackfill:kv_export_requests_total{rank="R",event="EVENT"}`, summed over ranks.
fn export_events(text: &str, event: &str) -> f64 {
    let tail = format!(",event=\"{event}\"}} ");
    text.lines()
        .filter(|l| l.starts_with("rackfill:kv_export_requests_total{"))
        .filter_map(|l| {
            l.split_once(&tail)
                .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        })
        .sum()
}

/// Every rank's `rackfill:kv_export_held_blocks`, summed.
fn held_blocks(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("rackfill:kv_export_held_blocks{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `/metrics` until `ready` holds (20 s at most); the last text.
fn metrics_when(served: &Served, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let started = Instant::now();
    loop {
        let text = served.metrics();
        if ready(&text) {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{what} never held:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn serve_flags<'a>(model: &'a str, port: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut flags = vec![
        "--model",
        model,
        "--kv-export",
        "--kv-export-port",
        port,
        "--kv-block-tokens",
        BLOCK,
    ];
    flags.extend_from_slice(extra);
    flags
}

/// `rackfill serve --kv-export` as one process on `family`'s fixture with `extra` flags, and a
/// decode side for that model (`tag` names its scratch directory).
fn exporting_server(python: &str, family: &str, extra: &[&str], tag: &str) -> (Served, Decode) {
    let (model, _) = tokenizer_fixture(family);
    let model_str = model.to_str().unwrap().to_owned();
    let port = free_ports(1).to_string();
    let served = Served::single(&serve_flags(&model_str, &port, extra));
    let decode = Decode::new(python, &model, &model_str, tag);
    (served, decode)
}

#[test]
fn every_family_exports_kv_that_a_vllm_decode_pulls_equal_to_transformers() {
    let Some(python) = decode_python() else {
        return;
    };
    for family in FAMILIES {
        let (served, decode) = exporting_server(&python, family, &["--ep-size", "2"], family);
        let rounding = dtype_rounding(&decode.model);
        let refs = references(family);
        for (i, reference) in refs.iter().enumerate() {
            let response = export(&served, &reference.ids);
            let pulled = decode.pull(&response["kv_transfer_params"], &format!("p{i}"));
            assert_kv_equal(
                &format!("{family} prompt {i}"),
                &pulled,
                reference,
                rounding,
            );
        }
        // The same prompt again: its KV comes from the prefix cache, and exports the same.
        let last = refs.last().unwrap();
        let again = export(&served, &last.ids);
        assert!(
            again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
            "{family}: the repeated prompt hit no prefix cache: {again}"
        );
        let pulled = decode.pull(&again["kv_transfer_params"], "again");
        assert_kv_equal(
            &format!("{family} from the prefix cache"),
            &pulled,
            last,
            rounding,
        );
        // Every notification freed its blocks.
        let n = refs.len() as f64 + 1.0;
        metrics_when(&served, "every export released", |t| {
            export_events(t, "released") == n && held_blocks(t) == 0.0
        });
        served.stop_with_sigterm();
    }
}

/// How far transformers in bf16 is from its f32 KV, per layer, on the qwen3_moe fixture's
/// reference prompts (max abs over K and V; `scripts/kv_bf16_error.py qwen3_moe`, transformers
/// 5.23.0, torch 2.15.0): the bound for a bf16 path.
const TRANSFORMERS_BF16_KV_ERROR: [f32; 3] = [0.0235, 0.0938, 0.2714];

#[test]
fn the_device_path_exports_kv_no_further_from_f32_than_transformers_bf16() {
    let Some(python) = decode_python() else {
        return;
    };
    let emulator = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .arg("--version")
        .output()
        .is_ok();
    if !emulator {
        eprintln!("skipped: no C++ compiler for the GPU path's host emulator");
        return;
    }
    let flags = ["--device", "emulator", "--ep-size", "2"];
    let (served, decode) = exporting_server(&python, "qwen3_moe", &flags, "device");
    for (i, reference) in references("qwen3_moe").iter().enumerate() {
        let response = export(&served, &reference.ids);
        let pulled = decode.pull(&response["kv_transfer_params"], &format!("d{i}"));
        for (layer, ((_, got), (_, want))) in pulled.iter().zip(&reference.layers).enumerate() {
            let worst = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0, f32::max);
            assert!(
                worst <= TRANSFORMERS_BF16_KV_ERROR[layer],
                "prompt {i} layer {layer}: the device's KV is {worst} from f32, transformers \
                 in bf16 {}",
                TRANSFORMERS_BF16_KV_ERROR[layer]
            );
        }
    }
    metrics_when(&served, "every device export released", |t| {
        export_events(t, "released") == 3.0 && held_blocks(t) == 0.0
    });
    served.stop_with_sigterm();
}

#[test]
fn a_stream_carries_kv_transfer_params_on_its_finishing_chunk() {
    let Some(python) = decode_python() else {
        return;
    };
    let (served, decode) = exporting_server(&python, "qwen3_moe", &[], "stream");
    let reference = &references("qwen3_moe")[1];
    let mut request = export_request(&reference.ids);
    request["stream"] = json!(true);
    let (status, body) = served.try_complete(&request).expect("answers");
    assert_eq!(status, 200, "{body}");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let carrying: Vec<&Value> = chunks
        .iter()
        .filter(|c| c.get("kv_transfer_params").is_some())
        .collect();
    assert_eq!(carrying.len(), 1, "{body}");
    assert!(
        carrying[0]["choices"][0]["finish_reason"].is_string(),
        "{body}"
    );
    let pulled = decode.pull(&carrying[0]["kv_transfer_params"], "stream");
    assert_kv_equal(
        "streamed",
        &pulled,
        reference,
        dtype_rounding(&decode.model),
    );
    served.stop_with_sigterm();
}

#[test]
fn leases_free_unread_blocks_and_a_killed_decode_side_loses_nothing() {
    let Some(python) = decode_python() else {
        return;
    };
    let (served, decode) =
        exporting_server(&python, "qwen3_moe", &["--kv-export-timeout", "2"], "lease");
    let refs = references("qwen3_moe");
    // A decode side killed after the handshake, and one that reads but never notifies.
    let killed = export(&served, &refs[0].ids);
    let (out, _) = decode.run(
        &killed["kv_transfer_params"],
        "killed",
        &["--die-after", "handshake"],
    );
    assert!(
        !out.status.success(),
        "the killed decode side exited {:?}",
        out.status
    );
    let silent = export(&served, &refs[1].ids);
    let (out, _) = decode.run(
        &silent["kv_transfer_params"],
        "silent",
        &["--notify", "none"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Meanwhile the server serves, and a well-behaved decode side pulls correct KV.
    let pulled = decode.pull(&export(&served, &refs[2].ids)["kv_transfer_params"], "good");
    assert_kv_equal(
        "beside a killed decode",
        &pulled,
        &refs[2],
        dtype_rounding(&decode.model),
    );
    let plain = served
        .try_complete(&json!({"prompt": refs[0].ids, "max_tokens": 2}))
        .expect("answers");
    assert_eq!(plain.0, 200, "{}", plain.1);
    assert_eq!(served.health(), Some(200));
    // The lease frees the two unread requests' blocks; nothing else is lost.
    let text = metrics_when(&served, "the leases expired", |t| {
        export_events(t, "expired") == 2.0 && held_blocks(t) == 0.0
    });
    assert_eq!(export_events(&text, "released"), 1.0, "{text}");
    assert_eq!(export_events(&text, "exported"), 3.0, "{text}");
    // A notification for an expired request is counted, not obeyed.
    let (out, _) = decode.run(
        &silent["kv_transfer_params"],
        "late",
        &["--notify", "standalone"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    metrics_when(&served, "the late notification counted", |t| {
        export_events(t, "unknown_notification") == 1.0
    });
    assert!(served.log().contains("lease ran out"), "{}", served.log());
    served.stop_with_sigterm();
}

#[test]
fn a_decode_side_that_disagrees_gets_a_handshake_error_never_wrong_kv() {
    let Some(python) = decode_python() else {
        return;
    };
    let (served, decode) = exporting_server(&python, "mixtral", &[], "disagree");
    let ids = &references("mixtral")[2].ids;
    let params = export(&served, ids)["kv_transfer_params"].clone();
    let cases: [(&str, &[&str]); 3] = [
        ("another dtype", &["--dtype", "bfloat16"]),
        ("another block size", &["--block-size", "8"]),
        ("another model", &["--model-name", "org/other-model"]),
    ];
    for (what, flags) in cases {
        let (out, file) = decode.run(&params, what, flags);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{what}: {stderr}");
        assert!(stderr.starts_with("handshake error: "), "{what}: {stderr}");
        assert!(
            !file.exists(),
            "{what}: KV was written despite the mismatch"
        );
    }
    // The blocks still wait for a decode side that agrees.
    decode.pull(&params, "agreeing");
    served.stop_with_sigterm();
}

#[test]
fn without_nixl_or_export_a_do_remote_decode_request_gets_400_naming_why() {
    let ids: Vec<u32> = (1..9).collect();
    let refused = |served: &Served, body: &Value, needle: &str| {
        let (status, text) = served.try_complete(body).expect("answers");
        assert_eq!(status, 400, "{text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        let message = error["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(message.contains(needle), "{needle:?} not in {text}");
        assert_eq!(error["error"]["param"], "kv_transfer_params", "{text}");
    };
    let plain = Served::single(&[]);
    refused(&plain, &export_request(&ids), "--kv-export");
    let mut not_object = export_request(&ids);
    not_object["kv_transfer_params"] = json!("yes");
    refused(&plain, &not_object, "must be an object");
    let mut pull = export_request(&ids);
    pull["kv_transfer_params"] = json!({"do_remote_prefill": true});
    refused(&plain, &pull, "does not pull KV");
    let mut null_params = json!({"prompt": ids, "max_tokens": 1});
    null_params["kv_transfer_params"] = Value::Null;
    assert_eq!(plain.try_complete(&null_params).map(|r| r.0), Some(200));
    plain.stop_with_sigterm();

    // Export asked for, on a host without NIXL: the server serves, and names what is missing.
    let port = free_ports(1).to_string();
    let without = Served::single_with_env(
        &["--kv-export", "--kv-export-port", &port],
        &[("RACKFILL_NIXL_LIB", "/nonexistent/libnixl_capi.so")],
    );
    refused(&without, &export_request(&ids), "libnixl_capi.so");
    let mut two = export_request(&ids);
    two["n"] = json!(2);
    refused(&without, &two, "exactly one sequence");
    assert_eq!(
        without
            .try_complete(&json!({"prompt": ids, "max_tokens": 2}))
            .map(|r| r.0),
        Some(200)
    );
    without.stop_with_sigterm();
}

#[cfg(feature = "mpi")]
#[test]
fn under_mpirun_each_rank_exports_the_kv_of_its_own_sequences() {
    let Some(python) = decode_python() else {
        return;
    };
    if !mpi_common::mpirun_available() {
        return;
    }
    for family in FAMILIES {
        let (model, _) = tokenizer_fixture(family);
        let model_str = model.to_str().unwrap().to_owned();
        let port = free_ports(3);
        let port_str = port.to_string();
        let group = Served::start(3, &serve_flags(&model_str, &port_str, &[]), &[]);
        let decode = Decode::new(&python, &model, &model_str, &format!("mpi-{family}"));
        let rounding = dtype_rounding(&model);
        let refs = references(family);
        // Sent at once, twice over, so the leader hands them to different ranks.
        let requests: Vec<Value> = refs
            .iter()
            .chain(&refs)
            .map(|r| export_request(&r.ids))
            .collect();
        let responses = group.complete_all(&requests);
        let mut ports = BTreeSet::new();
        let mut engines: HashMap<u64, String> = HashMap::new();
        for (i, response) in responses.iter().enumerate() {
            let params = &response["kv_transfer_params"];
            let rank_port = params["remote_port"].as_u64().expect("remote_port");
            assert!(
                (port as u64..port as u64 + 3).contains(&rank_port),
                "{params}"
            );
            let engine = params["remote_engine_id"].as_str().unwrap().to_owned();
            assert_eq!(
                engines.entry(rank_port).or_insert_with(|| engine.clone()),
                &engine,
                "one engine id per rank"
            );
            ports.insert(rank_port);
            let pulled = decode.pull(params, &format!("m{i}"));
            let reference = &refs[i % refs.len()];
            assert_kv_equal(
                &format!("{family} request {i} (port {rank_port})"),
                &pulled,
                reference,
                rounding,
            );
        }
        assert!(
            ports.len() > 1,
            "{family}: every sequence ran on one rank: {ports:?}"
        );
        let n = requests.len() as f64;
        metrics_when(&group, "every rank released its exports", |t| {
            export_events(t, "released") == n && held_blocks(t) == 0.0
        });
        group.stop_with_sigterm();
    }
}

#[test]
fn bench_serve_remote_decode_pulls_every_response_and_reports_the_peak_held() {
    if decode_python().is_none() {
        return;
    }
    let port = free_ports(1).to_string();
    let served = Served::single(&["--kv-export", "--kv-export-port", &port]);
    let base = served.url("");
    let out = Command::new(env!("CARGO_BIN_EXE_rackfill"))
        .args(["bench", "serve", "--base-url", &base, "--num-prompts", "6"])
        .args([
            "--random-input-len",
            "96",
            "--random-output-len",
            "1",
            "--request-rate",
            "inf",
        ])
        .args([
            "--remote-decode",
            "--remote-decode-delay",
            "0.3",
            "--no-progress",
        ])
        .output()
        .expect("bench serve runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Six requests and the warm-up, each pulled; the server held some KV meanwhile.
    assert!(
        stdout.contains("Remote decode: 7 pulled, 0 failed"),
        "{stdout}"
    );
    let peak = stdout
        .split("peak KV held for pickup: ")
        .nth(1)
        .and_then(|rest| rest.split(" MB").next()?.parse::<f64>().ok())
        .expect("a peak in MB");
    assert!(peak > 0.0, "{stdout}");
    metrics_when(&served, "every pull released", |t| {
        export_events(t, "released") == 7.0 && held_blocks(t) == 0.0
    });
    served.stop_with_sigterm();
}
