//! `rackfill serve`: the OpenAI-compatible server on one model (the built-in one by default,
//! offline). SIGINT / SIGTERM drain in-flight requests (up to `--shutdown-timeout` seconds), stop
//! the engine and exit 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rackfill_balancer::Algo;
use rackfill_engine::fabric::FabricKind;
use rackfill_engine::routing_trace::RoutingTraceConfig;
use rackfill_engine::{
    EngineConfig, EpConfig, ModelDevice, ModelWeights, Schedule, SchedulerConfig,
};
use rackfill_models::{ExpertSelection, ModelBundle};
use rackfill_server::{AppState, ServerConfig};

use crate::flags::{parse_bytes, BALANCER_ALIASES, EP_SIZE_ALIASES, REDUNDANT_SLOTS_ALIASES};
use crate::kv_export_args::KvExportArgs;

/// Arguments of `rackfill serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Checkpoint directory or hub id (`org/name[@revision]`, from the local hub cache); the
    /// built-in tiny MoE model when omitted.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Expert-parallel ranks `R` [default: 8 in one process; under mpirun/srun, the number of
    /// processes, which it must equal if given].
    #[arg(long, aliases = EP_SIZE_ALIASES)]
    pub(crate) ep_size: Option<usize>,
    /// Redundant expert slots per rank.
    #[arg(long, default_value_t = EpConfig::default().redundant_slots,
          aliases = REDUNDANT_SLOTS_ALIASES)]
    redundant_slots: usize,
    /// Balancer: quota, eplb-exact, eplb-history, greedy-move or none.
    #[arg(long, default_value_t = EpConfig::default().balancer, aliases = BALANCER_ALIASES)]
    balancer: Algo,
    /// Prefill tokens per rank and step.
    #[arg(long, default_value_t = EngineConfig::default().scheduler.chunk_tokens)]
    chunk_tokens: usize,
    /// KV-cache tokens per rank, used in whole blocks (also the longest prompt plus max_tokens
    /// one request may ask).
    #[arg(long, default_value_t = EngineConfig::default().scheduler.kv_tokens_per_rank)]
    kv_tokens_per_rank: usize,
    /// Tokens per KV block: the unit of the KV budget and of prefix reuse.
    #[arg(long, default_value_t = EngineConfig::default().scheduler.block_tokens)]
    kv_block_tokens: usize,
    /// Compute every prompt from scratch instead of reusing the KV of a cached prefix.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Generation requests handled at once; more get 429.
    #[arg(long, default_value_t = ServerConfig::default().max_concurrent_requests)]
    max_concurrent_requests: usize,
    /// Sequences waiting for the engine beyond which submissions get 429.
    #[arg(long, default_value_t = EngineConfig::default().max_waiting)]
    max_waiting: usize,
    /// Most tokens one request may reserve: prompt plus max_tokens, summed over its prompts
    /// times n; more get 400 naming both numbers.
    #[arg(long, default_value_t = EngineConfig::default().max_request_tokens)]
    max_request_tokens: usize,
    /// Largest request body in bytes; larger get 413.
    #[arg(long, default_value_t = ServerConfig::default().max_body_bytes)]
    max_body_bytes: usize,
    /// Client connections served at once; more wait in the kernel's listen backlog until one
    /// closes.
    #[arg(long, default_value_t = ServerConfig::default().max_connections)]
    max_connections: usize,
    /// Bearer token required on /v1/* and the /tokenize, /detokenize, /tokenizer_info routes
    /// (default: the RACKFILL_API_KEY environment variable).
    #[arg(long)]
    api_key: Option<String>,
    /// Seconds in-flight requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = ServerConfig::default().shutdown_timeout.as_secs_f64())]
    shutdown_timeout: f64,
    /// Seconds /health answers 503 before the server goes: a draining server keeps its listener
    /// open answering 503 at least this long (at most --shutdown-timeout), and a failing group
    /// answers every open request and /health with the failing rank this long before its
    /// processes end. Set it to what the load balancer takes to mark a backend down (two probe
    /// periods or more), so it takes the server out before connections are refused.
    #[arg(long, default_value_t = HEALTH_GRACE)]
    health_grace: f64,
    /// Seconds a client may take to send a request's head (also how long an idle keep-alive
    /// connection stays open), and again its body (408 after that).
    #[arg(long, default_value_t = ServerConfig::default().read_timeout.as_secs_f64())]
    read_timeout: f64,
    /// Seconds a streamed response may wait for a client that stopped reading before the
    /// request is cancelled.
    #[arg(long, default_value_t = ServerConfig::default().write_timeout.as_secs_f64())]
    write_timeout: f64,
    /// Record every step's per-layer expert load matrices to this file (the routing-trace format
    /// of docs/bench-balance.md, replayable with `rackfill bench balance --trace`).
    #[arg(long)]
    record_routing: Option<PathBuf>,
    /// Stop recording before the step that would take the --record-routing file past this size
    /// (bytes, or with a K/M/G/T suffix); the file keeps whole steps only, and the gauge
    /// rackfill:routing_trace_recording drops to 0.
    #[arg(long, value_parser = parse_bytes, requires = "record_routing",
          default_value_t = RoutingTraceConfig::DEFAULT_MAX_BYTES)]
    record_routing_max_bytes: u64,
    /// The model name clients use (default: the --model argument, or the built-in name).
    #[arg(long)]
    served_model_name: Option<String>,
    #[command(flatten)]
    kv_export: KvExportArgs,
    /// Where each rank's model and its MoE layers run: `auto` (the GPU where the binary has the
    /// GPU path and a device is visible, else the CPU), `cpu`, `cuda` (GPU 0, or the process's
    /// local rank under mpirun/srun modulo the GPUs visible: more processes than GPUs share
    /// them) or `cuda:N`. On a GPU the whole model and its MoE data plane run there in bf16,
    /// weights read from the checkpoint straight to the device.
    #[arg(long, default_value = "auto")]
    pub(crate) device: String,
    /// Where a GPU's quota plans are solved: `host` (the host planner, the plan uploaded; measured
    /// faster on an H100) or `device` (the quota solver on the GPU, the relay planner reading the
    /// plan where it is). Only with a GPU and a quota balancer.
    #[arg(long, default_value = "host", value_parser = ["host", "device"])]
    pub(crate) plan_on: String,
    /// How a device's MoE rows, outputs and replicas cross to ranks of other processes: `peer`
    /// (peer memory: every rank's receive buffers mapped into every process, CUDA IPC between
    /// the GPUs of one host, a memfd on the emulator; device to device, the host only sizes
    /// the copies; falls back to `host`, logged, where a process cannot map its peers) or
    /// `host` (through host buffers and MPI/NCCL). Every rank logs the path it took.
    #[arg(long, default_value = "peer", value_parser = ["peer", "host"])]
    pub(crate) moe_transport: String,
    /// How each step's MoE work overlaps: `auto` (`ultraep`, measured fastest on the CPU and on
    /// one GPU; the overlapping schedules are for racks whose replicas cross NVLink), `ultraep`
    /// (replicas, then dispatch and experts),
    /// `pipelined` (dispatch and main experts while the replicas stream; each replica waits for
    /// its own slot), `two-batch` (each rank's sequences in two micro-batches, one communicating
    /// while the other computes, each with its own plan and replica slots), `overlapped` (both).
    /// The names `rackfill simulate --schedule` costs.
    #[arg(long, default_value = "auto")]
    pub(crate) schedule: String,
    /// Where replicas live between steps: `shared` (one set of redundant slots for every MoE
    /// layer, streamed afresh every layer) or `per-layer` (each MoE layer keeps its slots and
    /// streams only replicas not already resident; the slot memory times the MoE layers).
    #[arg(long, default_value = "shared", value_parser = crate::flags::parse_slot_memory)]
    pub(crate) slot_memory: rackfill_engine::SlotMemory,
    /// With --slot-memory per-layer and a quota balancer: move replicas onto ranks that still
    /// hold the same expert while the busiest rank's load stays within this fraction of the
    /// solved plan's (0.02: 2% more); `off` keeps the plans as solved [default: 0.02].
    #[arg(long, value_parser = crate::flags::parse_reuse_tolerance)]
    pub(crate) reuse_tolerance: Option<crate::flags::ReuseTolerance>,
    /// Under mpirun/srun: what carries the MoE layers' data between processes: `auto`, `mpi`
    /// (host memory over MPI) or `nccl` (through the process's GPU, one per process)
    /// [default: auto].
    #[arg(long)]
    pub(crate) fabric: Option<FabricKind>,
    /// Under mpirun/srun: a rank that makes no progress (or whose heartbeats stop) for this many
    /// seconds stops every process of the group with a non-zero status, naming the rank. Must
    /// exceed the longest engine step [default: 30].
    #[arg(long)]
    pub(crate) watchdog_timeout: Option<f64>,
    /// Under mpirun/srun: rewritten about every second while this process's rank makes progress
    /// (for a liveness probe: check its age).
    #[arg(long)]
    pub(crate) heartbeat_file: Option<PathBuf>,
    /// Replaced by --device (the MoE data plane runs where the model runs).
    #[arg(long, hide = true)]
    data_plane: Option<String>,
    /// Replaced by --schedule.
    #[arg(long, hide = true)]
    micro_batches: Option<String>,
    /// Replaced by --schedule.
    #[arg(long, hide = true)]
    pipelined_experts: Option<String>,
}

