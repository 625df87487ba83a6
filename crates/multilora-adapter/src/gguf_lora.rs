//! llama.cpp's LoRA files: a GGUF written by `convert_lora_to_gguf.py` (`general.type = adapter`,
//! `adapter.type = lora`, `adapter.lora.alpha`; tensors `blk.N.attn_q.weight.lora_a` `[r, in]` and
//! `….lora_b` `[out, r]`), read into the same [`LoraAdapter`] a PEFT directory gives.
//!
//! - The scale is llama.cpp's: `alpha / rank` per tensor pair (`1` when the file has no alpha).
//!   The converter drops `use_rslora`, and llama.cpp applies the file the same way, so this is the
//!   adapter a llama.cpp user has.
//! - For a llama-layout base the converter permutes the rows of the q and k `lora_b` as it does
//!   the base weights (for ggml's RoPE); they are put back in Hugging Face order, so the adapter
//!   applies to the model as transformers lays it out.
//! - Every tensor is checked against the base model's shapes and `max_lora_rank` before it is
//!   read; a type candle cannot read is refused naming the tensor and its type.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};
use multilora_types::{Fingerprint, MAX_LORA_RANK_CEILING, ModuleKind};

use crate::adapter::{LoraAdapter, LoraModule, Unheld};
use crate::config::AdapterConfig;
use crate::error::{Error, Result};
use crate::gguf::{ggml_type_name, module_of, scan_tensor_types, unpermute_rows};
use crate::load::{ConfigSummary, LoadOptions, ModuleSetting};
use crate::module::ModuleId;
use crate::shapes::ModelShapes;

const FINGERPRINT_DOMAIN: &[u8] = b"multilora/adapter-fingerprint/gguf-lora/v1\0";

/// One module of the file: its tensors and what the file gives it.
#[derive(Clone, Debug)]
struct Planned {
    a: String,
    b: String,
    setting: ModuleSetting,
}

/// An open LoRA GGUF: the file, its header, and each module's tensors, checked.
struct Opened {
    reader: BufReader<File>,
    content: Content,
    config: AdapterConfig,
    modules: BTreeMap<ModuleId, Planned>,
}

/// Reads and checks the header of a LoRA GGUF without reading any tensor: its ranks and targets
/// (for sizing slots at start-up).
pub fn read_gguf_lora_config(
    name: &str,
    path: &Path,
    shapes: &ModelShapes,
    opts: &LoadOptions,
) -> Result<ConfigSummary> {
    let opened = open(name, path, shapes, opts)?;
    let modules = opened.modules.iter().map(|(id, p)| (*id, p.setting)).collect();
    Ok(ConfigSummary { config: opened.config, modules })
}

/// Loads the LoRA GGUF at `path` for a model of `shapes`.
pub fn load_gguf_lora(name: &str, path: &Path, shapes: &ModelShapes, opts: &LoadOptions) -> Result<LoraAdapter> {
    let Opened { mut reader, content, config, modules: planned } = open(name, path, shapes, opts)?;
    let candle = |op: String, e: candle_core::Error| Error::Candle { adapter: name.into(), op, source: Box::new(e) };
    let mut hasher = blake3::Hasher::new();
    hasher.update(FINGERPRINT_DOMAIN);
    let mut modules = BTreeMap::new();
    for (id, p) in &planned {
        let read = |reader: &mut BufReader<File>, tensor: &str| -> Result<Tensor> {
            let t = content
                .tensor(reader, tensor, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .map_err(|e| candle(format!("read {tensor}"), e))?;
            let finite = t
                .abs()
                .and_then(|t| t.max_all())
                .and_then(|m| m.to_scalar::<f32>())
                .map_err(|e| candle(format!("check {tensor}"), e))?
                .is_finite();
            if !finite {
                return Err(Error::NonFinite { adapter: name.into(), path: path.into(), tensor: tensor.into() });
            }
            Ok(t)
        };
        let a = read(&mut reader, &p.a)?;
        let mut b = read(&mut reader, &p.b)?;
        if let Some(order) = hf_row_order(id.kind, shapes) {
            let index = Tensor::from_vec(order, b.dim(0).unwrap_or(0), &Device::Cpu)
                .and_then(|i| b.index_select(&i, 0))
                .map_err(|e| candle(format!("un-permute the rows of {}", p.b), e))?;
            b = index;
        }
        let s = p.setting;
        hasher.update(id.peft_name().as_bytes());
        hasher.update(&[0]);
        hasher.update(&(s.rank as u64).to_le_bytes());
        hasher.update(&s.scaling.to_le_bytes());
        for t in [&a, &b] {
            let bytes =
                t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| candle("fingerprint".to_string(), e))?;
            for v in bytes {
                hasher.update(&v.to_le_bytes());
            }
        }
        let module = LoraModule::held(&a, &b, (s.rank, s.alpha, s.scaling), opts.dtype).map_err(|u| {
            let non_finite = |tensor| Error::NonFinite { adapter: name.into(), path: path.into(), tensor };
            match u {
                Unheld::A => non_finite(format!("{} in {:?}", p.a, opts.dtype)),
                Unheld::B => non_finite(format!("{} scaled by {:e} in {:?}", p.b, s.scaling, opts.dtype)),
                Unheld::Candle(op, e) => candle(op.to_string(), e),
            }
        })?;
        modules.insert(*id, module);
    }
    let fingerprint = Fingerprint(*hasher.finalize().as_bytes());
    Ok(LoraAdapter::new(name, config, modules, fingerprint))
}

