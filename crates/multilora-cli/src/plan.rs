//! `multilora plan`: capacity arithmetic from a model's `config.json`, before anyone sizes a GPU.
//!
//! Conventions (the ones that reproduce the seed's figures): base weights count the embedding and
//! an untied `lm_head` (tied configs count it once), the seven projections of every layer and the
//! RMSNorm vectors; an adapter of rank r adds `r × (in + out)` values per targeted module and layer
//! (`lora_A [r, in]`, `lora_B [out, r]`), an embedding or `lm_head` target `r × (vocab + hidden)`.
//! A slot holds one adapter at `--max-lora-rank` over the targeted modules.

use std::path::Path;

use anyhow::{Context, Result};
use multilora_models::ModelConfig;

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// The seven projections PEFT targets with `all-linear` on a Llama model.
pub(crate) const DEFAULT_TARGETS: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// The shapes `plan` needs, read from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Shapes {
    /// Decoder layers.
    pub(crate) layers: u64,
    /// Hidden size.
    pub(crate) hidden: u64,
    /// Output width of q_proj (heads × head_dim).
    pub(crate) q_out: u64,
    /// Output width of k_proj and v_proj (kv heads × head_dim).
    pub(crate) kv_out: u64,
    /// MLP width.
    pub(crate) intermediate: u64,
    /// Vocabulary size.
    pub(crate) vocab: u64,
    /// Whether lm_head shares the embedding's weights.
    pub(crate) tied: bool,
    /// Bytes per value of the config's own dtype (2 unless it says float32).
    pub(crate) dtype_bytes: u64,
}

impl Shapes {
    /// The sizes of a model as the engine reads its `config.json` (the one reader the model and
    /// the adapter shapes use too); weights are sized in the dtype `--dtype auto` serves.
    pub(crate) fn from_config(c: &ModelConfig) -> Shapes {
        Shapes {
            layers: c.num_layers as u64,
            hidden: c.hidden_size as u64,
            q_out: c.q_size() as u64,
            kv_out: c.kv_size() as u64,
            intermediate: c.intermediate_size as u64,
            vocab: c.vocab_size as u64,
            tied: c.tie_word_embeddings,
            dtype_bytes: c.auto_dtype().size_in_bytes() as u64,
        }
    }

