//! What a data plane is given and gives back for one MoE layer: the types every plane and the EP
//! runtime share (their own file, so that neither the planes nor the runtime depend on each
//! other for them).

use std::time::Duration;

use candle_core::Tensor;
use rackfill_balancer::relay::RelayConfig;
use rackfill_balancer::{Algo, Plan};
use rackfill_models::layers::moe::MoeBlock;
use rackfill_models::Routing;

use crate::rack_cost::SlotMemory;

/// Wall time of each phase of one MoE layer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    pub route: Duration,
    pub solve: Duration,
    pub replicate: Duration,
    pub dispatch: Duration,
    pub experts: Duration,
    pub combine: Duration,
}

/// How a data plane moves and checks what it is given, beside the layout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PlaneConfig {
    /// Relay trees replicas are streamed over.
    pub relay: RelayConfig,
    pub balancer: Algo,
    /// A device plane solves the quota balancers' plans on its device.
    pub plan_on_device: bool,
    /// The balancer's smallest replica quota (a device solver needs it too).
    pub u_min: u64,
    /// Check what the plane built on a device against the host reference (slow; tests).
    pub verify: bool,
    /// Micro-batches of a step in flight together: each holds its own redundant slots.
    pub micro_batches: usize,
    /// One set of redundant slots for every MoE layer, or one each (resident replicas reused).
    pub slot_memory: SlotMemory,
    /// Dispatch and main-expert GEMMs do not wait for the replicas (one micro-batch a step).
    pub pipelined_experts: bool,
}

/// One MoE layer's work for the local ranks, after the plan is known.
pub(crate) struct LayerWork<'a> {
    /// Model layer index.
    pub layer: usize,
    pub block: &'a MoeBlock,
    pub plan: &'a Plan,
    /// Per local rank: the FFN input rows (`tokens x hidden`) and their routing.
    pub routed: &'a [(Vec<f32>, Routing)],
    pub hidden: usize,
    pub top_k: usize,
}

/// What a data plane returns for one layer.
pub(crate) struct PlaneOutput {
    /// Per local rank: the routed experts' combined output (`None` without tokens), before
    /// shared experts.
    pub routed: Vec<Option<Tensor>>,
    /// Per local rank: bytes received from other ranks (dispatched rows, combined outputs,
    /// replica weights).
    pub recv_bytes: Vec<u64>,
    /// Replica weight bytes the local ranks received.
    pub replica_bytes: u64,
    /// The plane's phases (replicate, dispatch, experts, combine); route and solve are zero.
    pub phases: PhaseTimes,
}

/// Per rank: the token bytes and the replica bytes it received, together (the GPU planes'
/// accounting).
#[cfg(feature = "cuda")]
pub(crate) fn received_bytes(tokens: &[u64], replicas: &[u64]) -> Vec<u64> {
    tokens.iter().zip(replicas).map(|(t, r)| t + r).collect()
}
