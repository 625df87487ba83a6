//! `ModelConfig`: the parts of a Hugging Face `config.json` a Llama-family decoder needs.
//!
//! Llama 2/3, Mistral and Qwen2 share one graph (RMSNorm, RoPE, GQA attention, SiLU MLP); they
//! differ only in defaults that this file fills in: Qwen2 has q/k/v biases, Llama 3 scales RoPE
//! (`rope_type: llama3`), Mistral may declare a sliding window.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// Which member of the family a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2, Llama 3, and most fine-tunes).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`.
    Qwen2,
}

impl Architecture {
    /// The Hugging Face class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
        }
    }
}

/// How RoPE frequencies are scaled.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// `factor`.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: usize,
    },
}

/// A decoder's hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ModelConfig {
    /// The architecture.
    pub architecture: Architecture,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP intermediate size.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Whether `lm_head` reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v carry a bias (Qwen2 always; Llama with `attention_bias`).
    pub attention_bias: bool,
    /// Longest position the model supports.
    pub max_position_embeddings: usize,
    /// Mistral's sliding window, when the config enables one. The forward refuses a sequence whose
    /// context exceeds it instead of silently attending further (see [`ModelConfig::max_model_len`]).
    pub sliding_window: Option<usize>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (several for Llama 3 instruct models).
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint was saved in (`torch_dtype`, or transformers 5's `dtype`), as
    /// written: `"bfloat16"`, `"float16"`, `"float32"`, …
    pub torch_dtype: Option<String>,
}

impl ModelConfig {
    /// The sizes adapters are validated against (without the embedding digest, which needs the
    /// weights: the loaded [`crate::Model::shapes`] carries it).
    pub fn shapes(&self) -> multilora_layers::ModelShapes {
        let mut s = multilora_layers::ModelShapes::llama(
            self.num_layers,
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.num_heads,
            self.num_kv_heads,
        );
        s.architecture = self.architecture.class_name().to_string();
        s.model_type = self.architecture.model_type().to_string();
        s.head_dim = self.head_dim;
        s.tie_word_embeddings = self.tie_word_embeddings;
        s
    }

    /// Reads `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config { path: path.to_path_buf(), reason: format!("not valid JSON: {e}") })?;
        ModelConfig::from_json(&value).map_err(|e| match e {
            Error::Config { reason, .. } => Error::Config { path: path.to_path_buf(), reason },
            other => other,
        })
    }

    /// Reads a parsed `config.json`. Config errors carry the path `config.json`.
    pub fn from_json(v: &Value) -> Result<ModelConfig> {
        let bad = |reason: String| Error::Config { path: "config.json".into(), reason };
        let architecture = architecture(v)?;
        let int = |key: &str| -> Result<Option<usize>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| bad(format!("field {key:?} is not a non-negative integer: {x}"))),
            }
        };
        let need = |key: &str| int(key)?.ok_or_else(|| bad(format!("field {key:?} is missing")));
        let float = |key: &str| -> Result<Option<f64>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_f64().map(Some).ok_or_else(|| bad(format!("field {key:?} is not a number: {x}"))),
            }
        };
        let hidden_size = need("hidden_size")?;
        let num_heads = need("num_attention_heads")?;
        if num_heads == 0 || hidden_size == 0 {
            return Err(bad("hidden_size and num_attention_heads must be positive".into()));
        }
        let num_kv_heads = int("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(bad(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let head_dim = int("head_dim")?.unwrap_or(hidden_size / num_heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!("head_dim {head_dim} must be positive and even for RoPE")));
        }
        // transformers 5 writes RoPE settings in `rope_parameters`; older configs use the top-level
        // `rope_theta` and `rope_scaling`. Either is accepted, the nested one first.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_scaling_obj = v.get("rope_scaling").filter(|p| p.is_object());
        let rope_theta = rope_params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(float("rope_theta")?)
            .or_else(|| rope_scaling_obj.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64))
            .unwrap_or(10_000.0);
        let rope_scaling = match rope_params.or(rope_scaling_obj) {
            Some(p) => rope_scaling(p, &bad)?,
            None => RopeScaling::Default,
        };
        let max_position_embeddings = int("max_position_embeddings")?.unwrap_or(4096);
        let attention_bias = match architecture {
            Architecture::Qwen2 => v.get("attention_bias").and_then(Value::as_bool).unwrap_or(true),
            _ => v.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
        };
        let sliding_window = match architecture {
            // Qwen2 configs carry `sliding_window` even when `use_sliding_window` is false.
            Architecture::Qwen2 if !v.get("use_sliding_window").and_then(Value::as_bool).unwrap_or(false) => None,
            _ => int("sliding_window")?,
        };
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            None => Vec::new(),
        };
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_layers: need("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: need("vocab_size")?,
            rms_norm_eps: float("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            attention_bias,
            max_position_embeddings,
            sliding_window,
            bos_token_id: int("bos_token_id")?.map(|x| x as u32),
            eos_token_ids,
            torch_dtype: v.get("torch_dtype").or_else(|| v.get("dtype")).and_then(Value::as_str).map(str::to_string),
        })
    }

    /// The longest sequence the forward accepts: `max_position_embeddings`, or the sliding window
    /// when one is set and smaller (the window is not implemented, so longer contexts are refused).
    pub fn max_model_len(&self) -> usize {
        match self.sliding_window {
            Some(w) if w > 0 => w.min(self.max_position_embeddings),
            _ => self.max_position_embeddings,
        }
    }

    /// The checkpoint's own dtype, when the config names one this engine serves in.
    pub fn checkpoint_dtype(&self) -> Option<candle_core::DType> {
        use candle_core::DType;
        match self.torch_dtype.as_deref()? {
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "half" | "f16" => Some(DType::F16),
            "float32" | "float" | "f32" => Some(DType::F32),
            _ => None,
        }
    }

    /// Width of the query projection, `num_heads · head_dim`.
    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key (or value) projection, `num_kv_heads · head_dim`.
    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn architecture(v: &Value) -> Result<Architecture> {
    let model_type = v.get("model_type").and_then(Value::as_str);
    let class = v.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str);
    let from_type = |t: &str| match t {
        "llama" => Some(Architecture::Llama),
        "mistral" => Some(Architecture::Mistral),
        "qwen2" => Some(Architecture::Qwen2),
        _ => None,
    };
    let from_class = |c: &str| match c {
        "LlamaForCausalLM" => Some(Architecture::Llama),
        "MistralForCausalLM" => Some(Architecture::Mistral),
        "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
        _ => None,
    };
    // `model_type` decides when present; `architectures` is the fallback for configs without it.
    if let Some(t) = model_type {
        return from_type(t).ok_or_else(|| Error::UnsupportedArchitecture { name: t.to_string() });
    }
    match class {
        Some(c) => from_class(c).ok_or_else(|| Error::UnsupportedArchitecture { name: c.to_string() }),
        None => Err(Error::Config {
            path: "config.json".into(),
            reason: "neither model_type nor architectures is given".into(),
        }),
    }
}