/// `--watchdog-timeout`'s default, seconds.
const WATCHDOG_TIMEOUT: f64 = 30.0;

/// `--health-grace`'s default, seconds: two periods of a probe every 2.5 s.
const HEALTH_GRACE: f64 = 5.0;

impl ServeArgs {
    /// Fails, naming the replacement, on a flag that is gone; and on one that does not apply:
    /// the group flags outside a group (`in_group`: under mpirun/srun), `--reuse-tolerance`
    /// without per-layer slots.
    pub(crate) fn check_applies(&self, in_group: bool) -> Result<()> {
        if let Some(plane) = &self.data_plane {
            bail!(
                "--data-plane {plane}: replaced by --device, the MoE data plane runs where the \
                 model runs (--device cpu, or --device cuda[:N] for the model and its data plane \
                 on a GPU)"
            );
        }
        if self.micro_batches.is_some() || self.pipelined_experts.is_some() {
            bail!(
                "--micro-batches and --pipelined-experts were replaced by --schedule \
                 (ultraep, pipelined, two-batch or overlapped)"
            );
        }
        if !in_group {
            let group_flags = [
                ("--fabric", self.fabric.is_some()),
                ("--watchdog-timeout", self.watchdog_timeout.is_some()),
                ("--heartbeat-file", self.heartbeat_file.is_some()),
            ];
            if let Some((flag, _)) = group_flags.iter().find(|(_, given)| *given) {
                bail!(
                    "{flag} applies to a group of processes under mpirun/srun; this process \
                     serves every rank itself"
                );
            }
        }
        if self.reuse_tolerance.is_some()
            && self.slot_memory != rackfill_engine::SlotMemory::PerLayer
        {
            bail!(
                "--reuse-tolerance acts on replicas kept between steps: it needs --slot-memory \
                 per-layer"
            );
        }
        Ok(())
    }

