//! The MPI world a process was launched into: initialised only when an MPI launcher started the
//! process (`mpirun`, `srun --mpi=pmix`), with `MPI_THREAD_MULTIPLE` (the engine thread, the
//! heartbeat thread and the fabric each use their own communicator).

use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use crate::error::{EngineError, Result};

/// Environment variables by which MPI launchers mark their processes: OpenMPI's `mpirun`, PMIx
/// launchers (`srun --mpi=pmix`, `prterun`), and PMI-1/2 ones (MPICH's hydra, `srun --mpi=pmi2`).
const LAUNCHER_VARIABLES: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"];

/// This process's place in its MPI world. MPI is finalised when it is dropped, so it must
/// outlive every communicator taken from it.
pub struct MpiWorld {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    local_rank: usize,
    /// Last: dropping it finalises MPI.
    _universe: Universe,
}

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (checked in `from_launcher`), so MPI calls
// may come from any thread; every communicator handed out is a duplicate used by one owner.
unsafe impl Send for MpiWorld {}
unsafe impl Sync for MpiWorld {}

impl MpiWorld {
    /// Whether an MPI launcher started this process (see [`LAUNCHER_VARIABLES`]).
    pub fn launched() -> bool {
        LAUNCHER_VARIABLES
            .iter()
            .any(|name| std::env::var_os(name).is_some())
    }

    /// Initialises MPI when an MPI launcher started this process; `None` otherwise (no MPI call
    /// is made, so a binary with MPI support runs anywhere as one process).
    pub fn from_launcher() -> Result<Option<Self>> {
        if !Self::launched() {
            return Ok(None);
        }
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| EngineError::Config("MPI was already initialised".into()))?;
        if threading != Threading::Multiple {
            return Err(EngineError::Config(format!(
                "the MPI library gives thread level {threading:?}; rackfill needs \
                 MPI_THREAD_MULTIPLE (OpenMPI built with thread support)"
            )));
        }
        let world = universe.world();
        let rank = usize::try_from(world.rank()).unwrap_or_default();
        let size = usize::try_from(world.size()).unwrap_or(1);
        // Ranks on this host, by world rank: the local rank picks the host's GPU.
        let host = world.split_shared(world.rank());
        let local_rank = usize::try_from(host.rank()).unwrap_or_default();
        Ok(Some(Self {
            world,
            rank,
            size,
            local_rank,
            _universe: universe,
        }))
    }

    /// This process's world rank (its EP rank).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the world (the EP size).
    pub fn size(&self) -> usize {
        self.size
    }

    /// This process's rank among the world's processes on its host (picks its GPU).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// A new communicator over the whole world, for one user (a fabric, the control plane, the
    /// heartbeats), so their messages never match each other's.
    pub fn communicator(&self) -> SimpleCommunicator {
        self.world.duplicate()
    }
}
