//! `ModelShapes`: what an adapter is validated against — the base model's per-module sizes, and a
//! digest of its input embedding for adapters that carry a saved copy of it.

use multilora_types::ModuleKind;

use crate::module::ModuleId;

/// Sizes of the base model that adapters must fit.
///
/// Built by the model crate, from the loaded model or from a Hugging Face `config.json`
/// (`multilora_models::ModelConfig::shapes`), or by [`ModelShapes::llama`] from the sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelShapes {
    /// `architectures[0]` of `config.json`, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// `model_type` of `config.json`, e.g. `llama`.
    pub model_type: String,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP intermediate size.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Whether `lm_head` shares the embedding's weight.
    pub tie_word_embeddings: bool,
    /// Whether the checkpoint stores q/k/v as one `self_attn.qkv_proj` and gate/up as one
    /// `mlp.gate_up_proj` (Phi-3): its PEFT adapters target those fused modules, one A and one B
    /// over the fused output each ([`ModelShapes::peft_module`]).
    pub fused_projections: bool,
    /// blake3-256 of the base embedding (see [`crate::embedding_digest`]); `None` when unknown,
    /// in which case an adapter that carries a saved embedding is refused, since it cannot be checked.
    pub embed_digest: Option<[u8; 32]>,
    /// The dtype the base embedding is stored in (set with the digest): a saved copy in another
    /// dtype is compared after rounding to it, as PEFT's copy over a model of that dtype would be.
    pub embed_dtype: Option<candle_core::DType>,
}

impl ModelShapes {
    /// Shapes of a Llama-family model from its sizes; the architecture is `LlamaForCausalLM`.
    pub fn llama(
        num_layers: usize,
        hidden_size: usize,
        intermediate_size: usize,
        vocab_size: usize,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> ModelShapes {
        ModelShapes {
            architecture: "LlamaForCausalLM".to_string(),
            model_type: "llama".to_string(),
            num_layers,
            hidden_size,
            intermediate_size,
            vocab_size,
            num_heads,
            num_kv_heads,
            head_dim: hidden_size / num_heads.max(1),
            tie_word_embeddings: false,
            fused_projections: false,
            embed_digest: None,
            embed_dtype: None,
        }
    }

    /// `(in_features, out_features)` of a module kind. For `embed_tokens` that is `(vocab, hidden)`,
    /// matching PEFT's `lora_embedding_A: [r, vocab]`, `lora_embedding_B: [hidden, r]`.
    pub fn in_out(&self, kind: ModuleKind) -> (usize, usize) {
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        match kind {
            ModuleKind::QProj => (self.hidden_size, q),
            ModuleKind::KProj | ModuleKind::VProj => (self.hidden_size, kv),
            ModuleKind::OProj => (q, self.hidden_size),
            ModuleKind::GateProj | ModuleKind::UpProj => (self.hidden_size, self.intermediate_size),
            ModuleKind::DownProj => (self.intermediate_size, self.hidden_size),
            ModuleKind::EmbedTokens => (self.vocab_size, self.hidden_size),
            ModuleKind::LmHead => (self.hidden_size, self.vocab_size),
        }
    }

    /// The PEFT module `id` is part of, and the first row of `id`'s output in that module's
    /// output: the module itself at 0, or with [`ModelShapes::fused_projections`] the fused
    /// `qkv_proj` (q at 0, k after q, v after k) and `gate_up_proj` (gate at 0, up after it).
    pub fn peft_module(&self, id: ModuleId) -> (String, usize) {
        let (Some(layer), true) = (id.layer, self.fused_projections) else { return (id.peft_name(), 0) };
        let (q, kv, inter) =
            (self.in_out(ModuleKind::QProj).1, self.in_out(ModuleKind::KProj).1, self.intermediate_size);
        let (name, offset) = match id.kind {
            ModuleKind::QProj => ("self_attn.qkv_proj", 0),
            ModuleKind::KProj => ("self_attn.qkv_proj", q),
            ModuleKind::VProj => ("self_attn.qkv_proj", q + kv),
            ModuleKind::GateProj => ("mlp.gate_up_proj", 0),
            ModuleKind::UpProj => ("mlp.gate_up_proj", inter),
            _ => return (id.peft_name(), 0),
        };
        (format!("model.layers.{layer}.{name}"), offset)
    }

    /// The `general.architecture` llama.cpp writes for this model: its `model_type`, but for
    /// Gemma 3's text models (`gemma3_text`), which it calls `gemma3`.
    pub fn gguf_architecture(&self) -> &str {
        match self.model_type.as_str() {
            "gemma3_text" => "gemma3",
            other => other,
        }
    }

    /// Every module of the model that an adapter may target, in model order.
    pub fn modules(&self) -> Vec<ModuleId> {
        let mut out = vec![ModuleId::embed_tokens()];
        for layer in 0..self.num_layers {
            out.extend(ModuleKind::PROJECTIONS.iter().map(|&k| ModuleId::layer(layer, k)));
        }
        out.push(ModuleId::lm_head());
        out
    }

    /// Whether `id` exists in this model.
    pub fn contains(&self, id: ModuleId) -> bool {
        match id.layer {
            Some(layer) => id.kind.is_per_layer() && layer < self.num_layers,
            None => !id.kind.is_per_layer(),
        }
    }

    /// Bytes one adapter takes at `rank` on `kinds` (every layer for per-layer kinds), with
    /// `dtype_bytes` bytes per element: `Σ rank · (in + out) · dtype_bytes`.
    pub fn lora_bytes(&self, kinds: &[ModuleKind], rank: usize, dtype_bytes: usize) -> u64 {
        kinds
            .iter()
            .map(|&k| {
                let (i, o) = self.in_out(k);
                let per = (rank * (i + o) * dtype_bytes) as u64;
                if k.is_per_layer() { per * self.num_layers as u64 } else { per }
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixture_shapes() {
        // The fixture's config.json (`ModelConfig::shapes` of multilora-models reads the same).
        let s = ModelShapes::llama(4, 128, 352, 512, 4, 2);
        assert_eq!(s.head_dim, 32);
        assert_eq!(s.in_out(ModuleKind::KProj), (128, 64));
        assert_eq!(s.in_out(ModuleKind::EmbedTokens), (512, 128));
        assert_eq!(s.modules().len(), 4 * 7 + 2);
    }

    #[test]
    fn seed_model_adapter_bytes() {
        // The seed material's model: 32 layers, hidden 4096, k/v out 1024, MLP 14336, 16-bit.
        let mut s = ModelShapes::llama(32, 4096, 14336, 100_000, 32, 8);
        s.head_dim = 128;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let bytes = |r| s.lora_bytes(&ModuleKind::PROJECTIONS, r, 2);
        assert!((mib(bytes(8)) - 40.0).abs() < 0.5, "{}", mib(bytes(8)));
        assert!((mib(bytes(16)) - 80.0).abs() < 1.0);
        assert!((mib(bytes(64)) - 320.0).abs() < 4.0);
    }
}