    /// The fabric of a group (`--fabric`, `auto` by default).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn fabric(&self) -> FabricKind {
        self.fabric.unwrap_or(FabricKind::Auto)
    }

    /// The watchdog timeout of a group, in seconds.
    pub(crate) fn watchdog_timeout(&self) -> f64 {
        self.watchdog_timeout.unwrap_or(WATCHDOG_TIMEOUT)
    }
}

/// Engine and server settings from the flags, checked before anything is loaded (the GPU probe
/// for `--device auto` runs here, once).
pub(crate) fn configs(args: &ServeArgs) -> Result<ServeConfig> {
    if args.ep_size == Some(0) {
        bail!("--ep-size must be at least 1");
    }
    if args.chunk_tokens == 0 {
        bail!("--chunk-tokens must be at least 1");
    }
    if args.kv_block_tokens == 0 {
        bail!("--kv-block-tokens must be at least 1");
    }
    if args.kv_tokens_per_rank < args.kv_block_tokens {
        bail!(
            "--kv-tokens-per-rank {} holds no KV block of --kv-block-tokens {}",
            args.kv_tokens_per_rank,
            args.kv_block_tokens
        );
    }
    if args.max_concurrent_requests == 0 {
        bail!("--max-concurrent-requests must be at least 1");
    }
    if args.max_waiting == 0 {
        bail!("--max-waiting must be at least 1");
    }
    if args.max_request_tokens == 0 {
        bail!("--max-request-tokens must be at least 1");
    }
    if args.max_body_bytes == 0 {
        bail!("--max-body-bytes must be at least 1");
    }
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    let shutdown_timeout = seconds("--shutdown-timeout", args.shutdown_timeout)?;
    let health_grace = seconds("--health-grace", args.health_grace)?;
    let read_timeout = seconds("--read-timeout", args.read_timeout)?;
    let write_timeout = seconds("--write-timeout", args.write_timeout)?;
    if read_timeout.is_zero() || write_timeout.is_zero() {
        bail!("--read-timeout and --write-timeout must be more than 0 seconds");
    }
    if args.served_model_name.as_deref() == Some("") {
        bail!("--served-model-name must not be empty");
    }
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("RACKFILL_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let watchdog_timeout = seconds("--watchdog-timeout", args.watchdog_timeout())?;
    if watchdog_timeout.is_zero() {
        bail!("--watchdog-timeout must be more than 0 seconds");
    }
    let (device, device_note) = model_device(&args.device)?;
    let schedule = schedule(&args.schedule)?;
    let plan_on_device = args.plan_on == "device";
    if plan_on_device && device == ModelDevice::Cpu {
        bail!("--plan-on device solves plans on the GPU: the model runs {device_note}");
    }
    if plan_on_device && !matches!(args.balancer, Algo::Quota | Algo::QuotaPaper) {
        bail!(
            "--plan-on device: the GPU solves quota plans only; --balancer {} plans on the host",
            args.balancer
        );
    }
    let engine = EngineConfig {
        device,
        ep: EpConfig {
            ep_size: args.ep_size.unwrap_or(EpConfig::default().ep_size),
            redundant_slots: args.redundant_slots,
            balancer: args.balancer,
            schedule,
            slot_memory: args.slot_memory,
            reuse_tolerance: args
                .reuse_tolerance
                .map_or(EpConfig::default().reuse_tolerance, |t| t.0),
            plan_on_device,
            peer_memory: args.moe_transport == "peer",
            ..EpConfig::default()
        },
        scheduler: SchedulerConfig {
            chunk_tokens: args.chunk_tokens,
            kv_tokens_per_rank: args.kv_tokens_per_rank,
            block_tokens: args.kv_block_tokens,
            prefix_caching: !args.no_prefix_cache,
        },
        max_waiting: args.max_waiting,
        max_request_tokens: args.max_request_tokens,
        record_routing: args.record_routing.as_ref().map(|path| RoutingTraceConfig {
            path: path.clone(),
            max_bytes: args.record_routing_max_bytes,
        }),
        kv_export: args.kv_export.config(
            args.served_model_name
                .as_deref()
                .or(args.model.as_deref())
                .unwrap_or(rackfill_models::bundle::BUILTIN_MODEL_NAME),
        )?,
    };
    let server = ServerConfig {
        api_key,
        max_concurrent_requests: args.max_concurrent_requests,
        max_body_bytes: args.max_body_bytes,
        max_connections: args.max_connections,
        read_timeout,
        write_timeout,
        shutdown_timeout,
        health_grace,
    };
    Ok(ServeConfig {
        engine,
        server,
        device_note,
        watchdog_timeout,
    })
}

/// `rackfill serve`'s settings, checked.
pub(crate) struct ServeConfig {
    pub engine: EngineConfig,
    pub server: ServerConfig,
    /// Where the model and its MoE layers run and why, for the startup log.
    pub device_note: String,
    /// Under an MPI launcher: how long a rank may make no progress (`--watchdog-timeout`;
    /// checked in every build, read only by the `mpi` one).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub watchdog_timeout: Duration,
}

/// `value` seconds of the flag `flag` as a duration: a non-negative number no larger than a
/// duration holds (about 5.8e11 years).
pub(crate) fn seconds(flag: &str, value: f64) -> Result<Duration> {
    if value < 0.0 {
        bail!("{flag} must be a non-negative number of seconds, got {value}");
    }
    Duration::try_from_secs_f64(value)
        .map_err(|_| anyhow::anyhow!("{flag} must be a finite number of seconds, got {value}"))
}

pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}