fn rope_scaling(p: &Value, bad: &dyn Fn(String) -> Error) -> Result<RopeScaling> {
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok(RopeScaling::Default),
        "llama3" => {
            let f = |key: &str| {
                p.get(key).and_then(Value::as_f64).ok_or_else(|| bad(format!("llama3 rope scaling needs {key:?}")))
            };
            Ok(RopeScaling::Llama3 {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            })
        }
        other => Err(Error::UnsupportedRopeScaling { kind: other.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100})
    }

    #[test]
    fn reads_rope_from_either_place() {
        let mut v = base();
        v["rope_parameters"] = json!({"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.rope_theta, 5e5);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { .. }));
        let mut v = base();
        v["rope_theta"] = json!(1e6);
        v["rope_scaling"] = Value::Null;
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!((c.rope_theta, c.head_dim, c.rope_scaling.clone()), (1e6, 16, RopeScaling::Default));
    }

    #[test]
    fn names_what_it_refuses() {
        let mut v = base();
        v["model_type"] = json!("gpt2");
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert_eq!(e.kind(), "unsupported_architecture");
        assert!(e.to_string().contains("gpt2"));
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
        let mut v = base();
        v.as_object_mut().unwrap().remove("vocab_size");
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("vocab_size"));
    }

    #[test]
    fn qwen2_has_qkv_bias_and_no_window_by_default() {
        let mut v = base();
        v["model_type"] = json!("qwen2");
        v["sliding_window"] = json!(32);
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(c.attention_bias);
        assert_eq!(c.sliding_window, None);
        v["model_type"] = json!("mistral");
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!((c.attention_bias, c.max_model_len()), (false, 32));
    }

    #[test]
    fn checkpoint_dtype_from_either_key() {
        use candle_core::DType;
        let mut v = base();
        assert_eq!(ModelConfig::from_json(&v).unwrap().checkpoint_dtype(), None);
        v["torch_dtype"] = json!("bfloat16");
        assert_eq!(ModelConfig::from_json(&v).unwrap().checkpoint_dtype(), Some(DType::BF16));
        let mut v = base();
        v["dtype"] = json!("float16");
        assert_eq!(ModelConfig::from_json(&v).unwrap().checkpoint_dtype(), Some(DType::F16));
        v["dtype"] = json!("float8_e4m3fn");
        assert_eq!(ModelConfig::from_json(&v).unwrap().checkpoint_dtype(), None);
    }
}
