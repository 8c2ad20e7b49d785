//! Disaggregated prefill: a finished prompt's KV cache handed to a decode engine over NIXL, in
//! the protocol of vLLM 0.33's `NixlConnector` (pull mode).
//!
//! A request asking for it (`kv_transfer_params.do_remote_decode`) is prefilled as usual; when
//! its sequence finishes, [`KvExport::export`] copies its prompt's KV into blocks of an arena
//! registered with this process's NIXL agent ([`pool`], in the layout a vLLM decode of the same
//! model keeps, [`layout`]) and the response carries [`KvTransferParams`] naming them. The decode
//! side asks this process's side channel for the agent's metadata ([`side_channel`]), READs the
//! blocks, and notifies; the blocks are freed then, or when their lease runs out.
//!
//! Every process of a group runs its own agent and side channel for the sequences it owns (on
//! port `--kv-export-port + rank`); the leader's response names the owner's.

mod error;
pub mod layout;
pub mod nixl;
pub mod pool;
pub mod puller;
pub mod side_channel;
mod transfer_params;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rackfill_models::{KvCache, ModelConfig};

pub use error::KvExportError;
pub use layout::{BlockLayout, KvDtype};
pub use pool::ExportStats;
pub use transfer_params::KvTransferParams;

use nixl::Agent;
use pool::ExportPool;
use side_channel::{AgentMetadata, SideChannel};

/// vLLM's default side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`).
pub const DEFAULT_PORT: u16 = 5600;

/// How often the notification thread polls NIXL and expires leases.
const POLL: Duration = Duration::from_millis(2);

/// How KV export is set up (`rackfill serve --kv-export ...`).
#[derive(Debug, Clone)]
pub struct KvExportConfig {
    /// The address decode instances reach this process's side channel at (also bound).
    pub host: String,
    /// Rank `r` of a group serves its side channel on `port + r`.
    pub port: u16,
    /// Blocks of the export arena (per layer); `None`: as many as the rank's KV budget.
    pub blocks: Option<usize>,
    /// How long blocks wait for the decode side's notification before they are freed.
    pub lease: Duration,
    /// The model name a decode instance serves (`vllm serve NAME`): part of vLLM's
    /// compatibility hash.
    pub model_name: String,
    /// The exported dtype; `None`: the checkpoint's.
    pub dtype: Option<KvDtype>,
    /// The decode's attention backend, for the compatibility hash; `None`: `FLASH_ATTN`, or
    /// `FLASHMLA` for multi-head latent attention.
    pub attn_backend: Option<String>,
}

/// Whether this engine can serve `do_remote_decode` (what request validation checks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KvExportSupport {
    /// Not configured (`--kv-export` not given).
    #[default]
    Off,
    Ready,
    /// Configured, but it could not start: the reason names what is missing.
    Unavailable(String),
}

/// This process's exporter: its NIXL agent, the registered arena, and the side channel.
pub struct KvExport {
    agent: Agent,
    pool: Mutex<ExportPool>,
    layout: BlockLayout,
    engine_id: String,
    host: String,
    port: u16,
    rank: usize,
}

