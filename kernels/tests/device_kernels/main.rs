//! The kernels of the MoE data plane's control path and token path, run on every executor this
//! machine has (the host emulator everywhere, GPU 0 on a GPU host: [`exec::available`]) through
//! the same [`Executor`] calls, against the CPU references:
//!
//! - `solver`: the quota solver's plan equals the CPU planner's bit for bit, launched directly
//!   with the host's own shared-memory layout (1 to 4 warps, the load staged or not, both target
//!   rules, several floors, explicit homes, 128-bit split arithmetic, the packed-key limit, the
//!   R=64, E=256 layer with packed keys and, on the emulator, forced onto the shuffle tree), and
//!   through [`DeviceQuotaSolver`] with the device's own configuration;
//! - `permute`: the source permute, grouping by instance, return gather and weighted combine
//!   are bitwise equal to [`rackfill_kernels::permute`], bad experts and misrouted rows counted;
//! - `grouped_gemm`: the grouped expert GEMMs (tensor cores: `mma.sync`, `ldmatrix`,
//!   `cp.async`) against a CPU f32 reference over ragged groups, memory outside the group rows
//!   untouched, and the per-group cuBLAS path on the same cases;
//! - `tiles`: the host tile compiler replays the CPU executor; `plan_tiles` builds its stream
//!   entry for entry and refuses failed solves, short capacities and malformed plans;
//!   `tile_stream` fills every slot like the CPU executor (host-compiled streams and right after
//!   `plan_tiles`), counts landed bytes, and gives up on a broken relay or a slot that never
//!   fills.
//!
//! What only the emulator shows is asked of it through [`EmulatorSettings`]: the shuffle-tree
//! pick path and its warp-operation count, grids of concurrent blocks (forked processes) whose
//! fences are held back so that blocks really wait on relay counters (the back-offs are
//! counted), and short stall limits. Its `cp.async` copies land only at their wait, so a tile
//! read too early reads stale shared memory there too. It cannot show the GPU's weaker memory
//! ordering or memory across GPUs; the same tests on a GPU do. Needs a C++20 compiler (`$CXX`,
//! else `c++`) for the emulator; without one and without a GPU it prints why and passes.
//!
//! [`exec::available`]: rackfill_kernels::cuda::exec::available
//! [`Executor`]: rackfill_kernels::cuda::exec::Executor
//! [`EmulatorSettings`]: rackfill_kernels::cuda::exec::EmulatorSettings
//! [`DeviceQuotaSolver`]: rackfill_kernels::cuda::solver::DeviceQuotaSolver

#![cfg(feature = "cuda")]

#[path = "../cuda_common/mod.rs"]
mod cuda_common;
mod grouped_gemm;
mod permute;
mod solver;
mod tiles;
