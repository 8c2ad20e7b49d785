//! The replica stream's schedule check, shared by every fabric: a schedule is checked against
//! the plan and the local buffers before any chunk moves.

use std::collections::HashSet;
use std::ops::Range;

use rackfill_balancer::relay::{Transfer, TransferSchedule};
use rackfill_balancer::Plan;

use super::contract::ReplicaBuffers;

/// Where one transfer reads and writes in slot buffers.
pub(crate) struct Place {
    /// Byte position in the sender's slot buffer (stage 2: a relay forwards its copy), or `None`
    /// when the sender reads its home weights.
    pub(crate) from_slot: Option<usize>,
    /// Byte position in the receiver's slot buffer.
    pub(crate) to_slot: usize,
}

/// Checks the schedule against the plan and the local buffers before any chunk moves (every
/// handle reaches the same verdict on the shared parts) and resolves every transfer's slot
/// positions.
pub(crate) fn check_schedule(
    plan: &Plan,
    schedule: &TransferSchedule,
    buffers: &ReplicaBuffers<'_>,
    local: &Range<usize>,
    world: usize,
) -> std::result::Result<Vec<Place>, String> {
    let n_slot = plan.slots_per_rank();
    if buffers.slot_bytes < buffers.expert_bytes {
        return Err(format!(
            "replica stream: slots of {} bytes cannot hold experts of {}",
            buffers.slot_bytes, buffers.expert_bytes
        ));
    }
    for (rank, slots) in local.clone().zip(&buffers.slots) {
        if slots.len() < n_slot * buffers.slot_bytes {
            return Err(format!(
                "replica stream: rank {rank}'s slot buffer has {} bytes, its slots need {}",
                slots.len(),
                n_slot * buffers.slot_bytes
            ));
        }
    }
    let slot_at = |rank: u32, expert: u32| -> Option<usize> {
        plan.rank_slots(rank as usize)
            .iter()
            .position(|&s| s == Some(expert))
            .map(|slot| slot * buffers.slot_bytes)
    };
    let mut delivered: HashSet<(u32, u32, u64, u64)> = HashSet::new();
    let mut places = Vec::with_capacity(schedule.transfers.len());
    for (index, t) in schedule.transfers.iter().enumerate() {
        let bad = |why: String| format!("replica stream: transfer {index}: {why}");
        let Transfer {
            expert,
            offset,
            len,
            src,
            dst,
            stage,
            ..
        } = *t;
        if src as usize >= world || dst as usize >= world || src == dst {
            return Err(bad(format!("ranks {src} -> {dst} of {world}")));
        }
        if expert as usize >= plan.experts() {
            return Err(bad(format!("expert {expert} is out of range")));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > buffers.expert_bytes as u64)
        {
            return Err(bad(format!(
                "bytes {offset}..+{len} lie outside the expert's {}",
                buffers.expert_bytes
            )));
        }
        let to_slot = slot_at(dst, expert)
            .ok_or_else(|| bad(format!("rank {dst} has no slot holding expert {expert}")))?;
        let from_slot = match stage {
            1 if plan.instances(expert as usize)[0].rank == src => None,
            1 => return Err(bad(format!("rank {src} is not expert {expert}'s home"))),
            2 if delivered.contains(&(src, expert, offset, len)) => {
                slot_at(src, expert).map(|at| at + offset as usize)
            }
            2 => {
                return Err(bad(format!(
                    "rank {src} forwards bytes it has not received"
                )))
            }
            other => return Err(bad(format!("stage {other} is neither 1 nor 2"))),
        };
        if !delivered.insert((dst, expert, offset, len)) {
            return Err(bad(format!("rank {dst} receives these bytes twice")));
        }
        places.push(Place {
            from_slot,
            to_slot: to_slot + offset as usize,
        });
    }
    Ok(places)
}
