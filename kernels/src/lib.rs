//! rackfill-kernels: the CPU data plane that moves expert weights and tokens between rank buffers.
//!
//! The balancer crate decides *what* moves (a [`Plan`](rackfill_balancer::Plan), its
//! [`TokenAssignment`](rackfill_balancer::TokenAssignment) and relay
//! [`TransferSchedule`](rackfill_balancer::relay::TransferSchedule)); this crate moves the bytes:
//!
//! - [`replicate`]: replica weight distribution (UltraEP §6). Every chunk copy of a schedule runs
//!   on a worker per sending rank; relays forward chunk `c` as soon as it has landed, guarded by
//!   per-chunk ready flags, while later chunks are still arriving. A sequential reference executes
//!   the same validated copies in schedule order.
//! - [`permute`]: the token side of one MoE layer: permute a source rank's token-expert pairs by
//!   physical instance (the all-to-all send buffers), group what a rank receives into one block per
//!   expert instance (one GEMM each), route the outputs back, scatter them by pair and combine with
//!   the router weights in top-k order, so the result is bitwise identical to the dense path.
//!
//! - [`weights`]: where an expert instance's weights live on the rank that computes it (home or
//!   redundant slot), for the CPU and the GPU plane alike.
//!
//! - [`flash`]: the flash attention kernels' launch geometry (head shapes, tile shapes, grids);
//! - [`kv_blocks`]: the host side of the GPU's paged KV cache: a pool of fixed-size blocks, each
//!   sequence's block table, and the per-step slot and block-table arrays the attention kernels
//!   read.
//!
//! - `cuda` (feature `cuda`): the same data plane on the GPU, CUDA C compiled at run time by NVRTC,
//!   plus the quota solver on the device and grouped expert GEMMs with cuBLAS.
//!
//! Every entry point validates its input up front and reports problems as [`KernelError`]: a bad
//! schedule or a malformed buffer is an error, never a panic or undefined behaviour.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod flash;
pub mod kv_blocks;
pub mod permute;
pub mod replicate;
pub mod weights;

pub use permute::{
    combine, group_by_instance, permute_tokens, remote_recv_bytes, scatter_pairs, DispatchBuffers,
    ExpertBatches, InstanceGroup, InstanceRouter, IDS_PER_ROW,
};
pub use replicate::{
    check_schedule, distribute_replicas, distribute_replicas_sequential, ReplicationStats,
    SlotBuffers, TransferFault, TransferPlace,
};
pub use weights::{weight_source, WeightSource};

/// Why a kernel refused its input (or, for the concurrent copy, could not start its workers).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{what} has length {len}, expected {expected}")]
    Length {
        what: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("{what} has length {len}, which is not a multiple of {of}")]
    NotMultiple {
        what: &'static str,
        len: usize,
        of: usize,
    },
    #[error("{what} must be positive")]
    ZeroDimension { what: &'static str },
    #[error("{what} {value} is out of range (must be below {limit})")]
    OutOfRange {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("{what} overflows the address space")]
    Overflow { what: &'static str },
    #[error("pair {pair}: expert {expert} is out of range, the plan has {experts} experts")]
    ExpertOutOfRange {
        pair: usize,
        expert: u32,
        experts: usize,
    },
    #[error(
        "row {row} from sender {sender}: expert {expert} instance {instance} is computed on rank \
         {owner}, not on rank {rank}"
    )]
    Misrouted {
        sender: usize,
        row: usize,
        expert: u32,
        instance: u32,
        owner: u32,
        rank: usize,
    },
    #[error("got {got} rank slot buffers, the plan has {ranks} ranks")]
    RankCount { got: usize, ranks: usize },
    #[error("slot buffers of ranks {first}..+{count}, the plan has {ranks} ranks")]
    RankRange {
        first: usize,
        count: usize,
        ranks: usize,
    },
    #[error("slot_bytes {slot_bytes} is smaller than expert_bytes {expert_bytes}")]
    SlotTooSmall {
        slot_bytes: usize,
        expert_bytes: usize,
    },
    #[error("rank {rank}'s slot buffer has {len} bytes, its slots need {needed}")]
    SlotBufferTooShort {
        rank: usize,
        len: usize,
        needed: usize,
    },
    #[error("expert {expert}: source segments hold {len} bytes, expert_bytes is {expected}")]
    SourceSize {
        expert: u32,
        len: usize,
        expected: usize,
    },
    #[error("transfer {index}: {fault}")]
    Transfer { index: usize, fault: TransferFault },
    #[error("rank {rank}: replica of expert {expert} receives {covered} of its {expected} bytes")]
    IncompleteReplica {
        rank: usize,
        expert: u32,
        covered: u64,
        expected: u64,
    },
    #[error("could not start a copy worker: {0}")]
    Spawn(String),
}