/// For a llama-layout base, the stored row of each Hugging Face row of a q / k `lora_b`.
fn hf_row_order(kind: ModuleKind, shapes: &ModelShapes) -> Option<Vec<u32>> {
    if shapes.model_type != "llama" {
        return None;
    }
    let (heads, rows) = match kind {
        ModuleKind::QProj => (shapes.num_heads, shapes.num_heads * shapes.head_dim),
        ModuleKind::KProj => (shapes.num_kv_heads, shapes.num_kv_heads * shapes.head_dim),
        _ => return None,
    };
    unpermute_rows(rows, heads).map(|o| o.into_iter().map(|i| i as u32).collect())
}

/// Opens the file, reads its header with candle, and checks it: an adapter of LoRA type for this
/// architecture, every tensor a `lora_a` / `lora_b` pair of a module of the base model with the
/// right shapes and a rank within bounds.
fn open(name: &str, path: &Path, shapes: &ModelShapes, opts: &LoadOptions) -> Result<Opened> {
    let io = |source| Error::Io { adapter: name.into(), path: path.into(), source };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        let not = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
        return Err(io(not));
    }
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let content = match Content::read(&mut reader) {
        Ok(c) => c,
        Err(e) => return Err(header_error(name, path, &mut reader, e)),
    };
    let invalid = |reason: String| Error::ConfigInvalid { adapter: name.into(), path: path.into(), reason };
    let string = |key: &str| content.metadata.get(key).and_then(|v| v.to_string().ok()).cloned();
    if string("general.type").as_deref() != Some("adapter") {
        return Err(invalid(format!(
            "general.type is {:?}, not \"adapter\": this is not a LoRA file (a base model?)",
            string("general.type").unwrap_or_default()
        )));
    }
    if let Some(kind) = string("adapter.type").filter(|k| k != "lora") {
        return Err(Error::Unsupported {
            adapter: name.into(),
            path: path.into(),
            feature: format!("adapter.type {kind}"),
            reason: "only LoRA adapters are served".into(),
        });
    }
    let arch = string("general.architecture").unwrap_or_default();
    if arch != shapes.gguf_architecture() {
        return Err(Error::BaseModelMismatch {
            adapter: name.into(),
            base: arch.clone(),
            found: format!("general.architecture {arch:?}"),
            expected: format!("{} ({})", shapes.architecture, shapes.model_type),
        });
    }
    let alpha = match content.metadata.get("adapter.lora.alpha") {
        None => None,
        Some(v) => Some(
            number(v)
                .filter(|a| a.is_finite())
                .ok_or_else(|| invalid(format!("adapter.lora.alpha is {v:?}, not a finite number")))?,
        ),
    };
    let modules = plan(name, path, &content, shapes, opts, alpha)?;
    let config = synthesized_config(&modules, alpha).map_err(invalid)?;
    Ok(Opened { reader, content, config, modules })
}

