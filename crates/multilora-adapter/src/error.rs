//! The adapter crate's error type: one enum, each variant naming the adapter, the file and the cause.

use std::path::PathBuf;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong while reading, validating or placing an adapter.
///
/// Messages are lowercase and name the adapter, the file, the tensor and the reason, so that an
/// operator can act on a single log line. [`Error::kind`] gives a stable label for metrics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("adapter {adapter:?}: cannot read {}: {source}", path.display())]
    Io {
        /// Adapter name.
        adapter: String,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `adapter_config.json` is absent.
    #[error("adapter {adapter:?}: no adapter_config.json in {}", dir.display())]
    ConfigMissing {
        /// Adapter name.
        adapter: String,
        /// The adapter directory.
        dir: PathBuf,
    },
    /// `adapter_config.json` is not valid JSON or a field has the wrong type or value.
    #[error("adapter {adapter:?}: invalid {}: {reason}", path.display())]
    ConfigInvalid {
        /// Adapter name.
        adapter: String,
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A field or tensor asks for math this engine does not implement; refused, never ignored.
    #[error("adapter {adapter:?}: {} uses {feature}, which is not supported: {reason}", path.display())]
    Unsupported {
        /// Adapter name.
        adapter: String,
        /// The file that carries the feature.
        path: PathBuf,
        /// The field or tensor, e.g. `modules_to_save`.
        feature: String,
        /// Why it is refused.
        reason: String,
    },
    /// DoRA (`use_dora` or `lora_magnitude_vector` tensors).
    #[error("adapter {adapter:?}: {} is a DoRA adapter ({evidence}); DoRA is not supported", path.display())]
    Dora {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The field or tensor that shows it.
        evidence: String,
    },
    /// LoRA bias (`lora_bias` or `lora_B.bias` tensors, or bias tensors with `bias` other than "none").
    #[error("adapter {adapter:?}: {} carries bias terms ({evidence}); LoRA bias is not supported", path.display())]
    LoraBias {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The field or tensor that shows it.
        evidence: String,
    },
    /// A target module outside the set this engine adapts.
    #[error(
        "adapter {adapter:?}: module {module:?} cannot be adapted (supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, embed_tokens, lm_head; qkv_proj and gate_up_proj on Phi-3)"
    )]
    UnsupportedModule {
        /// Adapter name.
        adapter: String,
        /// The module name as the adapter gives it.
        module: String,
    },
    /// `r` (or a `rank_pattern` entry) is zero or negative.
    #[error("adapter {adapter:?}: rank {rank} of {module} is not a positive integer")]
    RankInvalid {
        /// Adapter name.
        adapter: String,
        /// The module (or `r` for the default).
        module: String,
        /// The rank as written.
        rank: i64,
    },
    /// A module's rank exceeds the engine's `max_lora_rank`.
    #[error("adapter {adapter:?}: rank {rank} of {module} exceeds max_lora_rank {max_lora_rank}")]
    RankTooLarge {
        /// Adapter name.
        adapter: String,
        /// The module.
        module: String,
        /// The adapter's rank there.
        rank: usize,
        /// The configured limit.
        max_lora_rank: usize,
    },
    /// The safetensors file ends before the data its header describes.
    #[error("adapter {adapter:?}: {} is truncated: {reason}", path.display())]
    Truncated {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The parser's words.
        reason: String,
    },
    /// The safetensors header is unreadable (bad length, bad JSON, bad offsets).
    #[error("adapter {adapter:?}: {} has a corrupt safetensors header: {reason}", path.display())]
    CorruptHeader {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The parser's words.
        reason: String,
    },
    /// A tensor the config implies is absent.
    #[error("adapter {adapter:?}: {} lacks tensor {tensor}", path.display())]
    TensorMissing {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The expected tensor name.
        tensor: String,
    },
    /// A tensor the config does not account for.
    #[error("adapter {adapter:?}: {} has unexpected tensor {tensor}: {reason}", path.display())]
    TensorUnexpected {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Why it does not fit.
        reason: String,
    },
    /// A tensor's shape does not fit the base model or the module's rank.
    #[error("adapter {adapter:?}: {} tensor {tensor} has shape {got:?}, expected {expected:?}", path.display())]
    ShapeMismatch {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Its shape in the file.
        got: Vec<usize>,
        /// The shape the base model and the config require.
        expected: Vec<usize>,
    },
    /// A tensor's dtype is not a floating-point type.
    #[error("adapter {adapter:?}: {} tensor {tensor} has dtype {dtype}, expected a float type", path.display())]
    DtypeUnsupported {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype as the file names it.
        dtype: String,
    },
    /// A tensor holds NaN or infinity.
    #[error("adapter {adapter:?}: {} tensor {tensor} holds non-finite values", path.display())]
    NonFinite {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// The saved `embed_tokens.base_layer.weight` differs from the base model's embedding.
    #[error(
        "adapter {adapter:?}: {} tensor {tensor} differs from the base model's embedding ({reason}); a resized or retrained vocabulary cannot be served on this base",
        path.display()
    )]
    EmbeddingMismatch {
        /// Adapter name.
        adapter: String,
        /// The file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What differs.
        reason: String,
    },
    /// A strict check found that `base_model_name_or_path` is another architecture.
    #[error("adapter {adapter:?}: base model {base:?} is {found}, but the served model is {expected}")]
    BaseModelMismatch {
        /// Adapter name.
        adapter: String,
        /// `base_model_name_or_path`.
        base: String,
        /// What the adapter's base is (or why it could not be determined).
        found: String,
        /// The served model's architecture.
        expected: String,
    },
    /// A source string is neither an existing directory nor a hub id.
    #[error("adapter source {source_str:?}: {reason}")]
    Source {
        /// The source as given.
        source_str: String,
        /// What was tried.
        reason: String,
    },
    /// The Hugging Face hub (or its cache) could not provide a file.
    #[error("hub repo {repo:?} (revision {revision}): {reason}")]
    Hub {
        /// Repository id.
        repo: String,
        /// Revision asked for.
        revision: String,
        /// What went wrong.
        reason: String,
    },
    /// A tensor operation failed.
    #[error("adapter {adapter:?}: {op}: {source}")]
    Candle {
        /// Adapter name (empty for a slot write).
        adapter: String,
        /// What was being done.
        op: String,
        /// The candle error (boxed: it is large, and errors travel by value).
        source: Box<candle_core::Error>,
    },
    /// Writing an adapter into a device slot failed.
    #[error("slot {slot}: cannot place adapter {adapter:?}: {source}")]
    SlotWrite {
        /// The slot index.
        slot: usize,
        /// Adapter name.
        adapter: String,
        /// Why (the layer's or the model's error).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// A stable snake_case label for metrics and API error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::ConfigMissing { .. } => "config_missing",
            Error::ConfigInvalid { .. } => "config_invalid",
            Error::Unsupported { .. } => "unsupported",
            Error::Dora { .. } => "dora",
            Error::LoraBias { .. } => "lora_bias",
            Error::UnsupportedModule { .. } => "unsupported_module",
            Error::RankInvalid { .. } => "rank_invalid",
            Error::RankTooLarge { .. } => "rank_too_large",
            Error::Truncated { .. } => "truncated",
            Error::CorruptHeader { .. } => "corrupt_header",
            Error::TensorMissing { .. } => "tensor_missing",
            Error::TensorUnexpected { .. } => "tensor_unexpected",
            Error::ShapeMismatch { .. } => "shape_mismatch",
            Error::DtypeUnsupported { .. } => "dtype_unsupported",
            Error::NonFinite { .. } => "non_finite",
            Error::EmbeddingMismatch { .. } => "embedding_mismatch",
            Error::BaseModelMismatch { .. } => "base_model_mismatch",
            Error::Source { .. } => "source",
            Error::Hub { .. } => "hub",
            Error::Candle { .. } => "tensor_op",
            Error::SlotWrite { .. } => "slot_write",
        }
    }
}
