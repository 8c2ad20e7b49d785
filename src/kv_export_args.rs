//! `rackfill serve`'s KV export flags: disaggregated prefill, the prompt's KV handed to vLLM
//! decode instances over NIXL (docs/disaggregation.md).

use std::time::Duration;

use anyhow::{bail, Result};
use rackfill_engine::kv_export::{KvDtype, KvExportConfig, DEFAULT_PORT};

/// Flags of `rackfill serve` for KV export.
#[derive(Debug, clap::Args)]
pub struct KvExportArgs {
    /// Export the KV of requests that ask for it (`kv_transfer_params: {"do_remote_decode":
    /// true}`) over NIXL, in the protocol of vLLM 0.33's NixlConnector (kv_role kv_producer).
    /// Needs the `nixl` wheel (libnixl_capi.so: `pip install nixl-cu12`, or RACKFILL_NIXL_LIB);
    /// without it the server still serves, and such requests get 400 naming what is missing.
    #[arg(long)]
    kv_export: bool,
    /// The address decode instances reach this process's side channel at (it is also bound)
    /// [default: $VLLM_NIXL_SIDE_CHANNEL_HOST, else 127.0.0.1].
    #[arg(long, requires = "kv_export")]
    kv_export_host: Option<String>,
    /// The side channel's port; rank r of a group uses port + r
    /// [default: $VLLM_NIXL_SIDE_CHANNEL_PORT, else 5600].
    #[arg(long, requires = "kv_export")]
    kv_export_port: Option<u16>,
    /// Blocks (of --kv-block-tokens tokens, every layer) that exported KV may hold while it
    /// waits for its decode side [default: the rank's KV budget, --kv-tokens-per-rank].
    #[arg(long, requires = "kv_export")]
    kv_export_blocks: Option<usize>,
    /// Seconds exported blocks wait for the decode side's notification before they are freed
    /// (vLLM's kv_lease_duration; its heartbeats extend it), logged and counted in
    /// rackfill:kv_export_requests_total{event="expired"}.
    #[arg(long, default_value_t = 30.0, requires = "kv_export")]
    kv_export_timeout: f64,
    /// The exported KV's dtype, which must be the decode's (`auto`: the checkpoint's dtype).
    #[arg(long, default_value = "auto", requires = "kv_export")]
    kv_export_dtype: String,
    /// The model name the decode instance serves (`vllm serve NAME`), for vLLM's NIXL
    /// compatibility hash [default: --served-model-name, else --model].
    #[arg(long, requires = "kv_export")]
    kv_export_model_name: Option<String>,
    /// The decode instance's attention backend, for the compatibility hash [default:
    /// FLASH_ATTN, FLASHMLA for multi-head latent attention].
    #[arg(long, requires = "kv_export")]
    kv_export_attn_backend: Option<String>,
}

impl KvExportArgs {
    /// The exporter's settings, checked; `None` without --kv-export. `served_name` is the name
    /// clients use.
    pub(crate) fn config(&self, served_name: &str) -> Result<Option<KvExportConfig>> {
        if !self.kv_export {
            return Ok(None);
        }
        if !(self.kv_export_timeout.is_finite() && self.kv_export_timeout > 0.0) {
            bail!("--kv-export-timeout must be a positive number of seconds");
        }
        if self.kv_export_blocks == Some(0) {
            bail!("--kv-export-blocks must be at least 1");
        }
        let dtype = match self.kv_export_dtype.as_str() {
            "auto" => None,
            name => Some(KvDtype::parse(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "--kv-export-dtype {name}: expected auto, float32, bfloat16 or float16"
                )
            })?),
        };
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let port = match (self.kv_export_port, env("VLLM_NIXL_SIDE_CHANNEL_PORT")) {
            (Some(port), _) => port,
            (None, Some(port)) => port.parse().map_err(|_| {
                anyhow::anyhow!("VLLM_NIXL_SIDE_CHANNEL_PORT={port} is not a port number")
            })?,
            (None, None) => DEFAULT_PORT,
        };
        Ok(Some(KvExportConfig {
            host: self
                .kv_export_host
                .clone()
                .or_else(|| env("VLLM_NIXL_SIDE_CHANNEL_HOST"))
                .unwrap_or_else(|| "127.0.0.1".into()),
            port,
            blocks: self.kv_export_blocks,
            lease: Duration::from_secs_f64(self.kv_export_timeout),
            model_name: self
                .kv_export_model_name
                .clone()
                .unwrap_or_else(|| served_name.to_owned()),
            dtype,
            attn_backend: self.kv_export_attn_backend.clone(),
        }))
    }
}