/// Runs the server, every EP rank in this process, until SIGINT / SIGTERM.
pub(crate) fn serve_one_process(args: &ServeArgs, config: ServeConfig) -> Result<()> {
    let ServeConfig {
        engine: engine_config,
        server: server_config,
        device_note,
        ..
    } = config;
    let ep = engine_config.ep;
    let device = engine_config.device;
    serve_http(
        args,
        &device_note,
        load_bundle(args, None, device),
        |bundle| {
            let state = AppState::launch(bundle, engine_config, server_config)
                .context("cannot start the engine")?;
            Ok((state, ep))
        },
    )
}

/// Loads the model `--model` names for `device`, with `--served-model-name` applied: on the CPU
/// into host memory (`shard`: only these routed experts), on a device left in its checkpoint
/// (each process reads only its ranks' tensors when its engine uploads them).
pub(crate) fn load_bundle(
    args: &ServeArgs,
    shard: Option<ExpertSelection>,
    device: ModelDevice,
) -> impl FnOnce() -> Result<ModelBundle<ModelWeights>> + Send + 'static {
    let spec = args.model.clone();
    let served_name = args.served_model_name.clone();
    move || {
        let loaded = match device {
            ModelDevice::Cpu => {
                let selection = shard.unwrap_or(ExpertSelection::All);
                ModelBundle::load_with(spec.as_deref(), &selection).map(|b| b.map(Into::into))
            }
            _ => ModelBundle::open(spec.as_deref()).map(|b| b.map(Into::into)),
        };
        let mut bundle = loaded.with_context(|| {
            format!(
                "cannot load model {}",
                spec.as_deref().unwrap_or("<built-in>")
            )
        })?;
        if let Some(name) = served_name {
            bundle.name = name;
        }
        Ok(bundle)
    }
}

