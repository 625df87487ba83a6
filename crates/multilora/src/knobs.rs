//! The engine's own spellings of what it is built with and reports: [`Device`] and [`DType`]
//! (converted to candle's inside the engine), the step-time budget [`StepTime`], the adaptable
//! modules [`ModuleKind`] and the LoRA limits [`LoraLimits`] an engine runs with (each converted
//! to and from `multilora-types`' inside the engine). So an embedder names every type of the API
//! through `multilora::` alone, and a crate below the engine changes without changing the API.

use std::fmt;

/// Where the model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// The host's CPU (the default).
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal, on a stream of its own (so the builder's uploads and the
    /// engine loop's steps, on other threads, are ordered by the stream itself). Needs the
    /// `cuda` feature; the device is opened by [`crate::EngineBuilder::build`], which fails with
    /// `invalid_config` when it cannot be.
    Cuda(usize),
}

impl Device {
    /// candle's device: the CPU, or a CUDA device on its own stream.
    pub(crate) fn open(self) -> candle_core::Result<candle_core::Device> {
        match self {
            Device::Cpu => Ok(candle_core::Device::Cpu),
            Device::Cuda(ordinal) => candle_core::Device::new_cuda_with_stream(ordinal),
        }
    }
}

impl fmt::Display for Device {
    /// `cpu` or `cuda:N`, as `--device` spells it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A floating-point precision the engine holds weights, adapters or the KV cache in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit floats.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// The name `torch_dtype` gives it: `float32`, `float16` or `bfloat16`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    pub(crate) fn to_candle(self) -> candle_core::DType {
        match self {
            DType::F32 => candle_core::DType::F32,
            DType::F16 => candle_core::DType::F16,
            DType::BF16 => candle_core::DType::BF16,
        }
    }

    /// The engine's spelling of a candle dtype, when it is a precision the engine serves in.
    pub(crate) fn from_candle(dtype: candle_core::DType) -> Option<DType> {
        match dtype {
            candle_core::DType::F32 => Some(DType::F32),
            candle_core::DType::F16 => Some(DType::F16),
            candle_core::DType::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// How long a step that carries decode rows may take. A step with no decode row stalls no stream,
/// so it is bounded by the token budget (`max_num_batched_tokens`) alone.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum StepTime {
    /// No time budget: prefill takes whatever `max_num_batched_tokens` leaves (vLLM's behaviour
    /// with a fixed token budget).
    Unbounded,
    /// At most `factor` times the modelled time of the step's decode rows alone, so the largest
    /// gap between a stream's tokens stays within about `factor` times the usual one, whatever
    /// the device.
    Auto {
        /// The multiple of a decode-only step (> 1).
        factor: f64,
    },
    /// At most this many seconds.
    Max {
        /// Seconds.
        seconds: f64,
    },
}

/// [`StepTime::Auto`]'s default factor: a step may take 2.5 decode steps, which keeps the largest
/// inter-token gap within 3× the median with room for the cost model's error.
pub const DEFAULT_STEP_FACTOR: f64 = multilora_types::DEFAULT_STEP_FACTOR;

impl StepTime {
    /// A stable name: `unbounded`, `auto` or `max`.
    pub fn name(&self) -> &'static str {
        self.to_inner().name()
    }

    pub(crate) fn to_inner(self) -> multilora_types::StepTime {
        match self {
            StepTime::Unbounded => multilora_types::StepTime::Unbounded,
            StepTime::Auto { factor } => multilora_types::StepTime::Auto { factor },
            StepTime::Max { seconds } => multilora_types::StepTime::Max { seconds },
        }
    }
}

/// A module a LoRA adapter can attach to, named as PEFT and Hugging Face name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ModuleKind {
    /// `self_attn.q_proj`.
    QProj,
    /// `self_attn.k_proj`.
    KProj,
    /// `self_attn.v_proj`.
    VProj,
    /// `self_attn.o_proj`.
    OProj,
    /// `mlp.gate_proj`.
    GateProj,
    /// `mlp.up_proj`.
    UpProj,
    /// `mlp.down_proj`.
    DownProj,
    /// `model.embed_tokens` (PEFT's `lora_embedding_A/B`).
    EmbedTokens,
    /// `lm_head`.
    LmHead,
}

impl ModuleKind {
    /// Every kind, in a fixed order.
    pub const ALL: [ModuleKind; 9] = [
        ModuleKind::QProj,
        ModuleKind::KProj,
        ModuleKind::VProj,
        ModuleKind::OProj,
        ModuleKind::GateProj,
        ModuleKind::UpProj,
        ModuleKind::DownProj,
        ModuleKind::EmbedTokens,
        ModuleKind::LmHead,
    ];

    /// The seven per-layer projections.
    pub const PROJECTIONS: [ModuleKind; 7] = [
        ModuleKind::QProj,
        ModuleKind::KProj,
        ModuleKind::VProj,
        ModuleKind::OProj,
        ModuleKind::GateProj,
        ModuleKind::UpProj,
        ModuleKind::DownProj,
    ];

