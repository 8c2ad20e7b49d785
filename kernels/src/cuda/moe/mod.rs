//! The MoE data plane on a device ([`Executor`](super::exec::Executor): a GPU, or the host
//! emulator that runs the same kernels in CI), in bf16 with f32 accumulation: what every MoE
//! layer of `--device cuda` runs between the router and the residual, for the ranks this process
//! holds. Per layer (UltraEP §4-§6, docs/gpu.md):
//!
//! 1. the load counted where the router left its choices (the `ranks x E` counts are the one
//!    host copy before the plan);
//! 2. the plan: solved on the device by the quota solver ([`super::solver`]), or by a host
//!    balancer and uploaded;
//! 3. replicas: relay trees and tile tasks built on the device from the plan where it is
//!    ([`super::tile_plan`]) and streamed by the persistent tile kernel ([`super::replicate`])
//!    with per-chunk ready flags; with per-layer slots only replicas not already resident stream;
//! 4. dispatch: instance lookup by cumulative quota, rows scattered into each source's send
//!    layout, segments copied into each destination's receive buffer;
//! 5. experts: rows grouped by instance, every instance's gate-up GEMM with `silu(gate) * up`
//!    fused, then its down GEMM, all instances in one grouped launch of each
//!    ([`super::grouped_gemm`]; main experts from the home weights, replicas from their slot);
//!    with pipelined experts the instances whose weights are in place run while replicas still
//!    stream, and each streaming replica waits only for its own slot's landed bytes, then runs
//!    in a launch of its own;
//! 6. combine: outputs back into each source's send layout, their router-weighted sum in top-k
//!    order added into the block's output.
//!
//! Two micro-batches run on two [`MoeLane`]s (own streams, slots, counters, planner and solver
//! over the same home experts), so one's experts run while the other's replicas and rows move.
//! Ranks of other processes are reached through peer memory (every rank's receive buffers,
//! slots and flags mapped into every process, `peers`), or through host buffers and the group's
//! transport ([`HostExchange`]) where a process cannot map its peers.
//!
//! - `plane`: [`DeviceMoe`], its [`MoeLane`]s, and where an instance's weights are;
//! - `experts`: the home experts in device memory ([`HomeExperts`]);
//! - `layer`: the stages of one layer on a lane;
//! - `replicas`: the replica distribution;
//! - `routes`: where every pair goes, worked out on the host from the plan and the counts;
//! - `steps`: each step's kernel launches, copies and GEMMs;
//! - `exchange`: how rows and outputs reach other ranks (device copies, peer memory, the host);
//! - `peers`: every rank's receive side in peer memory, and the ready flags between them;
//! - `remote`: [`HostExchange`].

mod exchange;
mod experts;
mod layer;
mod peers;
mod plane;
mod remote;
mod replicas;
mod routes;
mod steps;

pub use experts::{expert_bytes, ExpertWeights, HomeExperts};
pub use layer::{Counted, LayerInFlight, LayerPhases, LayerRun, LayerTiming, RoutedRows};
pub use peers::{peer_wait_limit, PEER_WAIT_ENV};
pub use plane::{DeviceMoe, MoeConfig, MoeLane};
pub use remote::HostExchange;
