//! Names of the places a LoRA adapter can attach to: `ModuleKind` (which projection) and `ModuleId`
//! (which layer), spelled the way PEFT spells them.

use std::fmt;

/// A kind of module this engine can adapt, named as PEFT and Hugging Face name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ModuleKind {
    /// `self_attn.q_proj`: hidden → heads·head_dim.
    QProj,
    /// `self_attn.k_proj`: hidden → kv_heads·head_dim.
    KProj,
    /// `self_attn.v_proj`: hidden → kv_heads·head_dim.
    VProj,
    /// `self_attn.o_proj`: heads·head_dim → hidden.
    OProj,
    /// `mlp.gate_proj`: hidden → intermediate.
    GateProj,
    /// `mlp.up_proj`: hidden → intermediate.
    UpProj,
    /// `mlp.down_proj`: intermediate → hidden.
    DownProj,
    /// `model.embed_tokens`: vocab → hidden (PEFT's `lora_embedding_A/B`).
    EmbedTokens,
    /// `lm_head`: hidden → vocab.
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
        match self {
            ModuleKind::QProj => "q_proj",
            ModuleKind::KProj => "k_proj",
            ModuleKind::VProj => "v_proj",
            ModuleKind::OProj => "o_proj",
            ModuleKind::GateProj => "gate_proj",
            ModuleKind::UpProj => "up_proj",
            ModuleKind::DownProj => "down_proj",
            ModuleKind::EmbedTokens => "embed_tokens",
            ModuleKind::LmHead => "lm_head",
        }
    }

    /// Parses a short name.
    pub fn from_short_name(name: &str) -> Option<ModuleKind> {
        ModuleKind::ALL.into_iter().find(|k| k.short_name() == name)
    }

    /// Whether this kind lives inside each decoder layer.
    pub fn is_per_layer(self) -> bool {
        !matches!(self, ModuleKind::EmbedTokens | ModuleKind::LmHead)
    }

    /// The sub-block inside a decoder layer (`self_attn` or `mlp`), if per layer.
    fn block(self) -> Option<&'static str> {
        match self {
            ModuleKind::QProj | ModuleKind::KProj | ModuleKind::VProj | ModuleKind::OProj => Some("self_attn"),
            ModuleKind::GateProj | ModuleKind::UpProj | ModuleKind::DownProj => Some("mlp"),
            ModuleKind::EmbedTokens | ModuleKind::LmHead => None,
        }
    }
}

impl fmt::Display for ModuleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// One adaptable module of the model: a projection in a given layer, or the embedding, or `lm_head`.
///
/// Ordered by layer, then kind, so maps keyed on it iterate in model order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleId {
    /// The decoder layer, `None` for `embed_tokens` and `lm_head`.
    pub layer: Option<usize>,
    /// Which module.
    pub kind: ModuleKind,
}

impl ModuleId {
    /// A projection inside decoder layer `layer`.
    pub fn layer(layer: usize, kind: ModuleKind) -> ModuleId {
        ModuleId { layer: Some(layer), kind }
    }

    /// The input embedding.
    pub fn embed_tokens() -> ModuleId {
        ModuleId { layer: None, kind: ModuleKind::EmbedTokens }
    }

    /// The output head.
    pub fn lm_head() -> ModuleId {
        ModuleId { layer: None, kind: ModuleKind::LmHead }
    }

    /// The module's name relative to a `*ForCausalLM` model, as PEFT matches it:
    /// `model.layers.3.self_attn.q_proj`, `model.embed_tokens`, `lm_head`.
    pub fn peft_name(&self) -> String {
        match (self.layer, self.kind.block()) {
            (Some(layer), Some(block)) => {
                format!("model.layers.{layer}.{block}.{}", self.kind.short_name())
            }
            _ if self.kind == ModuleKind::EmbedTokens => "model.embed_tokens".to_string(),
            _ => self.kind.short_name().to_string(),
        }
    }

    /// Parses a PEFT module name (the inverse of [`ModuleId::peft_name`]).
    pub fn from_peft_name(name: &str) -> Option<ModuleId> {
        match name {
            "model.embed_tokens" => return Some(ModuleId::embed_tokens()),
            "lm_head" => return Some(ModuleId::lm_head()),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (block, short) = rest.split_once('.')?;
        let kind = ModuleKind::from_short_name(short)?;
        (kind.block() == Some(block)).then_some(ModuleId::layer(layer, kind))
    }
}

impl fmt::Display for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.peft_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_names_round_trip() {
        for layer in [0, 7, 31] {
            for kind in ModuleKind::PROJECTIONS {
                let id = ModuleId::layer(layer, kind);
                assert_eq!(ModuleId::from_peft_name(&id.peft_name()), Some(id));
            }
        }
        assert_eq!(ModuleId::embed_tokens().peft_name(), "model.embed_tokens");
        assert_eq!(ModuleId::from_peft_name("lm_head"), Some(ModuleId::lm_head()));
        assert_eq!(ModuleId::from_peft_name("model.layers.0.mlp.q_proj"), None);
        assert_eq!(ModuleId::from_peft_name("model.layers.x.self_attn.q_proj"), None);
    }
}