/// Binds the listener, loads the model with `load`, starts the engine with `start`, and serves
/// HTTP until SIGINT / SIGTERM (or the engine's group asks to stop). `start` also says how the
/// engine it started is laid out.
pub(crate) fn serve_http(
    args: &ServeArgs,
    device_note: &str,
    load: impl FnOnce() -> Result<ModelBundle<ModelWeights>> + Send + 'static,
    start: impl FnOnce(ModelBundle<ModelWeights>) -> Result<(AppState, EpConfig)>,
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rackfill-http")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        // Bind first: a taken port fails fast, before the model loads.
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let local: SocketAddr = listener.local_addr().context("listener address")?;
        let bundle = tokio::task::spawn_blocking(load)
            .await
            .context("model loading panicked")??;
        let name = bundle.name.clone();
        tracing::info!("model and MoE data plane: {device_note}");
        let (state, ep) = start(bundle)?;
        tracing::info!(
            model = %name,
            ep_size = ep.ep_size,
            redundant_slots = ep.redundant_slots,
            balancer = %ep.balancer.name(),
            auth = state.config().api_key.is_some(),
            "rackfill listening on http://{local}"
        );
        rackfill_server::serve(listener, state, shutdown_signal())
            .await
            .context("server failed")
    })?;
    // Connection tasks that outlived the drain are dropped here.
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// The device `--device` asks for, and a line for the startup log saying where the model runs
/// and why. `auto` never fails: without feature `cuda` or a visible GPU it picks the CPU and says
/// why; `cuda` without a GPU fails when the engine opens the device.
pub(crate) fn model_device(arg: &str) -> Result<(ModelDevice, String)> {
    let wanted = match arg {
        "auto" => None,
        other => Some(
            other
                .parse::<ModelDevice>()
                .map_err(|e| anyhow::anyhow!("--device: {e}"))?,
        ),
    };
    match wanted {
        Some(ModelDevice::Cpu) => Ok((ModelDevice::Cpu, "on the CPU (--device cpu)".into())),
        #[cfg(feature = "cuda")]
        Some(ModelDevice::Emulator) => Ok((
            ModelDevice::Emulator,
            "the GPU path on the host emulator (--device emulator: a check, far slower than a GPU)"
                .into(),
        )),
        // Checked before the model loads (minutes for a large one): a host without a usable GPU
        // fails at once.
        #[cfg(feature = "cuda")]
        Some(device) => match rackfill_kernels::cuda::probe() {
            Ok(gpu) => Ok((
                device,
                format!("on the GPU (--device {device}; GPU 0 is {gpu})"),
            )),
            Err(why) => bail!("--device {device}: {why}"),
        },
        #[cfg(not(feature = "cuda"))]
        Some(device) => bail!(
            "--device {device} needs the GPU path of the default build (this binary was built \
             with --no-default-features and runs on the CPU only)"
        ),
        #[cfg(feature = "cuda")]
        None => Ok(match rackfill_kernels::cuda::probe() {
            Ok(gpu) => (
                ModelDevice::Cuda { ordinal: None },
                format!("on GPU {gpu} (--device auto)"),
            ),
            Err(why) => (ModelDevice::Cpu, format!("on the CPU: {why}")),
        }),
        #[cfg(not(feature = "cuda"))]
        None => Ok((
            ModelDevice::Cpu,
            "on the CPU (built with --no-default-features)".into(),
        )),
    }
}

