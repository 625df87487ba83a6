//! `ModuleId`: which layer's module an adapter attaches to, spelled the way PEFT spells it (the
//! kind of module, `ModuleKind`, is shared vocabulary from `multilora-types`).

use std::fmt;

use multilora_types::ModuleKind;

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
