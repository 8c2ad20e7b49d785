//! One micro-batch's share of the data plane, for steps with two micro-batches in flight
//! (`ep/overlap.rs`): a layer goes through [`MicroPlane::send`] (replicas and dispatch),
//! [`MicroPlane::compute`] (expert compute) and [`MicroPlane::combine`], so that one micro-batch
//! computes while the other communicates.
//!
//! On the CPU plane each micro-batch has its own slots and the fabric moves the bytes; on the
//! GPU plane each has its own lane (streams, slots, tile planner, cuBLAS handle over the same
//! home weights), and the stages only queue device work, ordered by events on the lane's streams.

#[cfg(feature = "cuda")]
use rackfill_kernels::cuda::moe::LayerInFlight;

use super::cpu;
#[cfg(feature = "cuda")]
use super::gpu;
use super::work::{LayerWork, PlaneOutput};
use crate::error::Result;
use crate::fabric::Fabric;

/// One micro-batch's share of the plane.
pub(crate) struct MicroPlane<'p> {
    backend: MicroBackend<'p>,
}

enum MicroBackend<'p> {
    Cpu(cpu::MicroPlane<'p>),
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuLane<'p>),
}

/// A layer whose replicas are streaming or streamed and whose rows are dispatched.
pub(crate) struct Sent(InFlight<cpu::Sent>);

/// A layer whose experts ran (or, on a GPU, are queued), before its combine.
pub(crate) struct Computed(InFlight<cpu::Computed>);

/// A layer between stages: the CPU plane's state of that stage, or the GPU lane's.
enum InFlight<C> {
    Cpu(C),
    #[cfg(feature = "cuda")]
    Gpu(Box<LayerInFlight>),
}

impl<'p> MicroPlane<'p> {
    pub(super) fn cpu(plane: cpu::MicroPlane<'p>) -> Self {
        Self {
            backend: MicroBackend::Cpu(plane),
        }
    }

    #[cfg(feature = "cuda")]
    pub(super) fn gpu(lane: gpu::GpuLane<'p>) -> Self {
        Self {
            backend: MicroBackend::Gpu(lane),
        }
    }

    /// Every rank's slots as model layer `layer`'s last stream left them in this micro-batch's
    /// per-layer set; `None` with shared slots (and on a GPU, which has only those).
    pub(crate) fn resident(&self, layer: usize) -> Option<&[Option<u32>]> {
        match &self.backend {
            MicroBackend::Cpu(cpu) => cpu.resident(layer),
            #[cfg(feature = "cuda")]
            MicroBackend::Gpu(_) => None,
        }
    }

    /// Streams the layer's replicas into this micro-batch's slots and dispatches its tokens.
    pub(crate) fn send(&mut self, fabric: &dyn Fabric, work: &LayerWork<'_>) -> Result<Sent> {
        Ok(Sent(match &mut self.backend {
            MicroBackend::Cpu(cpu) => InFlight::Cpu(cpu.send(fabric, work)?),
            #[cfg(feature = "cuda")]
            MicroBackend::Gpu(lane) => InFlight::Gpu(Box::new(lane.send(work)?)),
        }))
    }

    /// Expert compute on every local rank; nothing crosses the fabric.
    pub(crate) fn compute(&self, work: &LayerWork<'_>, sent: Sent) -> Result<Computed> {
        Ok(Computed(match (&self.backend, sent.0) {
            (MicroBackend::Cpu(cpu), InFlight::Cpu(sent)) => {
                InFlight::Cpu(cpu.compute(work, sent)?)
            }
            #[cfg(feature = "cuda")]
            (MicroBackend::Gpu(lane), InFlight::Gpu(mut flight)) => {
                lane.compute(work, &mut flight)?;
                InFlight::Gpu(flight)
            }
            #[cfg(feature = "cuda")]
            _ => return Err(other_plane()),
        }))
    }

    /// Returns every output to its source and sums each token's outputs in top-k order.
    pub(crate) fn combine(
        &self,
        fabric: &dyn Fabric,
        work: &LayerWork<'_>,
        computed: Computed,
    ) -> Result<PlaneOutput> {
        match (&self.backend, computed.0) {
            (MicroBackend::Cpu(cpu), InFlight::Cpu(computed)) => {
                cpu.combine(fabric, work, computed)
            }
            #[cfg(feature = "cuda")]
            (MicroBackend::Gpu(lane), InFlight::Gpu(flight)) => lane.combine(work, *flight),
            #[cfg(feature = "cuda")]
            _ => Err(other_plane()),
        }
    }
}

/// A stage handed a layer another backend started (a bug in the caller, not a user's error).
#[cfg(feature = "cuda")]
fn other_plane() -> crate::error::EngineError {
    crate::error::EngineError::Config("a layer went on on another data plane than it began".into())
}