/// Each module's tensors and setting, every shape and rank checked.
fn plan(
    name: &str,
    path: &Path,
    content: &Content,
    shapes: &ModelShapes,
    opts: &LoadOptions,
    alpha: Option<f64>,
) -> Result<BTreeMap<ModuleId, Planned>> {
    let unexpected = |tensor: &str, reason: &str| Error::TensorUnexpected {
        adapter: name.into(),
        path: path.into(),
        tensor: tensor.into(),
        reason: reason.into(),
    };
    let mut pairs: BTreeMap<ModuleId, (Option<String>, Option<String>)> = BTreeMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for tensor in names {
        let (base, is_a) = match (tensor.strip_suffix(".lora_a"), tensor.strip_suffix(".lora_b")) {
            (Some(base), _) => (base, true),
            (_, Some(base)) => (base, false),
            _ => return Err(unexpected(tensor, "a LoRA GGUF holds only .lora_a and .lora_b tensors")),
        };
        let module =
            module_of(base).ok_or_else(|| Error::UnsupportedModule { adapter: name.into(), module: base.into() })?;
        if module.kind == ModuleKind::EmbedTokens {
            return Err(Error::Unsupported {
                adapter: name.into(),
                path: path.into(),
                feature: tensor.clone(),
                reason: "LoRA on token_embd from a GGUF file is not supported; use the PEFT adapter".into(),
            });
        }
        if !shapes.contains(module) {
            return Err(unexpected(tensor, "the base model has no such module"));
        }
        let entry = pairs.entry(module).or_default();
        if is_a { entry.0 = Some(tensor.clone()) } else { entry.1 = Some(tensor.clone()) }
    }
    if pairs.is_empty() {
        return Err(Error::ConfigInvalid { adapter: name.into(), path: path.into(), reason: "no lora tensors".into() });
    }
    let max = opts.max_lora_rank.map_or(MAX_LORA_RANK_CEILING, |m| m.min(MAX_LORA_RANK_CEILING));
    let mut planned = BTreeMap::new();
    for (id, (a, b)) in pairs {
        let stem = crate::gguf::gguf_name(id);
        let a = a.ok_or_else(|| missing(name, path, &format!("{stem}.lora_a")))?;
        let b = b.ok_or_else(|| missing(name, path, &format!("{stem}.lora_b")))?;
        let dims = |t: &str| content.tensor_infos.get(t).map(|i| i.shape.dims().to_vec()).unwrap_or_default();
        let (a_dims, b_dims) = (dims(&a), dims(&b));
        let rank = a_dims.first().copied().unwrap_or(0);
        if rank == 0 {
            return Err(Error::RankInvalid { adapter: name.into(), module: id.peft_name(), rank: 0 });
        }
        if rank > max {
            return Err(Error::RankTooLarge { adapter: name.into(), module: id.peft_name(), rank, max_lora_rank: max });
        }
        let (in_f, out_f) = shapes.in_out(id.kind);
        for (t, got, expected) in [(&a, a_dims, vec![rank, in_f]), (&b, b_dims, vec![out_f, rank])] {
            if got != expected {
                return Err(Error::ShapeMismatch {
                    adapter: name.into(),
                    path: path.into(),
                    tensor: t.clone(),
                    got,
                    expected,
                });
            }
        }
        // llama.cpp: `scale = alpha / rank`, or 1 when the file carries no alpha.
        let (alpha, scaling) = match alpha {
            Some(alpha) if alpha != 0.0 => (alpha, alpha / rank as f64),
            _ => (rank as f64, 1.0),
        };
        planned.insert(id, Planned { a, b, setting: ModuleSetting { rank, alpha, scaling } });
    }
    Ok(planned)
}

fn missing(name: &str, path: &Path, tensor: &str) -> Error {
    Error::TensorMissing { adapter: name.into(), path: path.into(), tensor: tensor.into() }
}

/// The PEFT config this file amounts to (for `/v1/models` and the engine's records): `r` the
/// largest rank, `lora_alpha` the file's, the modules it targets, no rsLoRA.
fn synthesized_config(
    modules: &BTreeMap<ModuleId, Planned>,
    alpha: Option<f64>,
) -> std::result::Result<AdapterConfig, String> {
    let r = modules.values().map(|p| p.setting.rank).max().unwrap_or(0);
    let mut kinds: Vec<&str> = modules.keys().map(|id| id.kind.short_name()).collect();
    kinds.dedup();
    kinds.sort_unstable();
    kinds.dedup();
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha.unwrap_or(r as f64),
        "target_modules": kinds,
    });
    AdapterConfig::parse(&json.to_string())
}

/// An integer or float metadata value as f64.
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(f64::from(*x)),
        Value::F64(x) => Some(*x),
        other => other.to_u64().ok().map(|x| x as f64).or_else(|| other.to_i64().ok().map(|x| x as f64)),
    }
}

