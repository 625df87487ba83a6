//! GGUF base models, as llama.cpp, Ollama and LM Studio users hold them: the header read with
//! candle's `gguf_file`, the metadata mapped onto the one [`ModelConfig`] reader (through a
//! `config.json`-shaped value, so every default and check is the same as for a Hugging Face
//! checkpoint), tensors found by their Hugging Face names and read with positioned reads, one at
//! a time, and the q / k rows of a llama-layout file put back in Hugging Face order, so adapters
//! trained on the Hugging Face model apply unchanged.
//!
//! Tensor types: F32, F16 and BF16 are read as tensors; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
//! Q2_K–Q6_K stay quantized ([`QuantWeight`]) or are dequantized as ggml does; anything else
//! (IQ*, TQ*, MXFP4, …) is refused when the file is opened, naming the tensor and its type.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use multilora_adapter::gguf::{ggml_type_name, scan_tensor_types, unpermute_rows};
use multilora_cpu::quant::QuantType;
use multilora_layers::{QuantWeight, quant_type};
use serde_json::json;

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{Error, Result};

/// An open GGUF model file: its header and metadata, and the file for reading tensors.
pub struct GgufFile {
    path: PathBuf,
    file: File,
    content: Content,
    file_len: u64,
    arch: String,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile").field("path", &self.path).field("architecture", &self.arch).finish()
    }
}

/// One tensor's bytes as stored (q / k rows already in Hugging Face order).
#[derive(Debug)]
pub(crate) struct RawTensor {
    pub(crate) dtype: GgmlDType,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: Vec<u8>,
}

impl GgufFile {
    /// Opens `path` and reads its header. A tensor of a type this engine cannot read, a file too
    /// short for its tensors, or a file that is not a model (a LoRA GGUF) is refused here.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        let bad = |reason: String| Error::Gguf { path: path.to_path_buf(), reason };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let mut reader = BufReader::new(File::open(path).map_err(io)?);
        let content = match Content::read(&mut reader) {
            Ok(c) => c,
            Err(e) => return Err(header_error(path, &mut reader, e)),
        };
        let file = reader.into_inner();
        let string = |key: &str| content.metadata.get(key).and_then(|v| v.to_string().ok()).cloned();
        if let Some(kind) = string("general.type").filter(|t| t != "model") {
            return Err(bad(format!(
                "general.type is {kind:?}: not a model (an adapter is given with --lora-modules)"
            )));
        }
        let arch = string("general.architecture").ok_or_else(|| bad("no general.architecture".into()))?;
        let gguf = GgufFile { path: path.to_path_buf(), file, content, file_len: meta.len(), arch };
        for (name, info) in &gguf.content.tensor_infos {
            gguf.check_tensor(name, info)?;
        }
        Ok(gguf)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `general.architecture`, e.g. `llama`.
    pub fn architecture(&self) -> &str {
        &self.arch
    }

    /// Every metadata entry, as candle reads it.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// A string entry.
    pub fn string(&self, key: &str) -> Option<&str> {
        self.content.metadata.get(key).and_then(|v| v.to_string().ok()).map(String::as_str)
    }

    /// An integer entry (any integer type).
    pub fn integer(&self, key: &str) -> Option<u64> {
        let v = self.content.metadata.get(key)?;
        v.to_u64().ok().or_else(|| v.to_i64().ok().and_then(|x| u64::try_from(x).ok()))
    }

    /// A number entry (any integer or float type).
    pub fn number(&self, key: &str) -> Option<f64> {
        match self.content.metadata.get(key)? {
            Value::F32(x) => Some(f64::from(*x)),
            Value::F64(x) => Some(*x),
            _ => self.integer(key).map(|x| x as f64),
        }
    }

    /// The chat template (`tokenizer.chat_template`), if the file carries one.
    pub fn chat_template(&self) -> Option<&str> {
        self.string("tokenizer.chat_template")
    }

