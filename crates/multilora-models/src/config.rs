//! `ModelConfig`: a Hugging Face `config.json`, read once by one serde reader for everyone who
//! needs it — the model (its graph), the adapter shapes ([`ModelConfig::shapes`]), the engine
//! and the capacity planner — so they cannot disagree about a default.
//!
//! Llama 2/3, Mistral, Qwen2 and Qwen3 share one graph (RMSNorm, RoPE, GQA attention, SiLU MLP);
//! they differ only in what is filled in here: Qwen2 has q/k/v biases, Qwen3 an RMSNorm over each
//! query and key head before RoPE (`qk_norm`), Phi-3 stores q/k/v and gate/up fused
//! (`fused_projections`: `qkv_proj`, `gate_up_proj`), Llama 3 scales RoPE (`rope_type: llama3`),
//! Mistral and Phi-3 may declare a sliding window. Gemma 3 (`gemma3_text`) differs more and says so
//! in fields the graph reads: sliding and full layers (`layer_types`, or every sixth layer full)
//! with their own RoPE bases, `(1 + w)` RMSNorm weights (`norm_offset`), four norms a layer
//! (`sandwich_norms`), the embedding scaled by √hidden (`embed_scale`), GELU, the query scale of
//! `query_pre_attn_scalar`, and q/k norms. RoPE settings are read from
//! transformers 5's `rope_parameters` or the older top-level `rope_theta` / `rope_scaling`.
//! Errors name the file and the field (`serde_path_to_error` for type errors).

use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::DType;
use serde::Deserialize;

use multilora_adapter::ModelShapes;

/// The largest `config.json` read; real ones are a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Which member of the family a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2, Llama 3, and most fine-tunes).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`.
    Qwen2,
    /// `Qwen3ForCausalLM`.
    Qwen3,
    /// `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini's layout).
    Phi3,
    /// `Gemma3ForCausalLM` (`gemma3_text`: Gemma 3's text models).
    Gemma3,
}

impl Architecture {
    /// The Hugging Face class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma3 => "gemma3_text",
        }
    }

    /// Every architecture served.
    const ALL: [Architecture; 6] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Phi3,
        Architecture::Gemma3,
    ];

    fn from_model_type(t: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.model_type() == t)
    }

    fn from_class_name(c: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.class_name() == c)
    }
}

/// How RoPE frequencies are scaled. Exhaustive: a new type is a compile error in the model's
/// RoPE until it is implemented there.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Position interpolation (`rope_type: linear`): every frequency divided by `factor`, as if
    /// positions were `factor` times closer (Gemma 3 4B–27B, on their full-attention layers only).
    Linear {
        /// `factor`.
        factor: f64,
    },
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
    /// One divisor per rotary frequency (`head_dim / 2` of them): how llama.cpp's GGUF files
    /// carry Llama 3.1's scaling, precomputed (the `rope_freqs.weight` tensor).
    Factors(Vec<f32>),
    /// Phi-3's LongRoPE (`rope_type: longrope`): one divisor per rotary frequency for contexts of
    /// up to `original_max_position_embeddings` tokens (`short_factor`) and another beyond
    /// (`long_factor`), chosen per sequence by its context as transformers chooses by the
    /// sequence length of a call, and cos / sin scaled by `attention_factor`.
    LongRope {
        /// `short_factor`, `head_dim / 2` divisors.
        short_factor: Vec<f32>,
        /// `long_factor`, `head_dim / 2` divisors.
        long_factor: Vec<f32>,
        /// The context up to which the short factors apply.
        original_max_position_embeddings: usize,
        /// `attention_factor`, or `√(1 + ln s / ln original)` for `s = max_position_embeddings /
        /// original` above 1 (1 otherwise), as transformers computes it.
        attention_factor: f64,
    },
}

/// The MLP's activation (`hidden_act`). Exhaustive: a new activation is a compile error in the
/// model's forward until it is implemented there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiddenAct {
    /// SiLU (`silu`, also spelled `swish`): every Llama, Mistral and Qwen2 checkpoint.
    Silu,
    /// GELU with the exact erf (`gelu`).
    Gelu,
    /// GELU's tanh approximation (`gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`).
    GeluTanh,
}

