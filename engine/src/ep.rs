//! The expert-parallel runtime: `R` ranks, data-parallel attention (each rank runs its own
//! sequences), experts sharded `E / R` per rank plus `n_slot` redundant slots per rank, and every
//! MoE layer balanced on its exact load before a token moves (docs/engine.md):
//!
//! router -> load matrix (all-gather) -> plan (every rank identical) -> replica weights streamed
//! over the relay schedule into the slot buffers -> token assignment by cumulative quotas ->
//! dispatch (all-to-all) -> grouped expert compute over main and replica experts -> combine
//! (all-to-all back, weighted sum in top-k order) -> shared experts -> residual.
//!
//! The combine sums each token's expert outputs in its top-k order, exactly as the dense path
//! does, so EP logits equal the dense single-rank logits whatever the plan.
//!
//! A runtime computes for the ranks its [`Fabric`] holds ([`Fabric::local_ranks`]: every rank
//! with the default in-process fabric, one with a process per GPU) and reaches the others only
//! through the fabric's collectives; the data plane (`plane`) does the per-layer work. Its model
//! needs only the routed experts homed on those ranks ([`EpRuntime::expert_selection`] says which
//! to load); replicas of the others arrive over the fabric.

use std::ops::Range;
use std::sync::Arc;

use rackfill_balancer::{Balancer, Layout};
#[cfg(feature = "cuda")]
use rackfill_models::CheckpointModel;
use rackfill_models::{ExpertSelection, KvCache, LogitsFor, ModelConfig, MoeModel, SequenceInput};

use crate::error::{EngineError, Result};
use crate::fabric::{Fabric, LocalFabric};
use crate::model_device::ModelDevice;
use crate::model_weights::ModelWeights;
use crate::plane::cpu::CpuPlane;
use crate::rack_cost::Rack;

mod backend;
mod config;
#[cfg(feature = "cuda")]
mod device;
mod host;
mod planning;
mod step;

use backend::Backend;
use config::{check_config, check_group, check_home_experts, home_layout, plane_config, planners};
pub use config::{EpConfig, LayerReport, SlotLayout, StepOutput};
use planning::{Comm, Reports};

/// The expert-parallel runtime of one model, for the local ranks of its fabric.
pub struct EpRuntime {
    config: EpConfig,
    model_config: ModelConfig,
    layout: Layout,
    /// Per layer (`None` for dense layers): one planner per local rank when plans are verified,
    /// else one.
    planners: Vec<Option<Vec<Box<dyn Balancer>>>>,
    fabric: Box<dyn Fabric>,
    /// What each layer's simulated makespan is costed on.
    rack: Rack,
    backend: Backend,
}

impl EpRuntime {
    /// Lays `model` out over `config.ep_size` ranks, all in this process (the in-process
    /// fabric).
    pub fn new(model: Arc<MoeModel>, config: EpConfig) -> Result<Self> {
        let fabric = Box::new(LocalFabric::new(config.ep_size)?);
        Self::with_fabric(model, config, fabric)
    }

    /// Lays `model` out over the `config.ep_size` ranks of `fabric`'s group, computing for the
    /// ranks this process holds. The model must hold every routed expert homed on those ranks
    /// (all of them, or the [`Self::expert_selection`] for them).
    pub fn with_fabric(
        model: Arc<MoeModel>,
        config: EpConfig,
        fabric: Box<dyn Fabric>,
    ) -> Result<Self> {
        check_config(&config, false)?;
        let local = fabric.local_ranks();
        check_group(&config, &*fabric)?;
        let layout = home_layout(model.config(), &config)?;
        check_home_experts(&model, &layout, local.clone())?;
        let mc = model.config();
        let plane = CpuPlane::new(
            &layout,
            local,
            (mc.hidden_size, mc.moe.intermediate_size),
            &mc.sparse_layers,
            &plane_config(&config, false),
        );
        Ok(Self {
            planners: planners(mc, &config, fabric.local_ranks().len()),
            model_config: mc.clone(),
            config,
            layout,
            fabric,
            rack: Rack::nvl72(),
            backend: Backend::Host { model, plane },
        })
    }