    /// How many tensors of each type the file holds, e.g. `[("Q4_1", 210), ("F32", 61), ("Q8_0", 1)]`.
    pub fn tensor_types(&self) -> Vec<(String, usize)> {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for info in self.content.tensor_infos.values() {
            *counts.entry(format!("{:?}", info.ggml_dtype)).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = counts.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }

    /// The model's hyper-parameters, from the metadata (`{arch}.block_count`, …) mapped onto
    /// `config.json`'s names and read by [`ModelConfig`]'s one reader; Llama 3.1's precomputed
    /// `rope_freqs.weight` becomes [`RopeScaling::Factors`].
    pub fn config(&self) -> Result<ModelConfig> {
        let a = &self.arch;
        let model_type = match a.as_str() {
            "llama" | "qwen2" | "qwen3" | "mistral" | "phi3" => a.clone(),
            "gemma3" => "gemma3_text".to_string(),
            other => {
                return Err(self.bad(format!(
                    "general.architecture {other:?} is not served (llama, mistral, qwen2, qwen3, phi3 and gemma3 are)"
                )));
            }
        };
        let int = |key: &str| self.integer(&format!("{a}.{key}"));
        let heads = int("attention.head_count");
        let hidden = int("embedding_length");
        let head_dim = int("attention.key_length").or_else(|| Some(hidden? / heads?.max(1)));
        if let (Some(rot), Some(d)) = (int("rope.dimension_count"), head_dim)
            && rot != d
        {
            return Err(
                self.bad(format!("{a}.rope.dimension_count is {rot}: partial rotary over a head of {d} is not served"))
            );
        }
        // Linear scaling (Gemma 3 4B–27B: factor 8 on the full-attention layers, as llama.cpp
        // applies it) is the config's `rope_scaling`; any other kind is refused.
        let linear = match self.string(&format!("{a}.rope.scaling.type")).filter(|t| *t != "none") {
            None => None,
            Some("linear") => Some(self.number(&format!("{a}.rope.scaling.factor")).ok_or_else(|| {
                self.bad(format!("{a}.rope.scaling.type is \"linear\" but {a}.rope.scaling.factor is missing"))
            })?),
            Some(kind) => return Err(self.bad(format!("{a}.rope.scaling.type {kind:?} is not served"))),
        };
        let vocab = self.info("token_embd.weight").map(|i| i.shape.dims()[0]).or(int("vocab_size").map(|v| v as usize));
        let mut eos: Vec<u64> = Vec::new();
        for key in ["eos_token_id", "eot_token_id", "eom_token_id"] {
            if let Some(id) = self.integer(&format!("tokenizer.ggml.{key}"))
                && !eos.contains(&id)
            {
                eos.push(id);
            }
        }
        let gemma = a == "gemma3";
        let rope_scaling = match (self.long_rope()?, linear) {
            (serde_json::Value::Null, Some(factor)) => json!({"rope_type": "linear", "factor": factor}),
            (long, None) => long,
            (_, Some(_)) => return Err(self.bad("it has both linear rope scaling and LongRoPE factors".into())),
        };
        let value = json!({
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int("feed_forward_length"),
            "num_hidden_layers": int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": int("attention.head_count_kv").or(heads),
            "head_dim": head_dim,
            "vocab_size": vocab,
            "rms_norm_eps": self.number(&format!("{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": self.number(&format!("{a}.rope.freq_base")),
            "max_position_embeddings": int("context_length"),
            "sliding_window": int("attention.sliding_window"),
            "use_sliding_window": int("attention.sliding_window").is_some(),
            "tie_word_embeddings": self.info("output.weight").is_none(),
            "attention_bias": self.info("blk.0.attn_q.bias").is_some(),
            "hidden_act": if gemma { "gelu_pytorch_tanh" } else { "silu" },
            // What llama.cpp fixes for Gemma 3 rather than writes: the sliding layers' RoPE base
            // and a query scale of 1 / √head_dim, but for the 27B model (62 layers), whose is
            // 1 / √(hidden / heads); its every-sixth-layer pattern is the reader's default.
            "rope_local_base_freq": if gemma { Some(10_000.0) } else { None },
            "query_pre_attn_scalar": match (gemma, int("block_count")) {
                (false, _) => None,
                (true, Some(62)) => hidden.zip(heads).map(|(h, n)| h / n.max(1)),
                (true, _) => head_dim,
            },
            "bos_token_id": self.integer("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos,
            "rope_scaling": rope_scaling,
            "original_max_position_embeddings": int("rope.scaling.original_context_length"),
        });
        // `null` stands for absent: the reader's defaults apply.
        let value = serde_json::Value::Object(
            value
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        let mut cfg = ModelConfig::from_json_at(&value, &self.path)?;
        // llama.cpp's converter stores Gemma's norm weights as `1 + w` already.
        cfg.norm_offset = 0.0;
        if self.info("rope_freqs.weight").is_some() {
            let factors = self.read_dense("rope_freqs.weight", &[cfg.head_dim / 2])?.to_dtype(DType::F32)?.to_vec1()?;
            cfg.rope_scaling = RopeScaling::Factors(factors);
        }
        Ok(cfg)
    }

    /// Phi-3's LongRoPE as llama.cpp's converter writes it (`rope_factors_short.weight` and
    /// `rope_factors_long.weight`, `{arch}.rope.scaling.attn_factor`), in `config.json`'s form;
    /// `null` for a file without the factors, an error for a file with one set only.
    fn long_rope(&self) -> Result<serde_json::Value> {
        let (short, long) = (self.info("rope_factors_short.weight"), self.info("rope_factors_long.weight"));
        let (Some(short), Some(long)) = (short, long) else {
            return match short.or(long) {
                Some(_) => Err(self.bad("it has one of rope_factors_short / rope_factors_long only".into())),
                None => Ok(serde_json::Value::Null),
            };
        };
        let read = |name: &str, dims: &[usize]| -> Result<Vec<f32>> {
            Ok(self.read_dense(name, dims)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
        };
        let (s, l) = (short.shape.dims().to_vec(), long.shape.dims().to_vec());
        Ok(json!({
            "rope_type": "longrope",
            "short_factor": read("rope_factors_short.weight", &s)?,
            "long_factor": read("rope_factors_long.weight", &l)?,
            "attention_factor": self.number(&format!("{}.rope.scaling.attn_factor", self.arch)),
        }))
    }

    fn bad(&self, reason: String) -> Error {
        Error::Gguf { path: self.path.clone(), reason }
    }

    fn info(&self, gguf_name: &str) -> Option<&TensorInfo> {
        self.content.tensor_infos.get(gguf_name)
    }

    /// A tensor's byte length, checked to lie inside the file: before anything is allocated for it.
    fn check_tensor(&self, name: &str, info: &TensorInfo) -> Result<u64> {
        let dt = info.ggml_dtype;
        let elems = info.shape.elem_count();
        let row = info.shape.dims().last().copied().unwrap_or(1);
        if !row.is_multiple_of(dt.block_size()) {
            return Err(self
                .bad(format!("tensor {name}: rows of {row} values do not fill {dt:?} blocks of {}", dt.block_size())));
        }
        let bytes = (elems / dt.block_size()) as u64 * dt.type_size() as u64;
        let start = self.content.tensor_data_offset.saturating_add(info.offset);
        if start.saturating_add(bytes) > self.file_len {
            return Err(self.bad(format!(
                "tensor {name}: {bytes} bytes at {start} run past the end of the file ({} bytes): truncated?",
                self.file_len
            )));
        }
        if quant_type(dt).is_none() && !matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            return Err(Error::GgufTensorType { path: self.path.clone(), tensor: name.into(), ty: format!("{dt:?}") });
        }
        Ok(bytes)
    }

    /// Whether the file holds the tensor of Hugging Face name `hf`.
    pub(crate) fn contains(&self, hf: &str) -> bool {
        gguf_name(&self.arch, hf).is_some_and(|g| self.info(&g).is_some())
    }

    /// The shape of the tensor of Hugging Face name `hf`, `[out, in]` as PyTorch lays it out.
    pub(crate) fn shape(&self, hf: &str) -> Option<Vec<usize>> {
        self.info(&gguf_name(&self.arch, hf)?).map(|i| i.shape.dims().to_vec())
    }

    /// The bytes of the tensor of Hugging Face name `hf`, checked against `shape`, with the rows
    /// of a llama-layout q / k projection (and bias) put back in Hugging Face order.
    pub(crate) fn read_raw(&self, hf: &str, shape: &[usize], cfg: &ModelConfig) -> Result<RawTensor> {
        let missing = || Error::TensorMissing { tensor: hf.to_string(), dir: self.path.clone() };
        let name = gguf_name(&self.arch, hf).ok_or_else(missing)?;
        let info = self.info(&name).ok_or_else(missing)?;
        if info.shape.dims() != shape {
            return Err(Error::ShapeMismatch {
                tensor: name,
                got: info.shape.dims().to_vec(),
                expected: shape.to_vec(),
            });
        }
        let len = self.check_tensor(&name, info)?;
        let mut bytes = vec![0u8; len as usize];
        let mut f = &self.file;
        let io = |source| Error::Io { path: self.path.clone(), source };
        f.seek(SeekFrom::Start(self.content.tensor_data_offset + info.offset)).map_err(io)?;
        f.read_exact(&mut bytes).map_err(io)?;
        if let Some(heads) = self.permuted_heads(hf, cfg) {
            let rows = shape[0];
            let order = unpermute_rows(rows, heads)
                .ok_or_else(|| self.bad(format!("tensor {name}: {rows} rows do not split into {heads} heads")))?;
            let row_bytes = bytes.len() / rows;
            let mut out = vec![0u8; bytes.len()];
            for (dst, &src) in out.chunks_exact_mut(row_bytes).zip(&order) {
                dst.copy_from_slice(&bytes[src * row_bytes..][..row_bytes]);
            }
            bytes = out;
        }
        Ok(RawTensor { dtype: info.ggml_dtype, shape: shape.to_vec(), bytes })
    }

    /// For a llama-layout file, the heads a q / k weight or bias of `hf` is permuted over.
    fn permuted_heads(&self, hf: &str, cfg: &ModelConfig) -> Option<usize> {
        if self.arch != "llama" && self.arch != "mistral" {
            return None;
        }
        let proj = hf.rsplit('.').nth(1)?;
        match proj {
            "q_proj" => Some(cfg.num_heads),
            "k_proj" => Some(cfg.num_kv_heads),
            _ => None,
        }
    }

    /// A tensor of GGUF name `name` as a dense CPU tensor (dequantized as ggml does when stored
    /// quantized), no permutation: for the few tensors outside the Hugging Face names.
    fn read_dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let info =
            self.info(name).ok_or_else(|| Error::TensorMissing { tensor: name.into(), dir: self.path.clone() })?;
        if info.shape.dims() != shape {
            return Err(Error::ShapeMismatch {
                tensor: name.into(),
                got: info.shape.dims().to_vec(),
                expected: shape.to_vec(),
            });
        }
        let mut f = &self.file;
        Ok(self.content.tensor(&mut f, name, &Device::Cpu)?.dequantize(&Device::Cpu)?)
    }
}

impl RawTensor {
    /// Whether the bytes are one of the quantized types (kept as such unless dequantized).
    pub(crate) fn quant_type(&self) -> Option<QuantType> {
        quant_type(self.dtype)
    }

    /// A dense CPU tensor: F32 / F16 / BF16 as stored, a quantized type dequantized to f32 as
    /// ggml does it (candle's port of ggml's code).
    pub(crate) fn dense(self) -> Result<Tensor> {
        let dev = &Device::Cpu;
        Ok(match self.dtype {
            GgmlDType::F32 => Tensor::from_raw_buffer(&self.bytes, DType::F32, &self.shape, dev)?,
            GgmlDType::F16 => Tensor::from_raw_buffer(&self.bytes, DType::F16, &self.shape, dev)?,
            GgmlDType::BF16 => Tensor::from_raw_buffer(&self.bytes, DType::BF16, &self.shape, dev)?,
            dt => {
                let storage = QStorage::from_data(std::borrow::Cow::Owned(self.bytes), dev, dt)?;
                QTensor::new(storage, self.shape.as_slice())?.dequantize(dev)?
            }
        })
    }

    /// The quantized weight for the CPU kernels (`None` for F32 / F16 / BF16).
    pub(crate) fn quant(&self) -> Result<Option<QuantWeight>> {
        let Some(ty) = self.quant_type() else { return Ok(None) };
        let (n, k) = match self.shape.as_slice() {
            [n, k] => (*n, *k),
            other => {
                return Err(Error::ShapeMismatch {
                    tensor: "quantized weight".into(),
                    got: other.to_vec(),
                    expected: vec![0, 0],
                });
            }
        };
        Ok(Some(QuantWeight::from_bytes(ty, n, k, &self.bytes)?))
    }

    /// The quantized weight as a candle `QTensor` on `device` (the CUDA path's `QMatMul`).
    pub(crate) fn qtensor(self, device: &Device) -> Result<QTensor> {
        let storage = QStorage::from_data(std::borrow::Cow::Owned(self.bytes), device, self.dtype)?;
        Ok(QTensor::new(storage, self.shape.as_slice())?)
    }
}

/// Writes the GGUF model at `path` as a Hugging Face checkpoint in `dst` (what transformers
/// writes when it loads the file and saves it): every tensor under its Hugging Face name,
/// dequantized as ggml does, q / k rows in Hugging Face order, in `dtype`, as one
/// `model.safetensors`, and a `config.json`. For tests and benchmarks that compare the GGUF file
/// with its dequantized twin.
pub fn write_gguf_as_checkpoint(path: &Path, dst: &Path, dtype: DType) -> Result<()> {
    let gguf = GgufFile::open(path)?;
    let cfg = gguf.config()?;
    if let RopeScaling::Factors(_) = cfg.rope_scaling {
        return Err(gguf.bad("its rope_freqs factors have no config.json form".into()));
    }
    if gguf.arch == "gemma3" {
        return Err(gguf.bad("a gemma3 file's norms and layer types have no config.json form written here".into()));
    }
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| Error::Io { path: p, source }
    };
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let mut tensors = HashMap::new();
    for name in gguf.content.tensor_infos.keys() {
        let Some(hf) = hf_name(&gguf.arch, name) else { continue };
        let shape = gguf.shape(&hf).unwrap_or_default();
        let t = gguf.read_raw(&hf, &shape, &cfg)?.dense()?.to_dtype(dtype)?;
        tensors.insert(hf, t);
    }
    candle_core::safetensors::save(&tensors, dst.join("model.safetensors"))?;
    let torch_dtype = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let config = json!({
        "architectures": [cfg.architecture.class_name()],
        "model_type": cfg.architecture.model_type(),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "sliding_window": cfg.sliding_window,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids,
        "torch_dtype": torch_dtype,
        "rope_scaling": match &cfg.rope_scaling {
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::LongRope { short_factor, long_factor, attention_factor, .. } => json!({
                "rope_type": "longrope",
                "short_factor": short_factor,
                "long_factor": long_factor,
                "attention_factor": attention_factor,
            }),
            _ => serde_json::Value::Null,
        },
        "original_max_position_embeddings": match &cfg.rope_scaling {
            RopeScaling::LongRope { original_max_position_embeddings, .. } => Some(*original_max_position_embeddings),
            _ => None,
        },
    });
    let out = dst.join("config.json");
    std::fs::write(&out, config.to_string()).map_err(io(&out))?;
    Ok(())
}

/// Whole tensors whose names the two conventions spell differently.
const FIXED: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// A layer's modules (`model.layers.N.<module>.<param>`) and their GGUF stems
/// (`blk.N.<stem>.<param>`), in the Llama family.
const LAYER_STEMS: [(&str, &str); 11] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
];

/// Gemma 3's norms under llama.cpp's names: `ffn_norm` is its pre-MLP norm, and its output norms
/// have names of their own (in the Llama family `ffn_norm` is `post_attention_layernorm`).
const GEMMA3_NORMS: [(&str, &str); 3] = [
    ("post_attention_layernorm", "post_attention_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
];

/// Phi-3's fused projections: `ffn_up` holds its gate and up, gate first.
const PHI3_FUSED: [(&str, &str); 2] = [("self_attn.qkv_proj", "attn_qkv"), ("mlp.gate_up_proj", "ffn_up")];

/// The layer stems of architecture `arch`: its own first, so they win over the family's.
fn layer_stems(arch: &str) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    let own: &'static [(&str, &str)] = match arch {
        "gemma3" => &GEMMA3_NORMS,
        "phi3" => &PHI3_FUSED,
        _ => &[],
    };
    own.iter().chain(&LAYER_STEMS)
}

/// The Hugging Face name of a GGUF tensor name of architecture `arch` (the inverse of
/// [`gguf_name`]).
fn hf_name(arch: &str, gguf: &str) -> Option<String> {
    if let Some((hf, _)) = FIXED.iter().find(|(_, g)| *g == gguf) {
        return Some(hf.to_string());
    }
    let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let (stem, param) = rest.rsplit_once('.')?;
    let (module, _) = layer_stems(arch).find(|(_, g)| *g == stem)?;
    Some(format!("model.layers.{layer}.{module}.{param}"))
}

/// The GGUF name of a Hugging Face tensor name of architecture `arch` (its GGUF name).
pub(crate) fn gguf_name(arch: &str, hf: &str) -> Option<String> {
    if let Some((_, g)) = FIXED.iter().find(|(h, _)| *h == hf) {
        return Some(g.to_string());
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let (module, param) = rest.rsplit_once('.')?;
    let (_, stem) = layer_stems(arch).find(|(h, _)| *h == module)?;
    Some(format!("blk.{layer}.{stem}.{param}"))
}

/// candle refused the header: name the tensor when it was a type candle cannot read.
fn header_error<R: Read + Seek>(path: &Path, reader: &mut R, e: candle_core::Error) -> Error {
    let unreadable = scan_tensor_types(reader)
        .ok()
        .and_then(|types| types.into_iter().find(|(_, ty)| !matches!(ty, 0..=3 | 6..=15 | 30)));
    match unreadable {
        Some((tensor, ty)) => Error::GgufTensorType {
            path: path.to_path_buf(),
            tensor,
            ty: format!("{} (ggml type {ty})", ggml_type_name(ty)),
        },
        None => Error::Gguf { path: path.to_path_buf(), reason: format!("not a readable gguf file: {e}") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_names_map_to_ggml_names() {
        for (hf, g) in [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
            ("model.layers.12.self_attn.k_proj.bias", "blk.12.attn_k.bias"),
            ("model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"),
            ("model.layers.3.mlp.down_proj.weight", "blk.3.ffn_down.weight"),
            ("model.layers.29.input_layernorm.weight", "blk.29.attn_norm.weight"),
            ("model.layers.29.post_attention_layernorm.weight", "blk.29.ffn_norm.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ] {
            assert_eq!(gguf_name("llama", hf).as_deref(), Some(g), "{hf}");
            assert_eq!(hf_name("llama", g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(gguf_name("llama", "model.layers.0.self_attn.rotary_emb.inv_freq"), None);
        // Gemma 3's four norms a layer.
        for (hf, g) in [
            ("model.layers.2.input_layernorm.weight", "blk.2.attn_norm.weight"),
            ("model.layers.2.post_attention_layernorm.weight", "blk.2.post_attention_norm.weight"),
            ("model.layers.2.pre_feedforward_layernorm.weight", "blk.2.ffn_norm.weight"),
            ("model.layers.2.post_feedforward_layernorm.weight", "blk.2.post_ffw_norm.weight"),
            ("model.layers.2.self_attn.q_norm.weight", "blk.2.attn_q_norm.weight"),
        ] {
            assert_eq!(gguf_name("gemma3", hf).as_deref(), Some(g), "{hf}");
            assert_eq!(hf_name("gemma3", g).as_deref(), Some(hf), "{g}");
        }
        // Phi-3's fused projections.
        for (hf, g) in [
            ("model.layers.1.self_attn.qkv_proj.weight", "blk.1.attn_qkv.weight"),
            ("model.layers.1.mlp.gate_up_proj.weight", "blk.1.ffn_up.weight"),
            ("model.layers.1.self_attn.o_proj.weight", "blk.1.attn_output.weight"),
        ] {
            assert_eq!(gguf_name("phi3", hf).as_deref(), Some(g), "{hf}");
            assert_eq!(hf_name("phi3", g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(hf_name("llama", "blk.1.ffn_up.weight").as_deref(), Some("model.layers.1.mlp.up_proj.weight"));
    }
}
