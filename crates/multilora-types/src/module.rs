//! `ModuleKind`: the places a LoRA adapter can attach to, spelled the way PEFT spells them.

use std::fmt;

/// A kind of module this engine can adapt, named as PEFT and Hugging Face name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
    pub fn block(self) -> Option<&'static str> {
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
