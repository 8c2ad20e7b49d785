//! Replica weight distribution (UltraEP §6): executes a relay [`TransferSchedule`] on real byte
//! buffers.
//!
//! Every rank owns one redundant-slot buffer of `n_slot` slots, `slot_bytes` each (slot `s` starts
//! at `s * slot_bytes`), shared by all layers (§4.1). A transfer copies bytes `offset..offset + len`
//! of one expert into the slot that holds that expert on its destination rank; stage 1 reads the
//! home rank's weights, stage 2 reads the relay's slot, which must already hold that chunk.
//!
//! [`distribute_replicas`] runs one worker thread per sending rank, each walking its transfers in
//! schedule order. A stage-1 copy that some relay forwards sets a per-(rank, expert, chunk) ready
//! flag with `Release` once its bytes have landed; the stage-2 copy spins on that flag with
//! `Acquire` before it reads. So a relay forwards chunk `c` while chunk `c + 1` is still arriving,
//! with no global barrier between the stages. [`distribute_replicas_sequential`] executes the same
//! copies one by one in schedule order: the reference the concurrent path is tested against.
//!
//! The whole schedule is validated before a single byte moves ([`check_schedule`], the rules
//! every executor of a replica stream shares, the engine's fabrics included; see
//! [`TransferFault`]), so a bad schedule leaves the buffers untouched and returns an error. Validation also establishes what the
//! concurrent path's `unsafe` relies on: every destination byte is written by exactly one copy, and
//! every stage-2 copy reads exactly the bytes one earlier copy delivered to its source rank (a
//! stage-1 copy in the schedules the balancer builds; a relay of a relay would be accepted too).

mod copies;
mod exec;
mod outcome;
mod schedule_check;

pub use outcome::{ReplicationStats, TransferFault};
pub use schedule_check::{check_schedule, SlotBuffers, TransferPlace};

#[cfg(feature = "cuda")]
pub(crate) use schedule_check::{check_slot_coverage, SlotWrite};

use crate::KernelError;
use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;

/// Copies every replica's weights into its slot, one concurrent worker per sending rank.
///
/// `source(e)` gives home expert `e`'s weights as ordered byte segments whose concatenation is the
/// expert (e.g. `[gate_up, down]`), `expert_bytes` in total; it is called once per expert with
/// stage-1 copies, on the calling thread, before any copy starts. `slots[r]` is rank `r`'s slot
/// buffer, at least `n_slot * slot_bytes` long with `slot_bytes >= expert_bytes`; only the bytes
/// the schedule names are written. The schedule is validated in full first: on a validation error
/// no byte has moved (only [`KernelError::Spawn`], a worker that could not start, leaves the slots
/// partly written).
///
/// Never deadlocks: validation requires every stage-2 copy to follow, in schedule order, the
/// copy it waits for, and each worker walks its copies in schedule order, so the earliest
/// unfinished copy never waits (its producer, earlier still, is done), whatever the threads'
/// relative progress.
pub fn distribute_replicas<'w>(
    plan: &Plan,
    schedule: &TransferSchedule,
    expert_bytes: usize,
    source: &dyn Fn(u32) -> Vec<&'w [u8]>,
    slots: &mut [&mut [u8]],
    slot_bytes: usize,
) -> Result<ReplicationStats, KernelError> {
    let lens: Vec<usize> = slots.iter().map(|s| s.len()).collect();
    let copies = copies::prepare(plan, schedule, expert_bytes, source, &lens, slot_bytes)?;
    exec::run_concurrent(&copies, slots)?;
    Ok(copies.stats)
}

/// The sequential reference of [`distribute_replicas`]: same contract, same validation, the copies
/// run one after another in schedule order on the calling thread with safe slice copies.
pub fn distribute_replicas_sequential<'w>(
    plan: &Plan,
    schedule: &TransferSchedule,
    expert_bytes: usize,
    source: &dyn Fn(u32) -> Vec<&'w [u8]>,
    slots: &mut [&mut [u8]],
    slot_bytes: usize,
) -> Result<ReplicationStats, KernelError> {
    let lens: Vec<usize> = slots.iter().map(|s| s.len()).collect();
    let copies = copies::prepare(plan, schedule, expert_bytes, source, &lens, slot_bytes)?;
    exec::run_sequential(&copies, slots);
    Ok(copies.stats)
}
