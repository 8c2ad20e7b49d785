//! rackfill-kernels: the data plane that moves expert weights and tokens between rank buffers.
//!
//! It will hold the CPU reference implementations (tile streaming of replica weights over relay
//! schedules, token permute by physical instance, weighted combine) and, behind the `cuda`
//! feature, the CUDA C sources compiled at run time by NVRTC. Nothing is implemented yet: the
//! balancer crate already produces the plans and transfer schedules these kernels will execute.
