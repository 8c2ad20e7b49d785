//! The group's fabric as the watchdog sees it: every collective marks the engine thread as
//! waiting on the other ranks ([`Progress::waiting_on_group`]), so a rank stuck in its own work
//! is told apart from the ranks blocked waiting for it.

use std::ops::Range;
use std::sync::Arc;

use rackfill_balancer::relay::TransferSchedule;
use rackfill_balancer::Plan;

use super::progress::Progress;
use crate::error::Result;
use crate::fabric::{Fabric, Message, ReplicaBuffers};

/// A fabric whose collectives mark the engine thread as waiting.
pub struct Watched {
    inner: Box<dyn Fabric>,
    progress: Arc<Progress>,
}

impl Watched {
    pub fn new(inner: Box<dyn Fabric>, progress: Arc<Progress>) -> Self {
        Self { inner, progress }
    }
}

impl Fabric for Watched {
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn local_ranks(&self) -> Range<usize> {
        self.inner.local_ranks()
    }

    fn all_gather(&self, rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>> {
        let _waiting = self.progress.waiting_on_group();
        self.inner.all_gather(rows)
    }

    fn all_to_all_v(&self, send: Vec<Vec<Message>>) -> Result<Vec<Vec<Message>>> {
        let _waiting = self.progress.waiting_on_group();
        self.inner.all_to_all_v(send)
    }

    fn stream_replicas(
        &self,
        plan: &Plan,
        schedule: &TransferSchedule,
        buffers: ReplicaBuffers<'_>,
    ) -> Result<Vec<u64>> {
        let _waiting = self.progress.waiting_on_group();
        self.inner.stream_replicas(plan, schedule, buffers)
    }

    fn bytes_moved(&self) -> u64 {
        self.inner.bytes_moved()
    }

    fn spans_processes(&self) -> bool {
        self.inner.spans_processes()
    }
}