impl std::fmt::Debug for KvExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvExport")
            .field("engine_id", &self.engine_id)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl KvExport {
    /// Loads NIXL, registers an arena for `model`'s KV in `block_tokens`-token blocks, binds
    /// the side channel of `rank` and starts the thread that serves it and applies the decode
    /// sides' notifications. `default_blocks`: the arena's size unless configured.
    pub fn start(
        config: &KvExportConfig,
        model: &ModelConfig,
        block_tokens: usize,
        default_blocks: usize,
        rank: usize,
    ) -> Result<Arc<Self>, KvExportError> {
        let layout = block_layout(config, model, block_tokens)?;
        let default_backend = if layout.mla { "FLASHMLA" } else { "FLASH_ATTN" };
        let attn_backend = config.attn_backend.as_deref().unwrap_or(default_backend);
        let port = u16::try_from(usize::from(config.port) + rank).map_err(|_| {
            KvExportError::Config(format!("side-channel port {} + rank {rank}", config.port))
        })?;
        let library = nixl::find_library()?;
        let engine_id = format!("rackfill-{:016x}-rank{rank}", rand::random::<u64>());
        let agent = Agent::new(&library, &engine_id)?;
        let blocks = config.blocks.unwrap_or(default_blocks).max(1);
        let pool = ExportPool::new(layout.layers, blocks, layout.block_bytes(), config.lease)?;
        let (addr, len) = pool.memory();
        // SAFETY: the arena is a boxed slice owned by the pool, which the exporter keeps (and
        // never reallocates) for as long as the agent lives.
        unsafe { agent.register_host(addr, len)? };
        let metadata = AgentMetadata::for_host_regions(
            &engine_id,
            agent.metadata()?,
            pool.region_addresses(),
            blocks,
            layout.block_bytes(),
            block_tokens,
            attn_backend,
        );
        let hash = side_channel::compatibility_hash(&side_channel::CompatFactors {
            model: &config.model_name,
            dtype: layout.dtype,
            // The model's (vLLM's `get_total_num_kv_heads`), for MLA too.
            num_kv_heads: model.num_kv_heads,
            // vLLM's head size: one of K's and V's (they are equal), or MLA's whole row.
            head_size: if layout.mla {
                layout.row
            } else {
                layout.row / 2
            },
            num_hidden_layers: layout.layers,
            attn_backend_name: attn_backend,
        });
        let export = Arc::new(Self {
            agent,
            pool: Mutex::new(pool),
            layout,
            engine_id,
            host: config.host.clone(),
            port,
            rank,
        });
        let serving = Arc::clone(&export);
        SideChannel::spawn(&config.host, port, &metadata, &hash, POLL, move || {
            serving.apply_notifications()
        })?;
        tracing::info!(
            rank,
            engine_id = %export.engine_id,
            side_channel = %format!("tcp://{}:{port}", config.host),
            blocks,
            block_bytes = layout.block_bytes(),
            dtype = layout.dtype.torch_name(),
            "KV export over NIXL ready (vLLM 0.33 NixlConnector, layout LBHNC)"
        );
        Ok(export)
    }

    /// The arena's counters and gauges.
    pub fn stats(&self) -> ExportStats {
        self.pool.lock().map(|p| p.stats()).unwrap_or_default()
    }

    /// Copies the first `tokens` positions of sequence `id`'s cache into held blocks and says
    /// where a decode side finds them.
    pub fn export(
        &self,
        id: u64,
        cache: &KvCache,
        tokens: usize,
    ) -> Result<KvTransferParams, KvExportError> {
        let request_id = format!("rackfill-{id}");
        let count = self.layout.blocks_for(tokens);
        let started = Instant::now();
        // A device's cache is read back to the host first (the GPU path's bf16 KV).
        let device_layers = match &cache.device {
            Some(device) => Some(
                device
                    .read_back()
                    .map_err(|e| KvExportError::Layout(format!("reading the device's KV: {e}")))?,
            ),
            None => None,
        };
        let blocks = {
            let mut pool = self.pool.lock().map_err(|_| poisoned())?;
            let blocks = pool.hold(&request_id, count, Instant::now(), |layer, blocks| {
                let kv = match &device_layers {
                    Some(layers) => layers.get(layer),
                    None => cache.layers.get(layer).and_then(|l| l.keys_values()),
                };
                let kv = kv.ok_or_else(|| {
                    KvExportError::Layout(format!("no KV cached in layer {layer}"))
                })?;
                self.layout
                    .write_layer(&self.layout.rows(kv)?, tokens, blocks)
            });
            let stats = pool.stats();
            drop(pool);
            pool::record_metrics(self.rank, &stats);
            blocks?
        };
        pool::record_copy(started.elapsed());
        Ok(KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: vec![blocks],
            remote_engine_id: self.engine_id.clone(),
            remote_request_id: request_id,
            remote_host: self.host.clone(),
            remote_port: self.port,
            remote_num_tokens: tokens,
            tp_size: 1,
            pp_size: 1,
            dcp_size: 1,
            remote_blocks_expiry_time: None,
            remote_registration_generation: 1,
            transfer_mode: "pull".into(),
        })
    }

    /// Applies the decode sides' notifications and frees expired leases (every [`POLL`], on
    /// the side channel's thread).
    fn apply_notifications(&self) {
        let notifications = self.agent.take_notifications().unwrap_or_else(|err| {
            tracing::error!(%err, "KV export: reading NIXL notifications failed");
            Vec::new()
        });
        let now = Instant::now();
        let Ok(mut pool) = self.pool.lock() else {
            return;
        };
        let before = pool.stats();
        for (agent, message) in notifications {
            let message = String::from_utf8_lossy(&message);
            if let Some(id) = pool.notify(&message, now) {
                tracing::debug!(request = %id, decode = %agent, "KV export: read and released");
            }
        }
        for id in pool.expire(now) {
            tracing::warn!(
                request = %id,
                "KV export: no decode side read this request's blocks before its lease ran out \
                 (--kv-export-timeout); freed"
            );
        }
        let stats = pool.stats();
        drop(pool);
        if stats != before {
            pool::record_metrics(self.rank, &stats);
        }
    }
}

/// Starts this process's exporter for rank `rank` when `config` asks for one: what request
/// validation is told, and the exporter. A host without NIXL (or a configuration this engine
/// cannot export) still serves; `do_remote_decode` requests then get an error naming why.
/// `block_tokens` and `default_blocks` as in [`KvExport::start`].
pub fn start_for_rank(
    config: Option<&KvExportConfig>,
    model: &ModelConfig,
    (block_tokens, default_blocks): (usize, usize),
    rank: usize,
) -> (KvExportSupport, Option<Arc<KvExport>>) {
    let Some(config) = config else {
        return (KvExportSupport::Off, None);
    };
    match KvExport::start(config, model, block_tokens, default_blocks, rank) {
        Ok(export) => (KvExportSupport::Ready, Some(export)),
        Err(err) => {
            tracing::warn!(
                rank,
                "--kv-export: {err}; serving without it (do_remote_decode requests get 400)"
            );
            (KvExportSupport::Unavailable(err.to_string()), None)
        }
    }
}

fn poisoned() -> KvExportError {
    KvExportError::Config("the export arena's lock was poisoned".into())
}

/// The exported block's shape for `model`.
fn block_layout(
    config: &KvExportConfig,
    model: &ModelConfig,
    block_tokens: usize,
) -> Result<BlockLayout, KvExportError> {
    let dtype = match (config.dtype, model.dtype.as_deref()) {
        (Some(dtype), _) => dtype,
        (None, Some(name)) => KvDtype::parse(name).ok_or_else(|| {
            KvExportError::Config(format!(
                "the checkpoint's dtype {name:?} has no KV export; set --kv-export-dtype"
            ))
        })?,
        // transformers' default when config.json names none.
        (None, None) => KvDtype::F32,
    };
    let (heads, row) = match &model.mla {
        Some(mla) => (1, mla.kv_lora_rank + mla.qk_rope_head_dim),
        None => (model.num_kv_heads, 2 * model.head_dim),
    };
    Ok(BlockLayout {
        layers: model.num_layers,
        heads,
        row,
        mla: model.mla.is_some(),
        block_tokens,
        dtype,
    })
}
