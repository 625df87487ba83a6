//! `LoraLimits`: how many adapters a step may mix, how large a rank a slot holds, and which modules
//! get slot buffers. Built and checked once; "LoRA off" is a value ([`LoraLimits::off`]), not a
//! zero every crate checks for.

use crate::module::ModuleKind;

/// vLLM's default `max_lora_rank`.
pub const DEFAULT_MAX_LORA_RANK: usize = 16;

/// The largest rank any adapter or slot may have (vLLM's largest `max_lora_rank` is 512): a bound
/// checked before anything is sized from a rank, so a config that claims a rank of a billion is
/// a typed refusal, not an allocation that aborts the process.
pub const MAX_LORA_RANK_CEILING: usize = 1024;

/// Why a set of LoRA limits was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// `max_lora_rank` is 0 while LoRA is on.
    #[error("max_lora_rank must be positive when max_loras is {max_loras}")]
    ZeroRank {
        /// The slots asked for.
        max_loras: usize,
    },
    /// `max_lora_rank` is above [`MAX_LORA_RANK_CEILING`].
    #[error("max_lora_rank {max_lora_rank} is above the ceiling of {MAX_LORA_RANK_CEILING}")]
    RankAboveCeiling {
        /// The rank asked for.
        max_lora_rank: usize,
    },
    /// No module would get slot buffers while LoRA is on.
    #[error("lora_target_modules is empty while max_loras is {max_loras}")]
    NoTargets {
        /// The slots asked for.
        max_loras: usize,
    },
}

/// The LoRA limits of an engine, a model, a store and a scheduler: one value shared by all four.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraLimits {
    max_loras: usize,
    max_lora_rank: usize,
    target_modules: Vec<ModuleKind>,
}

impl Default for LoraLimits {
    /// vLLM's defaults: one slot of rank 16, on the seven projections and the embedding.
    fn default() -> LoraLimits {
        LoraLimits { max_loras: 1, max_lora_rank: DEFAULT_MAX_LORA_RANK, target_modules: LoraLimits::default_targets() }
    }
}

impl LoraLimits {
    /// Checked limits: `max_loras` slots of rank `max_lora_rank` for `target_modules` (sorted, each
    /// once). `max_loras` 0 is [`LoraLimits::off`], whatever the other two say.
    pub fn new(
        max_loras: usize,
        max_lora_rank: usize,
        target_modules: &[ModuleKind],
    ) -> Result<LoraLimits, LimitsError> {
        if max_loras == 0 {
            return Ok(LoraLimits::off());
        }
        if max_lora_rank == 0 {
            return Err(LimitsError::ZeroRank { max_loras });
        }
        if max_lora_rank > MAX_LORA_RANK_CEILING {
            return Err(LimitsError::RankAboveCeiling { max_lora_rank });
        }
        if target_modules.is_empty() {
            return Err(LimitsError::NoTargets { max_loras });
        }
        let mut targets = target_modules.to_vec();
        targets.sort();
        targets.dedup();
        Ok(LoraLimits { max_loras, max_lora_rank, target_modules: targets })
    }

    /// `max_loras` slots at the default rank and targets ([`DEFAULT_MAX_LORA_RANK`],
    /// [`LoraLimits::default_targets`]); 0 is [`LoraLimits::off`].
    pub fn slots(max_loras: usize) -> LoraLimits {
        match max_loras {
            0 => LoraLimits::off(),
            n => LoraLimits { max_loras: n, ..LoraLimits::default() },
        }
    }

    /// LoRA off: no slots, no slot buffers; only the base model is served.
    pub fn off() -> LoraLimits {
        LoraLimits { max_loras: 0, max_lora_rank: 0, target_modules: Vec::new() }
    }

    /// The modules that get slot buffers unless told otherwise: the seven projections and
    /// `embed_tokens`.
    pub fn default_targets() -> Vec<ModuleKind> {
        let mut t = ModuleKind::PROJECTIONS.to_vec();
        t.push(ModuleKind::EmbedTokens);
        t
    }

    /// Whether LoRA is off.
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
    fn limits_are_checked_once_and_off_is_a_value() {
        let off = LoraLimits::new(0, 0, &[]).unwrap();
        assert!(off.is_off() && off.max_lora_rank() == 0 && !off.targets(ModuleKind::QProj));
        assert_eq!(off, LoraLimits::off());
        assert_eq!(LoraLimits::new(4, 0, &[ModuleKind::QProj]), Err(LimitsError::ZeroRank { max_loras: 4 }));
        assert_eq!(LoraLimits::new(4, 8, &[]), Err(LimitsError::NoTargets { max_loras: 4 }));
        let huge = LoraLimits::new(4, 1_000_000_000, &[ModuleKind::QProj]);
        assert_eq!(huge, Err(LimitsError::RankAboveCeiling { max_lora_rank: 1_000_000_000 }));
        assert!(LoraLimits::new(4, MAX_LORA_RANK_CEILING, &[ModuleKind::QProj]).is_ok());
        let l = LoraLimits::new(4, 8, &[ModuleKind::VProj, ModuleKind::QProj, ModuleKind::VProj]).unwrap();
        assert_eq!(l.target_modules(), &[ModuleKind::QProj, ModuleKind::VProj]);
        assert!(!l.is_off() && l.max_loras() == 4 && l.max_lora_rank() == 8);
        let d = LoraLimits::default();
        assert_eq!((d.max_loras(), d.max_lora_rank()), (1, DEFAULT_MAX_LORA_RANK));
        assert!(d.targets(ModuleKind::EmbedTokens) && !d.targets(ModuleKind::LmHead));
        assert_eq!(LoraLimits::slots(0), LoraLimits::off());
        assert_eq!(LoraLimits::slots(3).max_loras(), 3);
    }
}