    /// The short name used in `target_modules` (`q_proj`, `embed_tokens`, …).
    pub fn short_name(self) -> &'static str {
        self.to_inner().short_name()
    }

    /// Parses a short name.
    pub fn from_short_name(name: &str) -> Option<ModuleKind> {
        multilora_types::ModuleKind::from_short_name(name).map(ModuleKind::from_inner)
    }

    pub(crate) fn to_inner(self) -> multilora_types::ModuleKind {
        use multilora_types::ModuleKind as M;
        match self {
            ModuleKind::QProj => M::QProj,
            ModuleKind::KProj => M::KProj,
            ModuleKind::VProj => M::VProj,
            ModuleKind::OProj => M::OProj,
            ModuleKind::GateProj => M::GateProj,
            ModuleKind::UpProj => M::UpProj,
            ModuleKind::DownProj => M::DownProj,
            ModuleKind::EmbedTokens => M::EmbedTokens,
            ModuleKind::LmHead => M::LmHead,
        }
    }

    pub(crate) fn from_inner(kind: multilora_types::ModuleKind) -> ModuleKind {
        use multilora_types::ModuleKind as M;
        match kind {
            M::QProj => ModuleKind::QProj,
            M::KProj => ModuleKind::KProj,
            M::VProj => ModuleKind::VProj,
            M::OProj => ModuleKind::OProj,
            M::GateProj => ModuleKind::GateProj,
            M::UpProj => ModuleKind::UpProj,
            M::DownProj => ModuleKind::DownProj,
            M::EmbedTokens => ModuleKind::EmbedTokens,
            M::LmHead => ModuleKind::LmHead,
        }
    }
}

/// The LoRA limits an engine runs with ([`crate::EngineConfig::lora`]): how many adapters a step
/// may mix, the rank every slot holds, and the modules with slot buffers. "LoRA off" is a value
/// ([`LoraLimits::is_off`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraLimits {
    max_loras: usize,
    max_lora_rank: usize,
    target_modules: Vec<ModuleKind>,
}

impl LoraLimits {
    pub(crate) fn from_inner(limits: &multilora_types::LoraLimits) -> LoraLimits {
        LoraLimits {
            max_loras: limits.max_loras(),
            max_lora_rank: limits.max_lora_rank(),
            target_modules: limits.target_modules().iter().map(|&k| ModuleKind::from_inner(k)).collect(),
        }
    }

    /// Whether LoRA is off (no slots: only the base model is served).
    pub fn is_off(&self) -> bool {
        self.max_loras == 0
    }

    /// Slots: distinct adapter generations per step (0 when off).
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }

    /// The largest rank a slot holds (0 when off).
    pub fn max_lora_rank(&self) -> usize {
        self.max_lora_rank
    }

    /// The modules with slot buffers, sorted (empty when off).
    pub fn target_modules(&self) -> &[ModuleKind] {
        &self.target_modules
    }

    /// Whether `kind` has slot buffers.
    pub fn targets(&self, kind: ModuleKind) -> bool {
        self.target_modules.contains(&kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_keep_every_value() {
        for kind in multilora_types::ModuleKind::ALL {
            assert_eq!(ModuleKind::from_inner(kind).to_inner(), kind);
            assert_eq!(ModuleKind::from_short_name(kind.short_name()).map(ModuleKind::to_inner), Some(kind));
        }
        assert_eq!(ModuleKind::ALL.map(ModuleKind::to_inner), multilora_types::ModuleKind::ALL);
        assert_eq!(ModuleKind::PROJECTIONS.map(ModuleKind::to_inner), multilora_types::ModuleKind::PROJECTIONS);
        for dt in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(DType::from_candle(dt.to_candle()), Some(dt));
        }
        assert_eq!(DType::from_candle(candle_core::DType::F64), None);
        let auto = StepTime::Auto { factor: DEFAULT_STEP_FACTOR };
        assert_eq!(auto.to_inner(), multilora_types::StepTime::Auto { factor: 2.5 });
        assert_eq!(StepTime::Max { seconds: 0.25 }.name(), "max");
        assert_eq!((Device::Cpu.to_string(), Device::Cuda(1).to_string()), ("cpu".into(), "cuda:1".into()));
        let inner = multilora_types::LoraLimits::new(2, 8, &[multilora_types::ModuleKind::VProj]).unwrap();
        let limits = LoraLimits::from_inner(&inner);
        assert_eq!((limits.max_loras(), limits.max_lora_rank()), (2, 8));
        assert!(limits.targets(ModuleKind::VProj) && !limits.targets(ModuleKind::QProj));
        assert!(LoraLimits::from_inner(&multilora_types::LoraLimits::off()).is_off());
    }
}
