//! [`TraceError`]: every way a routing trace can be malformed, each naming its line.

/// Why a trace cannot be read. Every variant but [`TraceError::Open`] names the 1-based line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("cannot open routing trace {path}: {message}")]
    Open { path: String, message: String },
    #[error("line {line}: cannot read: {message}")]
    Io { line: usize, message: String },
    /// No load line at all (an empty file, or blank lines only): reported at line 1, where the
    /// first load line belongs.
    #[error("line 1: routing trace is empty (no load lines)")]
    Empty,
    #[error("line {line}: not a routing-trace line: {message}")]
    Json { line: usize, message: String },
    #[error("line {line}: a load needs at least one rank and one expert, got {ranks} x {experts}")]
    ZeroShape {
        line: usize,
        ranks: usize,
        experts: usize,
    },
    #[error(
        "line {line}: load is {ranks} ranks x {experts} experts, but the first line has \
         {first_ranks} x {first_experts} (the shape must not change within a trace)"
    )]
    ShapeChanged {
        line: usize,
        ranks: usize,
        experts: usize,
        first_ranks: usize,
        first_experts: usize,
    },
    #[error("line {line}: \"load\" has {rows} rows, \"ranks\" is {ranks}")]
    RowCount {
        line: usize,
        rows: usize,
        ranks: usize,
    },
    #[error("line {line}: load row {row} has {len} counts, \"experts\" is {experts}")]
    RowLength {
        line: usize,
        row: usize,
        len: usize,
        experts: usize,
    },
    #[error("line {line}: load counts overflow a 64-bit total")]
    TooLarge { line: usize },
    #[error(
        "line {line}: step {step} after step {previous}: steps out of order (step numbers must \
         increase and a step's lines must be contiguous)"
    )]
    StepOrder {
        line: usize,
        step: u64,
        previous: u64,
    },
    #[error(
        "line {line}: step {step} lists layer {layer} after layer {previous} (layers must appear \
         once each, in increasing order)"
    )]
    LayerOrder {
        line: usize,
        step: u64,
        layer: usize,
        previous: usize,
    },
    #[error(
        "line {line}: step {step} has layer {layer} where layer {expected} was expected (every \
         step must hold the layers of step {first_step}; missing layer {expected})"
    )]
    MissingLayer {
        line: usize,
        step: u64,
        layer: usize,
        expected: usize,
        first_step: u64,
    },
    #[error(
        "line {line}: step {step} has layer {layer}, which step {first_step} does not have \
         (every step must hold the same layers)"
    )]
    ExtraLayer {
        line: usize,
        step: u64,
        layer: usize,
        first_step: u64,
    },
    #[error(
        "line {line}: step {step} ends without layer {missing} (every step must hold the layers \
         of step {first_step})"
    )]
    IncompleteStep {
        line: usize,
        step: u64,
        missing: usize,
        first_step: u64,
    },
}

impl TraceError {
    /// The 1-based line the problem was found on (`None` when the file could not be opened).
    pub fn line(&self) -> Option<usize> {
        use TraceError as T;
        match *self {
            T::Open { .. } => None,
            T::Empty => Some(1),
            T::Io { line, .. }
            | T::Json { line, .. }
            | T::ZeroShape { line, .. }
            | T::ShapeChanged { line, .. }
            | T::RowCount { line, .. }
            | T::RowLength { line, .. }
            | T::TooLarge { line }
            | T::StepOrder { line, .. }
            | T::LayerOrder { line, .. }
            | T::MissingLayer { line, .. }
            | T::ExtraLayer { line, .. }
            | T::IncompleteStep { line, .. } => Some(line),
        }
    }
}