/// Why a `config.json` was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not a regular file (a FIFO or a device would block or never end), or larger than
    /// [`MAX_CONFIG_BYTES`].
    #[error("{}: {reason}", path.display())]
    NotAConfigFile {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        reason: String,
    },
    /// Not JSON, or a field of the wrong type (the error names the field's path).
    #[error("{}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The field and what is wrong with it.
        #[source]
        source: serde_path_to_error::Error<serde_json::Error>,
    },
    /// A field is missing, or its value cannot work.
    #[error("{}: field {field:?} {reason}", path.display())]
    Field {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The architecture named by `config.json` is not one this engine implements.
    #[error("{}: field {field:?}: unsupported architecture {name:?} (supported: llama, mistral, qwen2, qwen3, phi3, gemma3_text)", path.display())]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// `model_type`, or `architectures` when it has none.
        field: &'static str,
        /// The value as written.
        name: String,
    },
    /// A RoPE scaling type this engine does not implement.
    #[error("{}: field \"rope_type\": unsupported rope scaling type {kind:?} (supported: default, linear, llama3, longrope)", path.display())]
    UnsupportedRopeScaling {
        /// The file.
        path: PathBuf,
        /// `rope_type` as written.
        kind: String,
    },
    /// An MLP activation this engine does not implement.
    #[error(
        "{}: field \"hidden_act\" is {name:?}, which is not supported (supported: silu, swish, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast)",
        path.display()
    )]
    UnsupportedActivation {
        /// The file.
        path: PathBuf,
        /// `hidden_act` as written.
        name: String,
    },
}

