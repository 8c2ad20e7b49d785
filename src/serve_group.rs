//! `rackfill serve` as one process of a multi-process EP group: started by `mpirun -np N` or
//! `srun --mpi=pmix`, each process is EP rank `world rank` of `N`. Rank 0 loads its shard of the
//! model and serves HTTP; every other rank loads its own shard and steps with the group until
//! the leader stops it. A binary built without the `mpi` feature refuses such a launch, since
//! `N` independent servers would otherwise race for one port.

use anyhow::Result;
#[cfg(feature = "mpi")]
use with_mpi::Launched;
#[cfg(not(feature = "mpi"))]
use without_mpi::Launched;

use crate::serve_cmd::{configs, init_logging, serve_one_process, ServeArgs};

/// `rackfill serve`: every rank in this process, or, under an MPI launcher of several
/// processes, this process's rank of the group.
pub fn run(args: ServeArgs) -> Result<()> {
    let config = configs(&args)?;
    init_logging();
    match Launched::detect()? {
        Some(group) => {
            args.check_applies(true)?;
            group.run(&args, config)
        }
        None => {
            args.check_applies(false)?;
            serve_one_process(&args, config)
        }
    }
}

#[cfg(not(feature = "mpi"))]
mod without_mpi {
    use crate::serve_cmd::{ServeArgs, ServeConfig};
    use anyhow::{bail, Result};

    /// Never constructed: this binary has no MPI support.
    pub enum Launched {}

    impl Launched {
        /// Refuses a launch of several processes (see the module documentation).
        pub fn detect() -> Result<Option<Self>> {
            match announced_world_size() {
                Some(size) if size > 1 && launched_by_mpi() => {
                    bail!(
                        "started as one of {size} MPI processes, but this rackfill binary was \
                         built without MPI support: build it with `--features mpi`"
                    )
                }
                _ => Ok(None),
            }
        }

        pub fn run(self, _: &ServeArgs, _: ServeConfig) -> Result<()> {
            match self {}
        }
    }

    /// The world size an MPI launcher announced in the environment, if any.
    fn announced_world_size() -> Option<usize> {
        ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"]
            .iter()
            .find_map(|name| std::env::var(name).ok()?.parse().ok())
    }

    /// Whether an MPI launcher (not just a Slurm allocation) started this process.
    fn launched_by_mpi() -> bool {
        ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"]
            .iter()
            .any(|name| std::env::var_os(name).is_some())
    }
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use std::sync::Arc;

    use anyhow::{bail, Context, Result};
    use rackfill_engine::fabric::FabricKind;
    use rackfill_engine::group::{self, GroupConfig, GroupModel, MpiWorld};
    use rackfill_engine::{EngineConfig, EpRuntime, ModelWeights};
    use rackfill_server::{AppState, ModelMeta};

    use crate::serve_cmd::{load_bundle, serve_http, ServeArgs, ServeConfig};

    /// This process's place in a group of several.
    pub struct Launched {
        world: MpiWorld,
    }

    impl Launched {
        /// The MPI world when an MPI launcher started more than one process.
        pub fn detect() -> Result<Option<Self>> {
            let world = MpiWorld::from_launcher().context("cannot join the MPI world")?;
            Ok(world.filter(|w| w.size() > 1).map(|world| Self { world }))
        }

        /// Serves this process's rank until the group stops.
        pub fn run(self, args: &ServeArgs, config: ServeConfig) -> Result<()> {
            let (rank, size) = (self.world.rank(), self.world.size());
            let ServeConfig {
                engine,
                server,
                device_note,
                watchdog_timeout,
            } = config;
            tracing::info!("rank {rank}: model {device_note}");
            watch_termination_signals(rank);
            let group = GroupConfig {
                watchdog_timeout,
                heartbeat_file: args.heartbeat_file.clone(),
                health_grace: server.health_grace,
            };
            let device = engine.device;
            let served = group_settings(args, engine, group, size)?;
            let model = rackfill_models::ModelBundle::config(args.model.as_deref())
                .with_context(|| format!("cannot load model {}", model_name(args)))?;
            let shard = EpRuntime::expert_selection(&model, &served.config.ep, rank..rank + 1)?;
            if rank != 0 {
                tracing::info!(
                    "rank {rank} of {size} (pid {}): a worker, loading its shard",
                    std::process::id()
                );
                let bundle = load_bundle(args, Some(shard), device)()?;
                let served = served.with_bundle(bundle);
                group::run_worker(&self.world, served)
                    .with_context(|| format!("rank {rank} of {size}"))?;
                tracing::info!("rank {rank} of {size}: the group stopped");
                return Ok(());
            }
            tracing::info!(
                "rank 0 of {size} (pid {}): the leader, serving HTTP",
                std::process::id()
            );
            explain_draining();
            serve_http(
                args,
                &device_note,
                load_bundle(args, Some(shard), device),
                |bundle| {
                    let meta = ModelMeta {
                        name: bundle.name.clone(),
                        chat_template: bundle.chat_template.clone(),
                        generation: bundle.generation.clone(),
                    };
                    let served = served.with_bundle(bundle);
                    let ep = served.config.ep;
                    let handle = group::start_leader(&self.world, served)
                        .context("cannot start the group's engine")?;
                    Ok((AppState::from_engine(handle, meta, server), ep))
                },
            )
        }
    }

