//! One MoE layer's EP data plane in bf16 on an [`Executor`](super::exec::Executor), for ranks
//! sharing one device: what the whole-model GPU path (`--device cuda` at EP > 1) runs between
//! the router and the residual, with no host copy of the rows, the router's choices or its
//! weights. It runs unchanged on the host emulator, which is how it is checked without a GPU.
//!
//! - `plane`: [`DeviceMoe`], the layer's steps in order;
//! - `steps`: each step's kernel launches, copies and GEMMs;
//! - `routes`: where every pair goes, worked out on the host from the plan and the counts.

mod plane;
mod routes;
mod steps;

pub use plane::{Counted, DeviceLayerRun, DeviceMoe, ExpertWeights, RoutedRows};
