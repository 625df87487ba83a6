//! The crate's one error type: every failure names the file, tensor, field or sequence involved.

use std::path::PathBuf;

/// Errors of model loading and of a forward step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `config.json` was refused (its kind says why: `config`, `unsupported_architecture`, …).
    #[error(transparent)]
    ModelConfig(#[from] crate::config::ConfigError),
    /// A checkpoint file is missing, or a shard index is malformed.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("tensor {tensor} is missing from the checkpoint in {dir}")]
    TensorMissing {
        /// The tensor name.
        tensor: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A checkpoint tensor has the wrong shape.
    #[error("tensor {tensor} has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor name.
        tensor: String,
        /// Its shape in the file.
        got: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// A GGUF file was refused: not a model, truncated, an architecture or a setting this engine
    /// does not serve.
    #[error("{}: {reason}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A GGUF tensor is of a type this engine cannot read (IQ*, TQ*, MXFP4, …).
    #[error("{}: tensor {tensor} is of type {ty}, which is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K are)", path.display())]
    GgufTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor's GGUF name.
        tensor: String,
        /// Its type.
        ty: String,
    },
    /// A hub repository could not be resolved.
    #[error("hub repo {repo}@{revision}: {reason}")]
    Hub {
        /// `org/name`.
        repo: String,
        /// Branch, tag or commit.
        revision: String,
        /// Why.
        reason: String,
    },
    /// A batch is malformed: an empty sequence, a block table too short, a token out of the vocabulary…
    #[error("batch sequence {seq}: {reason}")]
    InvalidBatch {
        /// Index of the sequence in the batch.
        seq: usize,
        /// What is wrong.
        reason: String,
    },
    /// A KV cache was made for another model or is too small.
    #[error("kv cache: {reason}")]
    KvCache {
        /// What is wrong.
        reason: String,
    },
    /// An adapter targets a module that the model holds no LoRA slots for.
    #[error("adapter {adapter:?} targets {module}, which is not in lora_target_modules")]
    NotATarget {
        /// Adapter name.
        adapter: String,
        /// The PEFT module name.
        module: String,
    },
    /// A LoRA layer failed.
    #[error(transparent)]
    Layer(#[from] multilora_layers::Error),
    /// A tensor operation failed.
    #[error("tensor op: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// A stable snake_case label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::ModelConfig(e) => e.kind(),
            Error::Config { .. } => "config",
            Error::TensorMissing { .. } => "tensor_missing",
            Error::ShapeMismatch { .. } => "shape_mismatch",
            Error::Gguf { .. } => "gguf",
            Error::GgufTensorType { .. } => "gguf_tensor_type",
            Error::Hub { .. } => "hub",
            Error::InvalidBatch { .. } => "invalid_batch",
            Error::KvCache { .. } => "kv_cache",
            Error::NotATarget { .. } => "not_a_target",
            Error::Layer(_) => "layer",
            Error::Candle(_) => "candle",
        }
    }

    pub(crate) fn batch(seq: usize, reason: impl Into<String>) -> Error {
        Error::InvalidBatch { seq, reason: reason.into() }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