/// The schedule `--schedule` names: `auto` is the one measured fastest wherever rackfill has
/// been measured, `ultraep`: on the CPU, whose cores would copy replicas and compute at once, and
/// on one GPU, where a step's replicas are device copies of about a millisecond and leave nothing
/// to hide (pipelined 0.96x, two-batch 0.86x; docs/gpu.md). The overlapping schedules are for
/// racks where replicas cross NVLink (`rackfill simulate` costs them).
pub(crate) fn schedule(arg: &str) -> Result<Schedule> {
    match arg {
        "auto" => Ok(Schedule::ULTRAEP),
        other => other
            .parse::<Schedule>()
            .map_err(|e| anyhow::anyhow!("--schedule: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn parse(flags: &[&str]) -> Result<(EngineConfig, ServerConfig)> {
        let mut argv = vec!["serve"];
        argv.extend_from_slice(flags);
        let wrapper = Wrapper::try_parse_from(argv)?;
        configs(&wrapper.args).map(|c| (c.engine, c.server))
    }

    #[test]
    fn defaults_and_overrides() {
        let (engine, server) = parse(&[]).unwrap();
        assert_eq!(engine.ep.ep_size, 8);
        assert_eq!(engine.ep.redundant_slots, 2);
        assert_eq!(engine.ep.balancer, Algo::Quota);
        assert_eq!(server.max_concurrent_requests, 256);
        assert_eq!(server.max_connections, 1024);
        assert_eq!(engine.scheduler.block_tokens, 16);
        assert!(engine.scheduler.prefix_caching, "on by default");
        let (engine, _) = parse(&["--no-prefix-cache", "--kv-block-tokens", "32"]).unwrap();
        assert!(!engine.scheduler.prefix_caching);
        assert_eq!(engine.scheduler.block_tokens, 32);
        let (engine, server) = parse(&[
            "--ep-size",
            "4",
            "--balancer",
            "eplb-history",
            "--api-key",
            "k",
            "--shutdown-timeout",
            "2.5",
            "--read-timeout",
            "0.25",
            "--max-connections",
            "7",
            "--max-request-tokens",
            "9000",
        ])
        .unwrap();
        assert_eq!(engine.ep.ep_size, 4);
        assert_eq!(engine.ep.balancer.name(), "eplb-history");
        assert_eq!(server.api_key.as_deref(), Some("k"));
        assert_eq!(server.shutdown_timeout, Duration::from_millis(2500));
        assert_eq!(server.read_timeout, Duration::from_millis(250));
        assert_eq!(server.max_connections, 7);
        assert_eq!(engine.max_request_tokens, 9000);
        assert_eq!(server.write_timeout, Duration::from_secs(60));
    }

    #[test]
    fn bad_flags_are_one_line_errors() {
        for flags in [
            &["--ep-size", "0"][..],
            &["--max-concurrent-requests", "0"],
            &["--max-connections", "0"],
            &["--max-request-tokens", "0"],
            &["--shutdown-timeout=-1"],
            &["--shutdown-timeout", "1e300"],
            &["--shutdown-timeout", "NaN"],
            &["--read-timeout", "0"],
            &["--read-timeout", "inf"],
            &["--write-timeout", "0"],
            &["--write-timeout=-3"],
            &["--served-model-name", ""],
            &["--schedule", "three-batch"],
            &["--device", "tpu"],
            &["--watchdog-timeout", "0"],
            &["--watchdog-timeout=-1"],
            &["--kv-block-tokens", "0"],
            &["--kv-tokens-per-rank", "8", "--kv-block-tokens", "16"],
        ] {
            let err = parse(flags).unwrap_err().to_string();
            assert!(!err.contains('\n'), "{flags:?}: {err}");
        }
        // Refused by the flag parser (the binary folds its message into one line).
        assert!(parse(&["--port", "70000"]).is_err());
        assert!(parse(&["--balancer", "nope"]).is_err());
        assert!(parse(&["--fabric", "bogus"]).is_err());
        assert!(parse(&["--record-routing-max-bytes", "1G"]).is_err());
    }

    #[test]
    fn old_spellings_are_hidden_aliases() {
        let (engine, _) = parse(&["--ep", "4", "--slots", "1", "--algo", "none"]).unwrap();
        assert_eq!(
            (
                engine.ep.ep_size,
                engine.ep.redundant_slots,
                engine.ep.balancer
            ),
            (4, 1, Algo::None)
        );
        let (engine, _) = parse(&["--ranks", "2", "--balancers", "greedy-move"]).unwrap();
        assert_eq!(
            (engine.ep.ep_size, engine.ep.balancer),
            (2, Algo::GreedyMove)
        );
    }

    #[test]
    fn routing_trace_cap() {
        let (engine, _) = parse(&["--record-routing", "r.jsonl"]).unwrap();
        let trace = engine.record_routing.unwrap();
        assert_eq!(trace.max_bytes, RoutingTraceConfig::DEFAULT_MAX_BYTES);
        let (engine, _) = parse(&[
            "--record-routing",
            "r.jsonl",
            "--record-routing-max-bytes",
            "64M",
        ])
        .unwrap();
        assert_eq!(engine.record_routing.unwrap().max_bytes, 64 << 20);
        assert!(parse(&[]).unwrap().0.record_routing.is_none());
    }

    #[test]
    fn schedules_and_replaced_flags() {
        let (engine, _) = parse(&["--device", "cpu"]).unwrap();
        assert_eq!(engine.ep.schedule, Schedule::ULTRAEP);
        let (engine, _) = parse(&["--device", "cpu", "--schedule", "overlapped"]).unwrap();
        assert_eq!(engine.ep.schedule, Schedule::OVERLAPPED);
        assert_eq!(schedule("auto").unwrap(), Schedule::ULTRAEP);
        assert!(!parse(&[]).unwrap().0.ep.plan_on_device);
        let err = parse(&["--device", "cpu", "--plan-on", "device"])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--plan-on device solves plans on the GPU"),
            "{err}"
        );
        let err = parse(&["--schedule", "three-batch"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown schedule 'three-batch'"), "{err}");
        let replaced = |flags: &[&str]| {
            let mut argv = vec!["serve"];
            argv.extend_from_slice(flags);
            let wrapper = Wrapper::try_parse_from(argv).unwrap();
            wrapper.args.check_applies(false).unwrap_err().to_string()
        };
        assert!(replaced(&["--data-plane", "gpu"]).contains("replaced by --device"));
        assert!(replaced(&["--micro-batches", "2"]).contains("replaced by --schedule"));
        assert!(replaced(&["--pipelined-experts", "on"]).contains("replaced by --schedule"));
        assert!(replaced(&["--fabric", "mpi"]).contains("--fabric applies to a group"));
        assert!(replaced(&["--heartbeat-file", "x"]).contains("--heartbeat-file applies"));
        assert!(replaced(&["--reuse-tolerance", "off"]).contains("needs --slot-memory per-layer"));
    }
}
