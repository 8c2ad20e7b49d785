//! Rank-to-rank movement: count exchange (all-gather), token dispatch and combine (all-to-all-v)
//! and one-sided puts of replica weight chunks, for a process that holds one or several ranks of
//! the EP group.
//!
//! # Contract
//!
//! A [`Fabric`] is one process's handle on a group of [`Fabric::world_size`] ranks; the process
//! holds the contiguous ranks [`Fabric::local_ranks`] (all of them for [`LocalFabric::new`], one
//! for a process per GPU). Every collective takes only the local ranks' contributions, local rank
//! `i` being world rank `local_ranks().start + i`, and returns what those ranks hold afterwards.
//!
//! - **Every process calls every collective, in the same order**, once per collective the runtime
//!   issues, even when its ranks have no tokens (they contribute zero counts, empty messages, no
//!   slot writes): a collective completes only when every process of the group has joined it.
//! - **Deterministic**: the results depend only on the contributions, never on timing. The
//!   all-gather returns rows in rank order; the all-to-all-v returns messages in source-rank
//!   order; replica chunks land in schedule order, so every process sees the same bytes.
//! - **No aliasing**: what a rank receives from another rank is a copy in a buffer it owns.
//! - A call that fails (contributions of the wrong shape, a bad schedule) fails on every process
//!   of the group, and a group of several processes is unusable afterwards (as after an MPI
//!   error); a process holding every rank just fails that call.
//!
//! The EP runtime iterates over its fabric's local ranks and nothing else, so a fabric of one
//! process per GPU (MPI or NCCL) plugs in without changing it. [`LocalFabric`] is the in-process
//! implementation: by default one process holding every rank; [`LocalFabric::group`] splits the
//! ranks over several handles, each used from its own thread as a separate process would, over
//! the same shared state, which is how the contract above is tested. `MpiFabric` (feature `mpi`)
//! is the fabric of one process per rank over MPI point-to-point and collective operations.

mod contract;
mod kind;
mod local;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(all(feature = "cuda", feature = "mpi"))]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_probe;
#[cfg(feature = "mpi")]
mod open;

#[cfg(feature = "mpi")]
pub use self::mpi::MpiFabric;
pub use contract::{Fabric, Message, ReplicaBuffers};
pub use kind::{FabricKind, UnknownFabric};
pub use local::LocalFabric;
#[cfg(all(feature = "cuda", feature = "mpi"))]
pub use nccl::NcclFabric;
#[cfg(feature = "cuda")]
pub use nccl_probe::{probe_nccl, NcclInfo};
#[cfg(feature = "mpi")]
pub use open::{open, resolve_for_process};
