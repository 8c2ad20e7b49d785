//! Why a simulation could not run (its own file: every part of the simulator reports with it).

/// Why a simulation could not run: always one line, naming the input at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// A bad argument or input file.
    #[error("{0}")]
    Input(String),
    /// A planner failed or produced a plan that breaks an invariant (a planner bug).
    #[error("balancer {balancer} at step {step}, layer {layer}: {message}")]
    Plan {
        balancer: String,
        step: usize,
        layer: usize,
        message: String,
    },
}