/// candle refused the header: name the tensor when it was a tensor type it cannot read.
fn header_error(name: &str, path: &Path, reader: &mut BufReader<File>, e: candle_core::Error) -> Error {
    let unreadable = scan_tensor_types(reader)
        .ok()
        .and_then(|types| types.into_iter().find(|(_, ty)| !matches!(ty, 0..=3 | 6..=15 | 30)));
    match unreadable {
        Some((tensor, ty)) => Error::DtypeUnsupported {
            adapter: name.into(),
            path: path.into(),
            tensor,
            dtype: format!("ggml type {} ({ty})", ggml_type_name(ty)),
        },
        None => Error::CorruptHeader {
            adapter: name.into(),
            path: path.into(),
            reason: format!("not a readable gguf file: {e}"),
        },
    }
}

/// Writes `adapter` as llama.cpp's converter would (`convert_lora_to_gguf.py --outtype f32`): the
/// metadata llama.cpp reads, each module's `lora_a` and its unscaled `lora_b`, the q / k `lora_b`
/// rows permuted for ggml's RoPE on a llama-layout base. llama.cpp scales by one `alpha / rank`
/// per tensor, so every module must have the same `alpha` and no rsLoRA scaling; anything else is
/// refused. For the llama.cpp peer benchmarks, which serve the same adapters through llama.cpp.
pub fn write_gguf_lora(adapter: &LoraAdapter, shapes: &ModelShapes, path: &Path) -> Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
    let name = adapter.name();
    let unsupported = |reason: String| Error::Unsupported {
        adapter: name.into(),
        path: path.into(),
        feature: "write_gguf_lora".into(),
        reason,
    };
    let candle =
        |op: &str, e: candle_core::Error| Error::Candle { adapter: name.into(), op: op.into(), source: Box::new(e) };
    let alpha = adapter.modules().values().next().map(|m| m.alpha).unwrap_or(0.0);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (id, m) in adapter.modules() {
        if m.alpha != alpha || (m.scaling - m.alpha / m.rank as f64).abs() > 1e-12 * m.scaling.abs() {
            return Err(unsupported(format!("{id}: llama.cpp scales every tensor by one alpha / rank")));
        }
        if id.kind == ModuleKind::EmbedTokens {
            return Err(unsupported("llama.cpp's files carry no token_embd lora".into()));
        }
        let to_f32 = |t: &Tensor| t.to_dtype(candle_core::DType::F32);
        let a = to_f32(&m.a).map_err(|e| candle("read lora_a", e))?;
        let mut b = m
            .b()
            .and_then(|b| to_f32(&b))
            .and_then(|b| b.affine(1.0 / m.scaling, 0.0))
            .map_err(|e| candle("unfold lora_b", e))?;
        if let Some(order) = hf_row_order(id.kind, shapes) {
            // The stored row holding Hugging Face row `order[i]` is `i`: invert the order.
            let mut stored = vec![0u32; order.len()];
            for (i, &o) in order.iter().enumerate() {
                stored[o as usize] = i as u32;
            }
            let index = Tensor::from_vec(stored, order.len(), &Device::Cpu).map_err(|e| candle("permute", e))?;
            b = b.index_select(&index, 0).map_err(|e| candle("permute lora_b", e))?;
        }
        let stem = crate::gguf::gguf_name(*id);
        for (suffix, t) in [("lora_a", a), ("lora_b", b)] {
            let q = QTensor::quantize(&t.contiguous().map_err(|e| candle("copy", e))?, GgmlDType::F32)
                .map_err(|e| candle("store", e))?;
            tensors.push((format!("{stem}.{suffix}"), q));
        }
    }
    let meta = [
        ("general.architecture", gguf_file::Value::String(shapes.gguf_architecture().to_string())),
        ("general.type", gguf_file::Value::String("adapter".into())),
        ("adapter.type", gguf_file::Value::String("lora".into())),
        ("adapter.lora.alpha", gguf_file::Value::F32(alpha as f32)),
    ];
    let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let io = |source| Error::Io { adapter: name.into(), path: path.into(), source };
    let mut file = std::io::BufWriter::new(File::create(path).map_err(io)?);
    gguf_file::write(&mut file, &meta, &refs).map_err(|e| candle("write the gguf file", e))?;
    std::io::Write::flush(&mut file).map_err(io)
}

/// `true` for a path that names a GGUF file rather than a PEFT directory.
pub(crate) fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}
