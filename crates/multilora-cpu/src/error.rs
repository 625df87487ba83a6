//! The CPU kernel library's error type: quantized weights whose bytes or shape do not fit their
//! type, attention operands that do not fit, and kernels asked for an instruction set this CPU
//! lacks.

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything the kernels refuse; messages are lowercase and name the weight and both shapes.
/// [`Error::kind`] gives a stable label for metrics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A quantized weight's bytes do not make up `[n, k]` of its type.
    #[error("{qtype} weight [{n}, {k}]: {got} bytes, expected {expected}")]
    QuantBytes {
        /// The GGML type (`Q4_1`, `Q4_K`, …).
        qtype: &'static str,
        /// Output features (rows).
        n: usize,
        /// Input features.
        k: usize,
        /// Bytes given.
        got: usize,
        /// Bytes `[n, k]` of the type take.
        expected: usize,
    },
    /// A quantized weight's shape does not fit its type (`k` not a multiple of the block, …).
    #[error("{qtype} weight [{n}, {k}]: {reason}")]
    QuantShape {
        /// The GGML type.
        qtype: &'static str,
        /// Output features (rows).
        n: usize,
        /// Input features.
        k: usize,
        /// What is wrong.
        reason: String,
    },
    /// A row asked of a quantized weight (an embedding id) is out of range.
    #[error("quantized weight rows: index {index} at position {position} is out of range for {rows} rows")]
    QuantRowOutOfRange {
        /// The index asked for.
        index: usize,
        /// Its position in the list.
        position: usize,
        /// Rows the weight has.
        rows: usize,
    },
    /// Quantized weights that cannot be stacked.
    #[error("stacking quantized weights: {reason}")]
    QuantStack {
        /// What is wrong.
        reason: String,
    },
    /// Attention operands that do not fit together (shapes, context, cache rows).
    #[error("attention: {reason}")]
    Attention {
        /// What is wrong.
        reason: String,
    },
    /// A kernel was asked for an instruction set this CPU lacks.
    #[error("{op}: this cpu cannot run {isa}")]
    IsaUnavailable {
        /// The op.
        op: String,
        /// The instruction set.
        isa: String,
    },
}

impl Error {
    /// A stable snake_case label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::QuantBytes { .. } => "quant_bytes",
            Error::QuantShape { .. } => "quant_shape",
            Error::QuantRowOutOfRange { .. } => "quant_row_out_of_range",
            Error::QuantStack { .. } => "quant_stack",
            Error::Attention { .. } => "attention",
            Error::IsaUnavailable { .. } => "isa_unavailable",
        }
    }
}
