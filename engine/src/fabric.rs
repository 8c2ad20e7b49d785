//! Rank-to-rank movement: count exchange (all-gather), token dispatch and combine (all-to-all-v)
//! and one-sided puts of replica weight tiles.
//!
//! The interface takes every rank's contribution at once and returns what every rank holds
//! afterwards: the shape of a single-process, multi-device collective (NCCL group calls issued by
//! one thread for all local GPUs), so an NCCL implementation over cudarc can replace
//! [`LocalFabric`] without changing the engine. [`LocalFabric`] keeps every rank's buffers in
//! host memory and copies real bytes between them: the receive side never aliases the send side.

use std::sync::atomic::{AtomicU64, Ordering};

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;
use rackfill_kernels::{distribute_replicas, ReplicationStats};

use crate::error::{EngineError, Result};

/// One rank-to-rank message of the all-to-all: `rows` of f32 activations and per-row integer
/// metadata (`ids`, a fixed number per row chosen by the caller).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    pub rows: Vec<f32>,
    pub ids: Vec<u32>,
}

impl Message {
    /// Bytes on the wire.
    pub fn bytes(&self) -> u64 {
        ((self.rows.len() + self.ids.len()) * 4) as u64
    }
}

/// What a replica stream reads and writes: the home experts' weights and every rank's slots.
pub struct ReplicaBuffers<'a> {
    /// Home expert `e`'s weights as ordered byte segments; their concatenation is the expert.
    pub source: &'a dyn Fn(u32) -> Vec<&'a [u8]>,
    /// Per rank: its redundant-slot buffer (`n_slot` slots of `slot_bytes`).
    pub slots: Vec<&'a mut [u8]>,
    pub slot_bytes: usize,
    pub expert_bytes: usize,
}

/// Rank-to-rank movement for `ranks()` ranks.
pub trait Fabric: Send + Sync {
    /// Number of ranks.
    fn ranks(&self) -> usize;

    /// Every rank contributes `rows[r]`; every rank receives all of them, rank-major. Returns the
    /// copy each rank holds.
    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>>;

    /// `send[src][dst]` arrives as `recv[dst][src]`.
    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>>;

    /// One-sided puts of replica weights, tile by tile over the relay schedule.
    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        buffers: ReplicaBuffers<'_>,
    ) -> Result<ReplicationStats>;

    /// Bytes this fabric has moved so far (all operations, all ranks).
    fn bytes_moved(&self) -> u64;
}

/// The in-process fabric: all ranks in host memory, real copies between their buffers.
#[derive(Debug)]
pub struct LocalFabric {
    ranks: usize,
    moved: AtomicU64,
}

impl LocalFabric {
    /// A fabric of `ranks` ranks.
    pub fn new(ranks: usize) -> Result<Self> {
        if ranks == 0 {
            return Err(EngineError::Config(
                "a fabric needs at least one rank".into(),
            ));
        }
        Ok(Self {
            ranks,
            moved: AtomicU64::new(0),
        })
    }

    fn check_ranks(&self, what: &str, got: usize) -> Result<()> {
        if got != self.ranks {
            return Err(EngineError::Fabric(format!(
                "{what}: {got} contributions for {} ranks",
                self.ranks
            )));
        }
        Ok(())
    }

    fn count(&self, bytes: u64) {
        self.moved.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl Fabric for LocalFabric {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>> {
        self.check_ranks("all-gather", rows.len())?;
        let gathered: Vec<u64> = rows.iter().flatten().copied().collect();
        let copies: Vec<Vec<u64>> = (0..self.ranks).map(|_| gathered.clone()).collect();
        self.count((gathered.len() * 8 * self.ranks) as u64);
        Ok(copies)
    }

    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>> {
        self.check_ranks("all-to-all", send.len())?;
        for (src, row) in send.iter().enumerate() {
            if row.len() != self.ranks {
                return Err(EngineError::Fabric(format!(
                    "all-to-all: rank {src} addressed {} ranks of {}",
                    row.len(),
                    self.ranks
                )));
            }
        }
        let mut recv: Vec<Vec<Message>> = (0..self.ranks)
            .map(|_| Vec::with_capacity(self.ranks))
            .collect();
        for (src, row) in send.into_iter().enumerate() {
            for (dst, message) in row.into_iter().enumerate() {
                if dst == src {
                    // A rank's message to itself never leaves it.
                    recv[dst].push(message);
                    continue;
                }
                // A copy into the receiver's own buffer, as a wire would make.
                self.count(message.bytes());
                recv[dst].push(Message {
                    rows: message.rows.as_slice().to_vec(),
                    ids: message.ids.as_slice().to_vec(),
                });
            }
        }
        Ok(recv)
    }

    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        mut buffers: ReplicaBuffers<'_>,
    ) -> Result<ReplicationStats> {
        self.check_ranks("replica stream", buffers.slots.len())?;
        let stats = distribute_replicas(
            plan,
            schedule,
            buffers.expert_bytes,
            buffers.source,
            &mut buffers.slots,
            buffers.slot_bytes,
        )?;
        self.count(schedule.send_bytes.iter().sum());
        Ok(stats)
    }

    fn bytes_moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_to_all_transposes_and_copies() {
        let fabric = LocalFabric::new(2).unwrap();
        let msg = |v: f32| Message {
            rows: vec![v],
            ids: vec![v as u32],
        };
        let send = vec![vec![msg(0.0), msg(1.0)], vec![msg(10.0), msg(11.0)]];
        let recv = fabric.all_to_all_v(send).unwrap();
        assert_eq!(recv[0], vec![msg(0.0), msg(10.0)]);
        assert_eq!(recv[1], vec![msg(1.0), msg(11.0)]);
        // Only the two messages between different ranks crossed the fabric.
        assert_eq!(fabric.bytes_moved(), 2 * 8);
        let gathered = fabric.all_gather(&[vec![1, 2], vec![3, 4]]).unwrap();
        assert_eq!(gathered, vec![vec![1, 2, 3, 4], vec![1, 2, 3, 4]]);
    }

    #[test]
    fn wrong_rank_counts_are_errors() {
        let fabric = LocalFabric::new(3).unwrap();
        assert!(fabric.all_gather(&[vec![1]]).is_err());
        assert!(fabric
            .all_to_all_v(vec![vec![Message::default(); 2]; 3])
            .is_err());
        assert!(LocalFabric::new(0).is_err());
    }
}