    /// The runtime of `weights` over `fabric`'s group on `device`: on the host from a host
    /// model ([`Self::with_fabric`]); on a GPU ([`ModelDevice::gpu_ordinal`] for a process of
    /// local rank `local_rank`) or the emulator from a checkpoint ([`Self::on_device`]), with a
    /// paged KV cache for `kv_tokens_per_rank` tokens per local rank there.
    pub fn open(
        weights: &ModelWeights,
        config: EpConfig,
        fabric: Box<dyn Fabric>,
        (device, local_rank): (ModelDevice, Option<usize>),
        kv_tokens_per_rank: usize,
    ) -> Result<Self> {
        match (device, weights) {
            (ModelDevice::Cpu, ModelWeights::Host(model)) => {
                Self::with_fabric(Arc::clone(model), config, fabric)
            }
            (ModelDevice::Cpu, ModelWeights::Checkpoint(_)) => Err(EngineError::Config(
                "the model's weights were left in the checkpoint for a device: load them \
                 (ModelBundle::load) to run on the CPU"
                    .into(),
            )),
            #[cfg(feature = "cuda")]
            (_, ModelWeights::Checkpoint(model)) => {
                let exec = device::open_executor(device, local_rank)?;
                Self::on_device(exec, model, config, fabric, kv_tokens_per_rank)
            }
            #[cfg(feature = "cuda")]
            (_, ModelWeights::Host(_)) => Err(EngineError::Config(format!(
                "--device {device} loads the model straight from its checkpoint \
                 (ModelBundle::open), not from a copy in host memory"
            ))),
            #[cfg(not(feature = "cuda"))]
            _ => {
                let _ = (local_rank, kv_tokens_per_rank);
                Err(EngineError::Config(format!(
                    "--device {device} needs the GPU path of the default build (this binary was \
                     built with --no-default-features and runs on the CPU only)"
                )))
            }
        }
    }

    /// The runtime with the local ranks' model (embedding, attention with its paged KV cache of
    /// `kv_tokens_per_rank` tokens per local rank, norms, routers, dense MLPs, shared experts,
    /// LM head) and their home experts with the MoE data plane on `exec` (a GPU, or the host
    /// emulator that checks this path without one), every tensor read from `model`'s
    /// checkpoint and uploaded once.
    #[cfg(feature = "cuda")]
    pub fn on_device(
        exec: Arc<dyn rackfill_kernels::cuda::exec::Executor>,
        model: &CheckpointModel,
        config: EpConfig,
        fabric: Box<dyn Fabric>,
        kv_tokens_per_rank: usize,
    ) -> Result<Self> {
        check_config(&config, true)?;
        check_group(&config, &*fabric)?;
        let mc = &model.config;
        let layout = home_layout(mc, &config)?;
        let mut device = device::OnDevice::open(
            exec,
            model,
            (&layout, fabric.local_ranks()),
            kv_tokens_per_rank,
            &plane_config(&config, true),
        )?;
        if fabric.spans_processes() && fabric.local_ranks().len() < fabric.world_size() {
            device.connect(&*fabric, config.peer_memory)?;
        }
        Ok(Self {
            planners: planners(mc, &config, fabric.local_ranks().len()),
            model_config: mc.clone(),
            config,
            layout,
            fabric,
            rack: Rack::nvl72(),
            backend: Backend::Device(Box::new(device)),
        })
    }

    /// An empty KV cache for a new sequence on this runtime's device, in blocks of
    /// `block_tokens` tokens on the host.
    pub fn new_cache(&self, block_tokens: usize) -> KvCache {
        #[allow(unused_mut)]
        let mut cache = KvCache::new(self.model_config.num_layers, block_tokens);
        #[cfg(feature = "cuda")]
        if let Backend::Device(device) = &self.backend {
            cache.device = Some(Box::new(device.new_sequence()));
        }
        cache
    }

    /// The routed experts a process holding EP ranks `local` of `config.ep_size` must load for a
    /// model of `model` (in every MoE layer): those homed on its ranks in the layout the runtime
    /// builds, [`ExpertSelection::All`] when its ranks home every expert. The rest reach its ranks
    /// as replicas streamed from their home ranks, so a process never reads them.
    pub fn expert_selection(
        model: &ModelConfig,
        config: &EpConfig,
        local: Range<usize>,
    ) -> Result<ExpertSelection> {
        if local.is_empty() || local.end > config.ep_size {
            return Err(EngineError::Config(format!(
                "local ranks {local:?} of EP size {}",
                config.ep_size
            )));
        }
        let layout = home_layout(model, config)?;
        let homed = local.flat_map(|rank| layout.main_experts(rank).iter().copied());
        let selection = ExpertSelection::only(homed);
        Ok(if selection.is_complete(layout.experts()) {
            ExpertSelection::All
        } else {
            selection
        })
    }

    /// Costs every layer's simulated makespan on `rack` from now on (default: NVL72, the rack
    /// `rackfill simulate` defaults to).
    pub fn set_rack(&mut self, rack: Rack) {
        self.rack = rack;
    }

    /// The rack simulated makespans are costed on.
    pub fn rack(&self) -> &Rack {
        &self.rack
    }

