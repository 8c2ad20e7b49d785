//! The fabric of one process per rank (feature `mpi`): which one this process can run, and
//! opening it over the communicator the group gives it.

use mpi::topology::SimpleCommunicator;

use super::contract::Fabric;
use super::kind::FabricKind;
use super::mpi::MpiFabric;
use crate::error::{EngineError, Result};

/// What `kind` means on this process, whose GPU (if any) is device `device` (its local rank):
/// `auto` is NCCL where the process has a GPU and NCCL loads, else MPI; an explicit `nccl` that
/// cannot run is a one-line error.
pub fn resolve_for_process(kind: FabricKind, device: usize) -> Result<FabricKind> {
    #[cfg(feature = "cuda")]
    let (gpu, probe) = (
        rackfill_kernels::cuda::probe().is_ok_and(|gpu| device < gpu.devices),
        || super::probe_nccl().map(|nccl| format!("{nccl:?}")),
    );
    #[cfg(not(feature = "cuda"))]
    let (gpu, probe) = {
        let _ = device; // no GPU support in this build: no device to look for
        (false, || Err(String::from("no GPU support")))
    };
    kind.resolve(gpu, probe).map_err(EngineError::Config)
}

/// Opens the fabric `kind` (resolved: [`FabricKind::Mpi`] or [`FabricKind::Nccl`]) over `comm`;
/// collective: every process of the group calls it with the same kind.
pub fn open(kind: FabricKind, comm: SimpleCommunicator, device: usize) -> Result<Box<dyn Fabric>> {
    match kind {
        #[cfg(feature = "cuda")]
        FabricKind::Nccl => Ok(Box::new(super::NcclFabric::new(comm, device)?)),
        #[cfg(not(feature = "cuda"))]
        FabricKind::Nccl => {
            let _ = (comm, device);
            Err(EngineError::Config(
                "--fabric nccl needs the GPU support of the default build".into(),
            ))
        }
        FabricKind::Auto | FabricKind::Mpi => Ok(Box::new(MpiFabric::new(comm)?)),
    }
}