    /// Says how this group drains: OpenMPI's `mpirun` does not pass SIGTERM on (it kills the
    /// ranks: SIGTERM after `odls_base_sigkill_timeout`, SIGKILL after twice that, then exits
    /// 1), but it forwards SIGUSR1 to every rank at once.
    fn explain_draining() {
        if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
            return;
        }
        let timeout = std::env::var("OMPI_MCA_odls_base_sigkill_timeout")
            .map_or_else(|_| "1 s by default".into(), |t| format!("{t} s"));
        tracing::info!(
            "to drain this group: SIGUSR1 to mpirun (forwarded to every rank) or SIGTERM to \
             rank 0 (pid {}); SIGTERM to mpirun makes OpenMPI kill the ranks instead (SIGTERM \
             after odls_base_sigkill_timeout, {timeout}, SIGKILL after twice that)",
            std::process::id()
        );
    }

    fn model_name(args: &ServeArgs) -> &str {
        args.model.as_deref().unwrap_or("<built-in>")
    }

    /// The group's settings from the flags, before the model is known.
    struct Settings {
        config: EngineConfig,
        group: GroupConfig,
        fabric: FabricKind,
    }

    impl Settings {
        fn with_bundle(self, bundle: rackfill_models::ModelBundle<ModelWeights>) -> GroupModel {
            GroupModel {
                model: bundle.model,
                tokenizer: Arc::new(bundle.tokenizer),
                eos: bundle.stop_token_ids,
                config: self.config,
                group: self.group,
                fabric: self.fabric,
            }
        }
    }

    /// The group's settings.
    fn group_settings(
        args: &ServeArgs,
        mut config: EngineConfig,
        group: GroupConfig,
        size: usize,
    ) -> Result<Settings> {
        if let Some(ep) = args.ep_size.filter(|&ep| ep != size) {
            bail!(
                "--ep-size {ep} but the MPI world has {size} processes (one per EP rank): leave \
                 --ep-size out or launch {ep} processes"
            );
        }
        config.ep.ep_size = size;
        Ok(Settings {
            config,
            group,
            fabric: args.fabric(),
        })
    }

    /// Every process of a group outlives SIGINT, SIGTERM and SIGUSR1 and turns them into a
    /// drain of the whole group: a worker passes the signal on to the leader with its
    /// heartbeats, the leader's watchdog asks its server to drain, and once the requests in
    /// flight finished the leader stops every process (exit 0). So the group drains whichever
    /// processes were signalled: `srun` signals every task, OpenMPI's `mpirun` forwards SIGUSR1
    /// to every rank (SIGTERM it turns into killing them), a pod's runtime signals its pod's. A
    /// signal before the group serves is kept until it does. The watchdog bounds the wait if
    /// the leader never stops the group.
    fn watch_termination_signals(rank: usize) {
        let spawned = std::thread::Builder::new()
            .name("rackfill-signals".into())
            .spawn(move || {
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                runtime.block_on(async move {
                    use tokio::signal::unix::{signal, SignalKind};
                    let (Ok(mut term), Ok(mut int), Ok(mut usr1)) = (
                        signal(SignalKind::terminate()),
                        signal(SignalKind::interrupt()),
                        signal(SignalKind::user_defined1()),
                    ) else {
                        return;
                    };
                    loop {
                        tokio::select! {
                            _ = term.recv() => {}
                            _ = int.recv() => {}
                            _ = usr1.recv() => {}
                        }
                        group::request_drain();
                        tracing::info!(
                            "rank {rank}: termination signal: the leader (rank 0) drains the \
                             group's requests and stops it"
                        );
                    }
                });
            });
        if let Err(err) = spawned {
            tracing::warn!(%err, "cannot watch termination signals");
        }
    }
}
