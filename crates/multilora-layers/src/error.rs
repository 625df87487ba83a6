//! The layers crate's error type: bad slot maps, adapters that do not fit their slots, and candle failures.

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong while building a mapping, placing an adapter or running a layer.
///
/// Messages are lowercase and name the module, the tensor and both shapes, so that one log line
/// is enough to act on. [`Error::kind`] gives a stable label for metrics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A slot list names a slot the layers do not have.
    #[error("row {row}: slot {slot} is out of range (max_loras is {max_loras})")]
    SlotOutOfRange {
        /// The row of the slot list.
        row: usize,
        /// The slot it names.
        slot: usize,
        /// Number of slots the layers hold.
        max_loras: usize,
    },
    /// A slot index passed to a write, clear or merge is out of range.
    #[error("{module}: slot {slot} is out of range (max_loras is {max_loras})")]
    NoSuchSlot {
        /// The module (or fused group) addressed.
        module: String,
        /// The slot asked for.
        slot: usize,
        /// Number of slots the layer holds.
        max_loras: usize,
    },
    /// The layer has no slot buffers (its module is not a LoRA target, or `max_loras` is 0).
    #[error("{module}: the layer has no lora slots")]
    NoSlots {
        /// The module.
        module: String,
    },
    /// An adapter's module has a larger rank than the slots hold.
    #[error("{module}: rank {rank} exceeds max_lora_rank {max_rank}")]
    RankTooLarge {
        /// The module.
        module: String,
        /// The module's rank.
        rank: usize,
        /// The slots' rank.
        max_rank: usize,
    },
    /// A tensor has the wrong shape.
    #[error("{module}: {tensor} has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The module (or op).
        module: String,
        /// Which tensor (`lora_A`, `lora_B`, `input`, `bias`, …).
        tensor: String,
        /// Its shape.
        got: Vec<usize>,
        /// The shape it must have.
        expected: Vec<usize>,
    },
    /// A layer was built from inconsistent parts (slice widths that do not sum to the weight's rows, …).
    #[error("{module}: {reason}")]
    InvalidLayer {
        /// The module.
        module: String,
        /// What is wrong.
        reason: String,
    },
    /// A batch does not match its mapping.
    #[error("{op}: the input has {input} rows but the lora mapping has {mapping}")]
    RowMismatch {
        /// The op or layer.
        op: String,
        /// Rows of the input.
        input: usize,
        /// Rows of the mapping.
        mapping: usize,
    },
    /// Placing an adapter into a slot failed; nothing of the slot was changed.
    #[error("slot {slot}: cannot place adapter {adapter:?}: {source}")]
    SlotWrite {
        /// The slot.
        slot: usize,
        /// The adapter's name.
        adapter: String,
        /// Why.
        source: Box<Error>,
    },
    /// A CPU kernel refused its operands (a quantized weight's bytes or shape, an instruction set).
    #[error(transparent)]
    Cpu(#[from] multilora_cpu::Error),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// A stable snake_case label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::SlotOutOfRange { .. } => "slot_out_of_range",
            Error::NoSuchSlot { .. } => "no_such_slot",
            Error::NoSlots { .. } => "no_slots",
            Error::RankTooLarge { .. } => "rank_too_large",
            Error::ShapeMismatch { .. } => "shape_mismatch",
            Error::InvalidLayer { .. } => "invalid_layer",
            Error::RowMismatch { .. } => "row_mismatch",
            Error::SlotWrite { .. } => "slot_write",
            Error::Cpu(e) => e.kind(),
            Error::Candle(_) => "candle",
        }
    }

    pub(crate) fn shape(module: impl ToString, tensor: impl Into<String>, got: &[usize], expected: &[usize]) -> Error {
        Error::ShapeMismatch {
            module: module.to_string(),
            tensor: tensor.into(),
            got: got.to_vec(),
            expected: expected.to_vec(),
        }
    }
}

/// The store sees slot-write failures as its own `SlotWrite`, the layer's error kept as the source.
impl From<Error> for multilora_adapter::Error {
    fn from(e: Error) -> multilora_adapter::Error {
        match e {
            Error::SlotWrite { slot, adapter, source } => multilora_adapter::Error::SlotWrite { slot, adapter, source },
            Error::Candle(source) => multilora_adapter::Error::Candle {
                adapter: String::new(),
                op: "lora layer".to_string(),
                source: Box::new(source),
            },
            other => multilora_adapter::Error::SlotWrite { slot: 0, adapter: String::new(), source: Box::new(other) },
        }
    }
}