    /// (in, out) of a linear module, or None for a name plan does not know.
    fn module(&self, name: &str) -> Option<(u64, u64)> {
        let (h, i) = (self.hidden, self.intermediate);
        Some(match name {
            "q_proj" => (h, self.q_out),
            "k_proj" | "v_proj" => (h, self.kv_out),
            "o_proj" => (self.q_out, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            _ => return None,
        })
    }

    /// Parameters of the base model.
    pub(crate) fn base_params(&self) -> u64 {
        let per_layer: u64 =
            DEFAULT_TARGETS.iter().filter_map(|m| self.module(m)).map(|(i, o)| i * o).sum::<u64>() + 2 * self.hidden; // input and post-attention RMSNorm
        let embed = self.vocab * self.hidden * if self.tied { 1 } else { 2 };
        self.layers * per_layer + embed + self.hidden // final norm
    }

    /// Values of one adapter of rank `r` over `targets`.
    pub(crate) fn adapter_params(&self, r: u64, targets: &[String]) -> Result<u64> {
        let mut total = 0;
        for t in targets {
            total += match t.as_str() {
                "embed_tokens" | "lm_head" => r * (self.vocab + self.hidden),
                m => {
                    let (i, o) = self.module(m).with_context(|| {
                        format!(
                            "unknown target module {m:?} (known: {}, embed_tokens, lm_head)",
                            DEFAULT_TARGETS.join(", ")
                        )
                    })?;
                    self.layers * r * (i + o)
                }
            };
        }
        Ok(total)
    }

    /// KV cache bytes per token (keys and values of every layer).
    pub(crate) fn kv_bytes_per_token(&self, bytes: u64) -> u64 {
        2 * self.layers * self.kv_out * bytes
    }
}

/// Bytes per value of a dtype name (`f32`, `bf16`, `float16`, ...).
pub(crate) fn dtype_bytes(name: &str) -> Option<u64> {
    match name {
        "f32" | "float32" | "float" => Some(4),
        "bf16" | "f16" | "bfloat16" | "float16" | "half" => Some(2),
        _ => None,
    }
}

/// GiB with two decimals, or three when that is exact (0.625), or a whole number with thousands
/// separators from 1,000 GiB up, so the figures read as the seed material writes them.
pub(crate) fn gib(bytes: f64) -> String {
    let g = bytes / GIB;
    if g >= 1000.0 {
        return format!("{} GiB", thousands(g.round() as u64));
    }
    let milli = g * 1000.0;
    if (milli - milli.round()).abs() < 1e-9 && !(milli.round() as u64).is_multiple_of(10) {
        format!("{g:.3} GiB")
    } else {
        format!("{g:.2} GiB")
    }
}

/// MiB, whole when whole.
pub(crate) fn mib(bytes: f64) -> String {
    let m = bytes / MIB;
    if m.fract() == 0.0 { format!("{} MiB", thousands(m as u64)) } else { format!("{m:.2} MiB") }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// What `plan` was asked.
#[derive(Clone, Debug)]
pub(crate) struct PlanArgs {
    /// Slots on the device.
    pub(crate) max_loras: u64,
    /// Rank every slot is sized for.
    pub(crate) max_lora_rank: u64,
    /// Device memory budget in bytes.
    pub(crate) memory_bytes: f64,
    /// Bytes per value; None takes the config's dtype.
    pub(crate) dtype_bytes: Option<u64>,
    /// Adapter target modules.
    pub(crate) targets: Vec<String>,
}

/// The report `plan` prints.
pub(crate) fn report(s: &Shapes, a: &PlanArgs) -> Result<String> {
    let b = a.dtype_bytes.unwrap_or(s.dtype_bytes);
    let bf = b as f64;
    let base = s.base_params() as f64 * bf;
    let per = |r: u64| -> Result<f64> { Ok(s.adapter_params(r, &a.targets)? as f64 * bf) };
    let slots = a.max_loras as f64 * per(a.max_lora_rank)?;
    let kv = s.kv_bytes_per_token(b);
    let left = a.memory_bytes - base - slots;
    let tokens = if left > 0.0 { (left / kv as f64).floor() as u64 } else { 0 };
    let mut o = String::new();
    let mut line = |l: String| {
        o.push_str(&l);
        o.push('\n');
    };
    line(format!(
        "model: {} layers, hidden {}, q out {}, k/v out {}, MLP {}, vocab {}, {} lm_head, {b} bytes per value",
        s.layers,
        s.hidden,
        s.q_out,
        s.kv_out,
        s.intermediate,
        s.vocab,
        if s.tied { "tied" } else { "untied" }
    ));
    line(format!("adapter targets: {}", a.targets.join(", ")));
    line(format!("base weights:                 {} ({} parameters)", gib(base), thousands(s.base_params())));
    for r in [8, 16, 64] {
        line(format!("one adapter at rank {r:<2}:       {}", mib(per(r)?)));
    }
    line(format!("100 adapters at rank 16:      {}", gib(100.0 * per(16)?)));
    line(format!("slots ({} x rank {}):          {}", a.max_loras, a.max_lora_rank, gib(slots)));
    line(format!("KV cache per token:           {} bytes", thousands(kv)));
    line(format!(
        "KV tokens in {} after base and slots: {} ({})",
        gib(a.memory_bytes),
        thousands(tokens),
        gib(tokens as f64 * kv as f64)
    ));
    line(format!("100 full fine-tuned copies:   {}", gib(100.0 * base)));
    Ok(o)
}

/// Reads `config.json` from a directory or a file path.
pub(crate) fn load_config(path: &Path) -> Result<ModelConfig> {
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    Ok(ModelConfig::from_file(&file)?)
}

/// Parses a memory budget: a number of GiB, optionally suffixed `GiB`, `G` or `GB` (all GiB).
pub(crate) fn parse_memory(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let num = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    let unit = &t[num.len()..].trim().to_ascii_lowercase();
    if !["", "g", "gb", "gib"].contains(&unit.as_str()) {
        return Err(format!("unknown unit {unit:?}: give GiB, e.g. 80 or 80GiB"));
    }
    let g: f64 = num.parse().map_err(|_| format!("{s:?} is not a number of GiB"))?;
    if !(g > 0.0 && g.is_finite()) {
        return Err(format!("{s:?} must be a positive number of GiB"));
    }
    Ok(g * GIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed() -> Shapes {
        let c = serde_json::json!({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 100000,
            "torch_dtype": "bfloat16"});
        Shapes::from_config(&ModelConfig::from_json(&c).unwrap())
    }

    fn targets() -> Vec<String> {
        DEFAULT_TARGETS.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn seed_figures() {
        let s = seed();
        assert_eq!(s.kv_out, 1024);
        assert_eq!(gib(s.base_params() as f64 * 2.0), "14.53 GiB");
        assert_eq!(gib(100.0 * s.base_params() as f64 * 2.0), "1,453 GiB");
        for (r, want) in [(8, "40 MiB"), (16, "80 MiB"), (64, "320 MiB")] {
            assert_eq!(mib(s.adapter_params(r, &targets()).unwrap() as f64 * 2.0), want);
        }
        let slot = |n: u64, r: u64| gib(n as f64 * s.adapter_params(r, &targets()).unwrap() as f64 * 2.0);
        assert_eq!(slot(100, 16), "7.81 GiB");
        assert_eq!(slot(4, 16), "0.31 GiB");
        assert_eq!(slot(8, 16), "0.625 GiB");
        assert_eq!(slot(4, 64), "1.25 GiB");
        assert_eq!(slot(16, 64), "5.00 GiB");
        assert_eq!(s.kv_bytes_per_token(2), 131072);
    }

    #[test]
    fn embeddings_and_head_add_to_the_adapter() {
        let s = seed();
        let mut t = targets();
        let seven = s.adapter_params(16, &t).unwrap();
        t.push("embed_tokens".into());
        t.push("lm_head".into());
        assert_eq!(s.adapter_params(16, &t).unwrap(), seven + 2 * 16 * (100000 + 4096));
        assert!(s.adapter_params(16, &["nope".to_string()]).is_err());
    }

    /// The planner takes `config.json` from the engine's own reader: the same sizes as the adapter
    /// shapes, the same dtype as `--dtype auto`, the same refusals.
    #[test]
    fn plan_reads_config_json_as_the_engine_does() {
        let base = serde_json::json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
            "intermediate_size": 704, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": 1000});
        let with = |extra: serde_json::Value| {
            let mut v = base.clone();
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            v
        };
        let table = [
            (with(serde_json::json!({"torch_dtype": "bfloat16", "tie_word_embeddings": true})), 2, true),
            (with(serde_json::json!({"dtype": "float16"})), 2, false),
            (with(serde_json::json!({})), 4, false),
            (
                with(serde_json::json!({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})),
                4,
                false,
            ),
            (with(serde_json::json!({"model_type": "mistral", "sliding_window": 4096})), 4, false),
        ];
        for (json, bytes, tied) in table {
            let cfg = ModelConfig::from_json(&json).unwrap();
            let (s, m) = (Shapes::from_config(&cfg), cfg.shapes());
            let got = (s.layers, s.hidden, s.intermediate, s.vocab, s.q_out, s.kv_out);
            let want = (3, 256, 704, 1000, (m.num_heads * m.head_dim) as u64, (m.num_kv_heads * m.head_dim) as u64);
            assert_eq!(got, want, "{json}");
            assert_eq!((got.4, got.5), (512, 128), "{json}");
            assert_eq!((s.dtype_bytes, s.tied, m.tie_word_embeddings), (bytes, tied, tied), "{json}");
            assert_eq!(s.dtype_bytes as usize, cfg.auto_dtype().size_in_bytes(), "{json}");
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), with(serde_json::json!({"hidden_act": "relu"})).to_string())
            .unwrap();
        let e = load_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("hidden_act") && e.contains("relu"), "{e}");
    }

    #[test]
    fn memory_and_formatting() {
        assert_eq!(parse_memory("80GiB").unwrap(), 80.0 * GIB);
        assert_eq!(parse_memory("80").unwrap(), 80.0 * GIB);
        assert!(parse_memory("80TB").is_err());
        assert!(parse_memory("-1").is_err());
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(gib(GIB * 5.0), "5.00 GiB");
    }
}
