//! What crosses to ranks held by other processes when there is no peer memory between their
//! devices: rows, outputs and replica weights go through host buffers and the process group's
//! own transport (the engine's fabric: MPI, or NCCL), behind [`HostExchange`]. Everything
//! between ranks of this process stays on the device.

use std::collections::BTreeMap;

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;

/// Moves bytes between this process's ranks and the other processes' (the engine implements it
/// over its fabric). Every process of the group calls every method in the same order, with
/// empty contributions when it has nothing to send, as collectives require.
pub trait HostExchange {
    /// `send[i][dst]`: local rank `i`'s bytes for world rank `dst`. Returns `recv[i][src]`: what
    /// local rank `i` received from world rank `src`, in source order.
    fn all_to_all(&self, send: Vec<Vec<Vec<u8>>>) -> Result<Vec<Vec<Vec<u8>>>, String>;

    /// Streams `plan`'s replicas by `schedule` between host images: `homes[e]` is the bytes of
    /// every replicated expert homed on a local rank, `slots[i]` local rank `i`'s slot set
    /// (`n_slot` slots of `expert_bytes`). Returns the bytes each local rank received.
    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        homes: &BTreeMap<u32, Vec<u8>>,
        slots: Vec<&mut [u8]>,
        expert_bytes: usize,
    ) -> Result<Vec<u64>, String>;
}