    /// The expert layout (home rank of every expert, slots per rank).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The configuration this runtime was built with.
    pub fn config(&self) -> &EpConfig {
        &self.config
    }

    /// The architecture of the model it runs.
    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The ranks this runtime computes for (its fabric's local ranks).
    pub fn local_ranks(&self) -> std::ops::Range<usize> {
        self.fabric.local_ranks()
    }

    /// The path the MoE layers' rows and replicas take between ranks: `cpu` (host memory and the
    /// fabric), `device` (every rank on this process's device), `peer` (device ranks of several
    /// processes, rows and outputs through peer memory) or `host` (device ranks of several
    /// processes, through host buffers and the fabric).
    pub fn data_path(&self) -> &'static str {
        match &self.backend {
            Backend::Host { .. } => "cpu",
            #[cfg(feature = "cuda")]
            Backend::Device(_) if self.fabric.local_ranks().len() == self.config.ep_size => {
                "device"
            }
            #[cfg(feature = "cuda")]
            Backend::Device(device) if device.peer_memory().is_some() => "peer",
            #[cfg(feature = "cuda")]
            Backend::Device(_) => "host",
        }
    }

    /// With the model on a device: the bytes written there from the host while loading (each
    /// tensor once), and the bytes of the routed experts this process's ranks home.
    pub fn device_weight_bytes(&self) -> Option<(u64, u64)> {
        match &self.backend {
            Backend::Host { .. } => None,
            #[cfg(feature = "cuda")]
            Backend::Device(device) => Some(device.weight_bytes()),
        }
    }

    /// Bytes the fabric has delivered to this process's ranks since the runtime was built.
    pub fn bytes_moved(&self) -> u64 {
        self.fabric.bytes_moved()
    }

    /// A copy of local rank `rank`'s redundant slot `slot` of micro-batch `micro_batch`, in the
    /// slots model layer `layer` uses (what that micro-batch's last plan streamed there), as
    /// [`Self::slot_layout`] lays an expert out.
    pub fn slot_contents(
        &self,
        (micro_batch, layer): (usize, usize),
        rank: usize,
        slot: usize,
    ) -> Option<Vec<f32>> {
        self.backend.slot_contents((micro_batch, layer), rank, slot)
    }

    /// How a slot holds an expert: f32 `[H, 2I]` gate-up then `[I, H]` down on the host, bf16
    /// `[2I, H]` then `[H, I]` (a checkpoint's own orientation) on a device.
    pub fn slot_layout(&self) -> SlotLayout {
        match &self.backend {
            Backend::Host { .. } => SlotLayout::HostF32,
            #[cfg(feature = "cuda")]
            Backend::Device(_) => SlotLayout::DeviceBf16,
        }
    }

    /// One step: every local rank's batch of sequence chunks through every layer. `batches[i]`
    /// is local rank `i`'s sequences, each continuing from its own KV cache; `which[i][j]` says
    /// which of sequence `j`'s rows get logits. Every process of the fabric's group steps
    /// together, a rank without sequences included.
    pub fn forward(
        &mut self,
        batches: &mut [Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<StepOutput> {
        self.check_step(batches, which)?;
        let EpRuntime {
            config,
            model_config,
            layout,
            planners,
            fabric,
            rack,
            backend,
        } = self;
        let comm = Comm {
            fabric: &**fabric,
            planners,
            layout,
            config,
        };
        let (logits, finished) = step::run(backend, comm, batches, which)?;
        let reports = Reports {
            rack,
            layout,
            config,
            model: model_config,
        };
        Ok(StepOutput {
            logits,
            layers: finished
                .into_iter()
                .map(|(micro_batch, f)| reports.layer(f, micro_batch))
                .collect(),
        })
    }

    /// One batch per local rank, one logits choice per sequence, caches made for this model.
    fn check_step(
        &self,
        batches: &[Vec<SequenceInput<'_>>],
        which: &[Vec<LogitsFor>],
    ) -> Result<()> {
        if which.len() != batches.len()
            || which
                .iter()
                .zip(batches.iter())
                .any(|(w, b)| w.len() != b.len())
        {
            return Err(EngineError::InvalidRequest(
                "one logits choice per sequence is needed".into(),
            ));
        }
        let local = self.fabric.local_ranks();
        if batches.len() != local.len() {
            return Err(EngineError::Fabric(format!(
                "{} rank batches for local ranks {local:?} of EP size {}",
                batches.len(),
                self.config.ep_size
            )));
        }
        let layers = self.model_config.num_layers;
        if batches
            .iter()
            .flatten()
            .any(|s| s.cache.layers.len() != layers)
        {
            return Err(EngineError::InvalidRequest(
                "KV cache was made for a different model".into(),
            ));
        }
        Ok(())
    }
}