impl ConfigError {
    /// A stable snake_case label.
    pub fn kind(&self) -> &'static str {
        match self {
            ConfigError::Io { .. } => "io",
            ConfigError::NotAConfigFile { .. } | ConfigError::Json { .. } | ConfigError::Field { .. } => "config",
            ConfigError::UnsupportedArchitecture { .. } => "unsupported_architecture",
            ConfigError::UnsupportedRopeScaling { .. } => "unsupported_rope_scaling",
            ConfigError::UnsupportedActivation { .. } => "unsupported_activation",
        }
    }
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
    /// The MLP's activation.
    pub hidden_act: HiddenAct,
    /// Whether `lm_head` reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v carry a bias (Qwen2 always; Llama with `attention_bias`).
    pub attention_bias: bool,
    /// Whether each query and key head is RMS-normed (its own `[head_dim]` weight, `q_norm` /
    /// `k_norm`) before RoPE: Qwen3.
    pub qk_norm: bool,
    /// Whether the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    /// (Phi-3); its adapters then target those fused modules.
    pub fused_projections: bool,
    /// Longest position the model supports.
    pub max_position_embeddings: usize,
    /// The sliding window, when the config enables one: each position of a sliding layer attends
    /// to the last this many positions, itself included (every layer of Mistral, the sliding
    /// layers of Gemma 3: [`ModelConfig::layer_window`]).
    pub sliding_window: Option<usize>,
    /// Which layers slide (Gemma 3's `layer_types`); empty when every layer is alike.
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding layers when it differs from `rope_theta` (Gemma 3: 10,000 against
    /// the full layers' 1,000,000).
    pub rope_local_theta: Option<f64>,
    /// The query scale's `1 / √s` (Gemma's `query_pre_attn_scalar`); `None`: `1 / √head_dim`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Added to every RMSNorm weight of the checkpoint: 1 for Gemma, whose norms scale by
    /// `(1 + w)` (its GGUF files hold `1 + w` already: 0 there), else 0.
    pub norm_offset: f32,
    /// Gemma's four norms a layer: the attention's and the MLP's outputs are normed too
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`) before the residual add, and
    /// `pre_feedforward_layernorm` is the MLP's input norm.
    pub sandwich_norms: bool,
    /// What the embedding's rows are multiplied by (Gemma: √hidden); `None`: 1.
    pub embed_scale: Option<f32>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (several for Llama 3 instruct models).
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint was saved in (`torch_dtype`, or transformers 5's `dtype`), as
    /// written: `"bfloat16"`, `"float16"`, `"float32"`, …
    pub torch_dtype: Option<String>,
}

/// `config.json` as written: every field this engine reads, all optional here; defaults and
/// checks are applied by [`ModelConfig::from_raw`]. Unknown fields are ignored, as transformers does.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRopeParameters>,
    partial_rotary_factor: Option<f64>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_private: Option<usize>,
    query_pre_attn_scalar: Option<f64>,
    rope_local_base_freq: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    max_position_embeddings: Option<usize>,
    original_max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

/// transformers 5's `rope_parameters`: one set, or one per layer type (Gemma 3).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawRopeParameters {
    PerLayerType(std::collections::BTreeMap<String, RawRope>),
    One(RawRope),
}

/// `rope_scaling` or `rope_parameters`.
#[derive(Debug, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    partial_rotary_factor: Option<f64>,
    short_factor: Option<Vec<f64>>,
    long_factor: Option<Vec<f64>>,
    attention_factor: Option<f64>,
}

/// `eos_token_id`: one id or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// The text of a JSON config file: a regular file of at most [`MAX_CONFIG_BYTES`] (`metadata`
/// follows symlinks and does not open the file, so a FIFO cannot block here).
pub(crate) fn read_config_text(path: &Path) -> Result<String, ConfigError> {
    let io = |source| ConfigError::Io { path: path.to_path_buf(), source };
    let not = |reason: String| ConfigError::NotAConfigFile { path: path.to_path_buf(), reason };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(not("not a regular file".to_string()));
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(not(format!("{} bytes, more than the {MAX_CONFIG_BYTES} a config may have", meta.len())));
    }
    let mut text = String::new();
    std::fs::File::open(path).map_err(io)?.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text).map_err(io)?;
    Ok(text)
}

impl ModelConfig {
    /// Reads `config.json` from a file: a regular file of at most [`MAX_CONFIG_BYTES`].
    pub fn from_file(path: &Path) -> Result<ModelConfig, ConfigError> {
        ModelConfig::parse(&read_config_text(path)?, path)
    }

    /// Reads the text of a `config.json`; errors name `path`.
    pub fn parse(text: &str, path: &Path) -> Result<ModelConfig, ConfigError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let raw: RawConfig = serde_path_to_error::deserialize(de)
            .map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })?;
        ModelConfig::from_raw(raw, path)
    }

    /// Reads a parsed `config.json`; errors name the file `config.json`.
    pub fn from_json(value: &serde_json::Value) -> Result<ModelConfig, ConfigError> {
        ModelConfig::from_json_at(value, Path::new("config.json"))
    }

    /// Reads a `config.json`-shaped value that came from `path` (a GGUF file's metadata mapped
    /// onto Hugging Face's names, say), with the same defaults and checks; errors name `path`.
    pub fn from_json_at(value: &serde_json::Value, path: &Path) -> Result<ModelConfig, ConfigError> {
        let raw: RawConfig = serde_path_to_error::deserialize(value)
            .map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })?;
        ModelConfig::from_raw(raw, path)
    }

    /// The defaults of the family and the checks that the graph relies on.
    fn from_raw(raw: RawConfig, path: &Path) -> Result<ModelConfig, ConfigError> {
        let field =
            |field: &'static str, reason: String| ConfigError::Field { path: path.to_path_buf(), field, reason };
        let need = |v: Option<usize>, name: &'static str| v.ok_or_else(|| field(name, "is missing".to_string()));
        let architecture = match (&raw.model_type, raw.architectures.as_ref().and_then(|a| a.first())) {
            // `model_type` decides when present; `architectures` is the fallback.
            (Some(t), _) => Architecture::from_model_type(t).ok_or_else(|| ConfigError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                field: "model_type",
                name: t.clone(),
            })?,
            (None, Some(c)) => {
                Architecture::from_class_name(c).ok_or_else(|| ConfigError::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    field: "architectures",
                    name: c.clone(),
                })?
            }
            (None, None) => {
                return Err(field("model_type", "is missing, and so is architectures".to_string()));
            }
        };
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        if hidden_size == 0 {
            return Err(field("hidden_size", "must be positive".to_string()));
        }
        if num_heads == 0 {
            return Err(field("num_attention_heads", "must be positive".to_string()));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(field(
                "num_key_value_heads",
                format!("is {num_kv_heads}, which does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = raw.head_dim.unwrap_or(hidden_size / num_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(field("head_dim", format!("is {head_dim}; RoPE needs it positive and even")));
        }
        // The query width (and so every key width: num_key_value_heads divides the heads).
        if num_heads.checked_mul(head_dim).is_none() {
            return Err(field(
                "head_dim",
                format!("is {head_dim}; num_attention_heads {num_heads} heads of it overflow"),
            ));
        }
        // Per layer type (Gemma 3): the full layers' set is the model's, the sliding layers' gives
        // their own base.
        let (params, local_params) = match &raw.rope_parameters {
            Some(RawRopeParameters::One(p)) => (Some(p), None),
            Some(RawRopeParameters::PerLayerType(m)) => {
                let full = m.get("full_attention").ok_or_else(|| {
                    field("rope_parameters", "has sets per layer type but none for full_attention".to_string())
                })?;
                (Some(full), m.get("sliding_attention"))
            }
            None => (None, None),
        };
        let rope = params.or(raw.rope_scaling.as_ref());
        let rope_theta = params
            .and_then(|p| p.rope_theta)
            .or(raw.rope_theta)
            .or_else(|| raw.rope_scaling.as_ref().and_then(|p| p.rope_theta))
            .unwrap_or(10_000.0);
        if let Some(p) = local_params
            && rope_scaling(p, &raw, head_dim, path)? != RopeScaling::Default
        {
            return Err(field("rope_parameters", "scales the sliding layers' RoPE, which is not served".to_string()));
        }
        let rope_local_theta = local_params.and_then(|p| p.rope_theta).or(raw.rope_local_base_freq);
        let rope_scaling = match rope {
            Some(p) => rope_scaling(p, &raw, head_dim, path)?,
            None => RopeScaling::Default,
        };
        // Phi-4-mini rotates three quarters of each head: refused rather than rotated whole.
        if let Some(f) = rope.and_then(|p| p.partial_rotary_factor).or(raw.partial_rotary_factor)
            && f != 1.0
        {
            return Err(field("partial_rotary_factor", format!("is {f}; only whole heads are rotated (1.0)")));
        }
        let gemma = architecture == Architecture::Gemma3;
        // Gemma names it `hidden_activation` (tanh GELU when absent).
        let act_name = match (&raw.hidden_activation, gemma) {
            (Some(a), _) => Some(a.as_str()),
            (None, true) => raw.hidden_act.as_deref().or(Some("gelu_pytorch_tanh")),
            (None, false) => raw.hidden_act.as_deref(),
        };
        let hidden_act = match act_name {
            None | Some("silu") | Some("swish") => HiddenAct::Silu,
            Some("gelu") => HiddenAct::Gelu,
            Some("gelu_new") | Some("gelu_pytorch_tanh") | Some("gelu_fast") => HiddenAct::GeluTanh,
            Some(other) => {
                return Err(ConfigError::UnsupportedActivation { path: path.to_path_buf(), name: other.to_string() });
            }
        };
        let attention_bias = raw.attention_bias.unwrap_or(architecture == Architecture::Qwen2);
        for (name, v) in [
            ("attn_logit_softcapping", raw.attn_logit_softcapping),
            ("final_logit_softcapping", raw.final_logit_softcapping),
        ] {
            if let Some(cap) = v {
                return Err(field(name, format!("is {cap}: logit soft-capping (Gemma 2) is not served")));
            }
        }
        let num_layers = need(raw.num_hidden_layers, "num_hidden_layers")?;
        let sliding_layers = match (&raw.layer_types, gemma) {
            (Some(types), _) => {
                if types.len() != num_layers {
                    return Err(field(
                        "layer_types",
                        format!("has {} entries for num_hidden_layers {num_layers}", types.len()),
                    ));
                }
                let kind = |t: &String| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => {
                        Err(field("layer_types", format!("names {other:?} (sliding_attention or full_attention)")))
                    }
                };
                let sliding = types.iter().map(kind).collect::<Result<Vec<bool>, _>>()?;
                if sliding.windows(2).all(|w| w[0] == w[1]) && !gemma { Vec::new() } else { sliding }
            }
            // Gemma 3 without `layer_types`: every sixth layer is full.
            (None, true) => {
                let pattern = raw.sliding_window_pattern.or(raw.sliding_window_pattern_private).unwrap_or(6).max(1);
                (0..num_layers).map(|l| (l + 1) % pattern != 0).collect()
            }
            (None, false) => Vec::new(),
        };
        let sliding_window = match architecture {
            // Qwen configs carry `sliding_window` even when `use_sliding_window` is false.
            Architecture::Qwen2 | Architecture::Qwen3 if !raw.use_sliding_window.unwrap_or(false) => None,
            _ => raw.sliding_window,
        };
        let eos_token_ids = match raw.eos_token_id {
            Some(TokenIds::One(id)) => vec![id],
            Some(TokenIds::Many(ids)) => ids,
            None => Vec::new(),
        };
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            hidden_act,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            attention_bias,
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            fused_projections: architecture == Architecture::Phi3,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            sliding_window,
            sliding_layers,
            rope_local_theta,
            query_pre_attn_scalar: raw.query_pre_attn_scalar,
            norm_offset: if gemma { 1.0 } else { 0.0 },
            sandwich_norms: gemma,
            embed_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
            torch_dtype: raw.torch_dtype.or(raw.dtype),
        })
    }

    /// The sizes adapters are validated against (without the embedding digest, which needs the
    /// weights: the loaded model's shapes carry it).
    pub fn shapes(&self) -> ModelShapes {
        let mut s = ModelShapes::llama(
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
        s.fused_projections = self.fused_projections;
        s
    }

    /// The longest sequence the forward accepts: `max_position_embeddings` (a sliding window is
    /// applied in attention, not as a cap).
    pub fn max_model_len(&self) -> usize {
        self.max_position_embeddings
    }

    /// The checkpoint's own dtype, when the config names one this engine serves in.
    pub fn checkpoint_dtype(&self) -> Option<DType> {
        match self.torch_dtype.as_deref()? {
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "half" | "f16" => Some(DType::F16),
            "float32" | "float" | "f32" => Some(DType::F32),
            _ => None,
        }
    }

    /// The dtype `--dtype auto` serves the checkpoint in on a GPU, and the one the planner sizes
    /// weights with: the checkpoint's own, f32 when it names none (transformers' default).
    pub fn auto_dtype(&self) -> DType {
        self.checkpoint_dtype().unwrap_or(DType::F32)
    }

    /// The window layer `l` attends within, if any.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        let w = self.sliding_window.filter(|&w| w > 0)?;
        (self.sliding_layers.is_empty() || self.sliding_layers.get(l).copied().unwrap_or(false)).then_some(w)
    }

    /// Whether some layers slide and others attend to the whole context (Gemma 3).
    pub fn mixed_windows(&self) -> bool {
        self.sliding_window.is_some_and(|w| w > 0) && self.sliding_layers.iter().any(|&s| !s)
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

fn rope_scaling(p: &RawRope, raw: &RawConfig, head_dim: usize, path: &Path) -> Result<RopeScaling, ConfigError> {
    let kind = p.rope_type.as_deref().or(p.legacy_type.as_deref()).unwrap_or("default");
    let field = |field: &'static str, reason: String| ConfigError::Field { path: path.to_path_buf(), field, reason };
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => match p.factor {
            Some(factor) if factor.is_finite() && factor > 0.0 => Ok(RopeScaling::Linear { factor }),
            Some(factor) => Err(field("factor", format!("is {factor}; linear rope scaling needs a positive one"))),
            None => Err(field("factor", "is missing; linear rope scaling needs it".into())),
        },
        "longrope" => {
            let factors = |v: &Option<Vec<f64>>, name: &'static str| -> Result<Vec<f32>, ConfigError> {
                let v = v.as_ref().ok_or_else(|| field(name, "is missing; longrope needs it".into()))?;
                if v.len() != head_dim / 2 || v.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
                    return Err(field(
                        name,
                        format!("has {} values; longrope needs {} positive ones (head_dim / 2)", v.len(), head_dim / 2),
                    ));
                }
                Ok(v.iter().map(|&f| f as f32).collect())
            };
            let original = raw
                .original_max_position_embeddings
                .or(p.original_max_position_embeddings.map(|v| v as usize))
                .filter(|&o| o > 1)
                .ok_or_else(|| field("original_max_position_embeddings", "is missing; longrope needs it".into()))?;
            let scale = raw.max_position_embeddings.unwrap_or(original) as f64 / original as f64;
            let attention_factor = match p.attention_factor {
                Some(f) => f,
                None if scale > 1.0 => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
                None => 1.0,
            };
            Ok(RopeScaling::LongRope {
                short_factor: factors(&p.short_factor, "short_factor")?,
                long_factor: factors(&p.long_factor, "long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            })
        }
        "llama3" => {
            let need = |v: Option<f64>, field: &'static str| {
                v.ok_or_else(|| ConfigError::Field {
                    path: path.to_path_buf(),
                    field,
                    reason: "is missing; llama3 rope scaling needs it".to_string(),
                })
            };
            Ok(RopeScaling::Llama3 {
                factor: need(p.factor, "factor")?,
                low_freq_factor: need(p.low_freq_factor, "low_freq_factor")?,
                high_freq_factor: need(p.high_freq_factor, "high_freq_factor")?,
                original_max_position_embeddings: need(
                    p.original_max_position_embeddings,
                    "original_max_position_embeddings",
                )? as usize,
            })
        }
        other => Err(ConfigError::UnsupportedRopeScaling { path: path.to_path_buf(), kind: other.to_string() }),
    }
}

mod generation;
pub use generation::GenerationConfig;

#[cfg(test)]
mod tests;
