//! The MoE data plane: replica streaming, dispatch, expert compute and combine of one layer once
//! its plan is known, where the model runs: on the host ([`cpu`]: host memory, the fabric moves
//! the bytes, the model's own expert MLP), or on the device (`device`, feature `cuda`: the
//! kernels crate's data plane, lanes of streams per micro-batch).

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod device;
mod slots;
mod work;

#[cfg(feature = "cuda")]
pub(crate) use work::received_bytes;
pub use work::PhaseTimes;
pub(crate) use work::{LayerWork, PlaneConfig, PlaneOutput};
