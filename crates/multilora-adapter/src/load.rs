//! Reading `adapter_model.safetensors`: PEFT tensor names mapped to modules, every tensor checked
//! against the base model and the config, PEFT's scaling folded into B, and the content fingerprint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use multilora_types::{Fingerprint, MAX_LORA_RANK_CEILING, ModuleKind};
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::adapter::{LoraAdapter, LoraModule, Unheld};
use crate::config::{AdapterConfig, Matcher, Refusal};
use crate::error::{Error, Result};
use crate::module::ModuleId;
use crate::shapes::ModelShapes;

/// The file names PEFT writes.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The weights file PEFT writes with `safe_serialization` (the default).
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

const FINGERPRINT_DOMAIN: &[u8] = b"multilora/adapter-fingerprint/v1\0";

/// How to load an adapter.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoadOptions {
    /// The dtype the adapter is held in (the LoRA dtype; usually the model's).
    pub dtype: DType,
    /// Refuse any module whose rank exceeds this.
    pub max_lora_rank: Option<usize>,
    /// Check that `base_model_name_or_path` names a model of the served architecture.
    pub strict_base_model: bool,
}

impl Default for LoadOptions {
    fn default() -> LoadOptions {
        LoadOptions { dtype: DType::F32, max_lora_rank: None, strict_base_model: false }
    }
}

impl LoadOptions {
    /// Options holding the adapter in `dtype`.
    pub fn new(dtype: DType) -> LoadOptions {
        LoadOptions { dtype, ..LoadOptions::default() }
    }

    /// Sets `max_lora_rank`.
    pub fn max_lora_rank(mut self, rank: usize) -> LoadOptions {
        self.max_lora_rank = Some(rank);
        self
    }

    /// Turns the strict base-model check on or off.
    pub fn strict_base_model(mut self, strict: bool) -> LoadOptions {
        self.strict_base_model = strict;
        self
    }
}

/// What the config says one module gets, before tensors are read.
#[derive(Clone, Copy, Debug)]
struct Planned {
    rank: usize,
    alpha: f64,
    scaling: f64,
}

/// The role a tensor plays, read off its PEFT name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    A,
    B,
    SavedBaseLayer,
}

/// What the config gives one module: rank, alpha and the scale PEFT applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModuleSetting {
    /// The rank after `rank_pattern`.
    pub rank: usize,
    /// Alpha after `alpha_pattern`.
    pub alpha: f64,
    /// `alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA.
    pub scaling: f64,
}

/// A config read and validated without touching the weights.
#[derive(Clone, Debug)]
pub struct ConfigSummary {
    /// The parsed config.
    pub config: AdapterConfig,
    /// Every module of the base model the adapter targets, with its setting.
    pub modules: BTreeMap<ModuleId, ModuleSetting>,
}

impl ConfigSummary {
    /// The largest rank over the targeted modules.
    pub fn max_rank(&self) -> usize {
        self.modules.values().map(|m| m.rank).max().unwrap_or(0)
    }
}

/// Reads and validates the config alone: cheap, no tensor I/O (ranks against `max_lora_rank`,
/// supported fields and modules).
pub fn read_config(name: &str, dir: &Path, shapes: &ModelShapes, opts: &LoadOptions) -> Result<ConfigSummary> {
    let (config, plan) = plan(name, dir, shapes, opts)?;
    let modules = plan
        .into_iter()
        .map(|(id, p)| (id, ModuleSetting { rank: p.rank, alpha: p.alpha, scaling: p.scaling }))
        .collect();
    Ok(ConfigSummary { config, modules })
}

fn plan(
    name: &str,
    dir: &Path,
    shapes: &ModelShapes,
    opts: &LoadOptions,
) -> Result<(AdapterConfig, BTreeMap<ModuleId, Planned>)> {
    let path = dir.join(CONFIG_FILE);
    let invalid = |reason: String| Error::ConfigInvalid { adapter: name.into(), path: path.clone(), reason };
    let text = match regular_file(&path, MAX_CONFIG_FILE_BYTES) {
        Ok(()) => read_capped(&path, MAX_CONFIG_FILE_BYTES),
        Err(e) => Err(e),
    };
    let text = match text {
        Ok(t) => t,
        Err(FileRefusal::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::ConfigMissing { adapter: name.into(), dir: dir.into() });
        }
        Err(FileRefusal::Io(source)) => return Err(Error::Io { adapter: name.into(), path, source }),
        Err(FileRefusal::Not(reason)) => return Err(invalid(reason)),
    };
    let config = AdapterConfig::parse(&text).map_err(invalid)?;
    config.check_supported().map_err(|r| match r {
        Refusal::Invalid(reason) => invalid(reason),
        Refusal::Unsupported(feature, reason) => {
            Error::Unsupported { adapter: name.into(), path: path.clone(), feature, reason }
        }
        Refusal::Dora(evidence) => Error::Dora { adapter: name.into(), path: path.clone(), evidence },
        Refusal::LoraBias(evidence) => Error::LoraBias { adapter: name.into(), path: path.clone(), evidence },
    })?;
    if let Some(module) = Matcher::unknown_list_entry(&config) {
        return Err(Error::UnsupportedModule { adapter: name.into(), module });
    }
    let matcher = Matcher::new(&config).map_err(invalid)?;
    let mut planned = BTreeMap::new();
    for id in shapes.modules() {
        // A fused module's parts (Phi-3's q/k/v in `qkv_proj`) are planned under its name.
        let (module, _) = shapes.peft_module(id);
        if !matcher.targets(&module) {
            continue;
        }
        let (rank, alpha, scaling) = matcher.rank_alpha(&module);
        if rank <= 0 {
            return Err(Error::RankInvalid { adapter: name.into(), module, rank });
        }
        // Checked against the hard ceiling too, before anything is sized from it: a startup scan
        // reads ranks with no `max_lora_rank` yet, to size the slots.
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        let max = opts.max_lora_rank.map_or(MAX_LORA_RANK_CEILING, |m| m.min(MAX_LORA_RANK_CEILING));
        if rank > max {
            return Err(Error::RankTooLarge { adapter: name.into(), module, rank, max_lora_rank: max });
        }
        planned.insert(id, Planned { rank, alpha, scaling });
    }
    if planned.is_empty() {
        return Err(invalid("target_modules selects no module of the base model".into()));
    }
    if opts.strict_base_model {
        check_base_model(name, dir, &config, shapes)?;
    }
    Ok((config, planned))
}

/// Loads the adapter in `dir` for a model of `shapes`.
pub fn load_dir(name: &str, dir: &Path, shapes: &ModelShapes, opts: &LoadOptions) -> Result<LoraAdapter> {
    let (config, planned) = plan(name, dir, shapes, opts)?;
    let path = dir.join(WEIGHTS_FILE);
    if !path.exists() && dir.join("adapter_model.bin").exists() {
        return Err(Error::Unsupported {
            adapter: name.into(),
            path: dir.join("adapter_model.bin"),
            feature: "adapter_model.bin".into(),
            reason: "pickled weights are never loaded; save the adapter with safe_serialization".into(),
        });
    }
    // A FIFO or a device would block the open or never end: only a regular file is mapped.
    regular_file(&path, u64::MAX).map_err(|e| match e {
        FileRefusal::Io(source) => Error::Io { adapter: name.into(), path: path.clone(), source },
        FileRefusal::Not(reason) => Error::Io {
            adapter: name.into(),
            path: path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, reason),
        },
    })?;
    let file =
        std::fs::File::open(&path).map_err(|source| Error::Io { adapter: name.into(), path: path.clone(), source })?;
    // Read-only, for this function only; adapter files are written once, and every byte read is
    // validated (header, offsets, finiteness) before use.
    let mmap = multilora_cpu::host_memory::map_file(&file).map_err(|source| Error::Io {
        adapter: name.into(),
        path: path.clone(),
        source,
    })?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| safetensors_error(name, &path, e))?;
    let ctx = Ctx { name, path: &path };

    // The model's modules by PEFT module name: one each, or a fused module's parts.
    let mut groups: BTreeMap<String, Vec<ModuleId>> = BTreeMap::new();
    for id in shapes.modules() {
        groups.entry(shapes.peft_module(id).0).or_default().push(id);
    }
    let mut tensors: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
    let mut saved_embedding = None;
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    for key in &names {
        let (module_name, role) = classify(&ctx, &config, key)?;
        let Some(ids) = groups.get(module_name) else {
            return Err(match ModuleId::from_peft_name(module_name) {
                Some(_) => ctx.unexpected(key, "the base model has no such module"),
                None => Error::UnsupportedModule { adapter: ctx.name.into(), module: module_name.into() },
            });
        };
        let module = ids[0];
        let embedding_form = key.contains(".lora_embedding_");
        if embedding_form != (module.kind == ModuleKind::EmbedTokens) && role != Role::SavedBaseLayer {
            return Err(
                ctx.unexpected(key, "lora_embedding_A/B belong to embed_tokens only, lora_A/B to linear modules")
            );
        }
        if role == Role::SavedBaseLayer {
            if module != ModuleId::embed_tokens() {
                return Err(ctx.unexpected(key, "a saved base layer is only accepted for embed_tokens"));
            }
            saved_embedding = Some(key.clone());
            continue;
        }
        if !ids.iter().any(|id| planned.contains_key(id)) {
            return Err(ctx.unexpected(key, "adapter_config.json does not target this module"));
        }
        let slot = tensors.entry(module_name.to_string()).or_default();
        match role {
            Role::A => slot.0 = Some(key.clone()),
            Role::B => slot.1 = Some(key.clone()),
            Role::SavedBaseLayer => {}
        }
    }

    let mut hasher = blake3::Hasher::new();
    hasher.update(FINGERPRINT_DOMAIN);
    hasher.update(&[config.use_rslora as u8]);
    let mut modules = BTreeMap::new();
    // A fused module's A and B, read (and hashed) once for all its parts.
    let mut read: BTreeMap<String, (Tensor, Tensor)> = BTreeMap::new();
    for (id, plan) in &planned {
        let (peft, offset) = shapes.peft_module(*id);
        let (a_name, b_name) = tensors.get(&peft).cloned().unwrap_or_default();
        let prefix = format!("base_model.model.{peft}");
        let (a_suffix, b_suffix) = if id.kind == ModuleKind::EmbedTokens {
            ("lora_embedding_A", "lora_embedding_B")
        } else {
            ("lora_A.weight", "lora_B.weight")
        };
        let a_name = a_name.ok_or_else(|| ctx.missing(&format!("{prefix}.{a_suffix}")))?;
        let b_name = b_name.ok_or_else(|| ctx.missing(&format!("{prefix}.{b_suffix}")))?;
        let (in_f, out_f) = shapes.in_out(id.kind);
        let parts = groups.get(&peft).map_or(&[][..], Vec::as_slice);
        let fused_out: usize = parts.iter().map(|p| shapes.in_out(p.kind).1).sum();
        if !read.contains_key(&peft) {
            hasher.update(peft.as_bytes());
            hasher.update(&[0]);
            hasher.update(&(plan.rank as u64).to_le_bytes());
            hasher.update(&plan.scaling.to_le_bytes());
            let a = ctx.tensor(&st, &a_name, &[plan.rank, in_f], &mut hasher)?;
            let b = ctx.tensor(&st, &b_name, &[fused_out, plan.rank], &mut hasher)?;
            read.insert(peft.clone(), (a, b));
        }
        let (a, b) = &read[&peft];
        // A part of a fused module: its rows of B (PEFT's B · A over the fused output, row by row).
        let b = match b.dim(0).map_err(|e| ctx.candle("read B's rows", e))? == out_f {
            true => b.clone(),
            false => b.narrow(0, offset, out_f).and_then(|p| p.contiguous()).map_err(|e| ctx.candle("split B", e))?,
        };
        let module = LoraModule::held(a, &b, (plan.rank, plan.alpha, plan.scaling), opts.dtype).map_err(|u| {
            let non_finite = |tensor| Error::NonFinite { adapter: name.into(), path: path.clone(), tensor };
            match u {
                Unheld::A => non_finite(format!("{a_name} in {:?}", opts.dtype)),
                Unheld::B => non_finite(format!(
                    "{b_name} scaled by {:e} (alpha {:e} / rank {}) in {:?}",
                    plan.scaling, plan.alpha, plan.rank, opts.dtype
                )),
                Unheld::Candle(op, e) => ctx.candle(op, e),
            }
        })?;
        modules.insert(*id, module);
    }
    if let Some(key) = saved_embedding {
        check_saved_embedding(&ctx, &st, &key, shapes)?;
    }
    let fingerprint = Fingerprint(*hasher.finalize().as_bytes());
    Ok(LoraAdapter::new(name, config, modules, fingerprint))
}

/// The largest `adapter_config.json` read; real ones are a few KiB.
pub const MAX_CONFIG_FILE_BYTES: u64 = 16 << 20;

/// Why a file is not read.
enum FileRefusal {
    /// It could not be looked at or read.
    Io(std::io::Error),
    /// It is not a regular file, or too large.
    Not(String),
}

/// Refuses anything but a regular file of at most `limit` bytes, without opening it (`metadata`
/// follows symlinks and does not open, so a FIFO cannot block here).
fn regular_file(path: &Path, limit: u64) -> std::result::Result<(), FileRefusal> {
    let meta = std::fs::metadata(path).map_err(FileRefusal::Io)?;
    if !meta.is_file() {
        return Err(FileRefusal::Not("not a regular file".to_string()));
    }
    if meta.len() > limit {
        return Err(FileRefusal::Not(format!("{} bytes, more than the {limit} it may have", meta.len())));
    }
    Ok(())
}

/// Reads at most `limit` bytes of text (the file may have grown since it was looked at).
fn read_capped(path: &Path, limit: u64) -> std::result::Result<String, FileRefusal> {
    use std::io::Read;
    let mut text = String::new();
    let file = std::fs::File::open(path).map_err(FileRefusal::Io)?;
    let n = file.take(limit + 1).read_to_string(&mut text).map_err(FileRefusal::Io)?;
    if n as u64 > limit {
        return Err(FileRefusal::Not(format!("more than the {limit} bytes it may have")));
    }
    Ok(text)
}

fn safetensors_error(name: &str, path: &Path, e: SafeTensorError) -> Error {
    let reason = e.to_string().to_lowercase();
    match e {
        SafeTensorError::MetadataIncompleteBuffer | SafeTensorError::HeaderTooSmall => {
            Error::Truncated { adapter: name.into(), path: path.into(), reason }
        }
        _ => Error::CorruptHeader { adapter: name.into(), path: path.into(), reason },
    }
}

struct Ctx<'a> {
    name: &'a str,
    path: &'a Path,
}

impl Ctx<'_> {
    fn unexpected(&self, tensor: &str, reason: &str) -> Error {
        Error::TensorUnexpected {
            adapter: self.name.into(),
            path: self.path.into(),
            tensor: tensor.into(),
            reason: reason.into(),
        }
    }

    fn missing(&self, tensor: &str) -> Error {
        Error::TensorMissing { adapter: self.name.into(), path: self.path.into(), tensor: tensor.into() }
    }

    fn candle(&self, op: &str, source: candle_core::Error) -> Error {
        Error::Candle { adapter: self.name.into(), op: op.into(), source: Box::new(source) }
    }

    /// Reads one tensor: checks shape, dtype and finiteness, feeds its bytes to the fingerprint.
    fn tensor(
        &self,
        st: &SafeTensors<'_>,
        key: &str,
        expected: &[usize],
        hasher: &mut blake3::Hasher,
    ) -> Result<Tensor> {
        let view = st.tensor(key).map_err(|e| self.unexpected(key, &e.to_string()))?;
        if view.shape() != expected {
            return Err(Error::ShapeMismatch {
                adapter: self.name.into(),
                path: self.path.into(),
                tensor: key.into(),
                got: view.shape().to_vec(),
                expected: expected.to_vec(),
            });
        }
        let data = view.data();
        let finite = match view.dtype() {
            Dtype::F32 => data.chunks_exact(4).all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
            Dtype::F64 => data.chunks_exact(8).all(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])).is_finite()),
            Dtype::F16 => data.chunks_exact(2).all(|c| half::f16::from_le_bytes([c[0], c[1]]).is_finite()),
            Dtype::BF16 => data.chunks_exact(2).all(|c| half::bf16::from_le_bytes([c[0], c[1]]).is_finite()),
            other => {
                return Err(Error::DtypeUnsupported {
                    adapter: self.name.into(),
                    path: self.path.into(),
                    tensor: key.into(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        if !finite {
            return Err(Error::NonFinite { adapter: self.name.into(), path: self.path.into(), tensor: key.into() });
        }
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::F16 => DType::F16,
            _ => DType::BF16,
        };
        hasher.update(format!("{:?}", view.dtype()).as_bytes());
        for d in view.shape() {
            hasher.update(&(*d as u64).to_le_bytes());
        }
        hasher.update(data);
        Tensor::from_raw_buffer(data, dtype, view.shape(), &Device::Cpu)
            .map_err(|e| self.candle(&format!("read {key}"), e))
    }
}

/// Maps a tensor name to its PEFT module name and role, refusing DoRA, bias and saved modules by
/// name.
fn classify<'k>(ctx: &Ctx<'_>, config: &AdapterConfig, key: &'k str) -> Result<(&'k str, Role)> {
    let Some(rest) = key.strip_prefix("base_model.model.") else {
        return Err(ctx.unexpected(key, "PEFT tensor names start with base_model.model."));
    };
    if rest.contains("modules_to_save") || rest.contains(".original_module.") {
        return Err(Error::Unsupported {
            adapter: ctx.name.into(),
            path: ctx.path.into(),
            feature: "modules_to_save".into(),
            reason: format!(
                "tensor {key} is a fully trained copy of a base module (modules_to_save {:?}); serving it would replace base weights for every request",
                config.modules_to_save
            ),
        });
    }
    const SUFFIXES: &[(&str, Option<Role>)] = &[
        (".lora_A.weight", Some(Role::A)),
        (".lora_B.weight", Some(Role::B)),
        (".lora_embedding_A", Some(Role::A)),
        (".lora_embedding_B", Some(Role::B)),
        (".base_layer.weight", Some(Role::SavedBaseLayer)),
        (".lora_magnitude_vector", None),
        (".lora_magnitude_vector.weight", None),
        (".lora_A.bias", None),
        (".lora_B.bias", None),
        (".bias", None),
    ];
    for (suffix, role) in SUFFIXES {
        let Some(module_name) = rest.strip_suffix(suffix) else { continue };
        let Some(role) = role else {
            return Err(if suffix.contains("magnitude") {
                Error::Dora { adapter: ctx.name.into(), path: ctx.path.into(), evidence: format!("tensor {key}") }
            } else {
                Error::LoraBias {
                    adapter: ctx.name.into(),
                    path: ctx.path.into(),
                    evidence: format!("tensor {key} (bias {:?})", config.bias),
                }
            });
        };
        return Ok((module_name, *role));
    }
    Err(ctx.unexpected(key, "not a LoRA tensor name PEFT writes"))
}

/// PEFT copies a saved embedding over the base one; only an identical copy is harmless. A copy
/// saved in another dtype than the checkpoint's (an f32 adapter over a bf16 checkpoint) is
/// compared as PEFT would write it: rounded to the checkpoint's dtype.
fn check_saved_embedding(ctx: &Ctx<'_>, st: &SafeTensors<'_>, key: &str, shapes: &ModelShapes) -> Result<()> {
    let (vocab, hidden) = shapes.in_out(ModuleKind::EmbedTokens);
    let mut scratch = blake3::Hasher::new();
    let t = ctx.tensor(st, key, &[vocab, hidden], &mut scratch)?;
    let mismatch = |reason: &str| Error::EmbeddingMismatch {
        adapter: ctx.name.into(),
        path: ctx.path.into(),
        tensor: key.into(),
        reason: reason.into(),
    };
    let Some(expected) = shapes.embed_digest else {
        return Err(mismatch("the base model's embedding digest is unknown, so the copy cannot be checked"));
    };
    let digest = |t: &candle_core::Tensor| {
        crate::adapter::embedding_digest(t).map_err(|e| ctx.candle("digest the saved embedding", e))
    };
    if digest(&t)? == expected {
        return Ok(());
    }
    if let Some(dt) = shapes.embed_dtype.filter(|&dt| dt != t.dtype()) {
        let rounded = t.to_dtype(dt).map_err(|e| ctx.candle("round the saved embedding", e))?;
        if digest(&rounded)? == expected {
            return Ok(());
        }
        return Err(mismatch(&format!("its digest differs, also rounded to the base embedding's {dt:?}")));
    }
    Err(mismatch("its digest differs"))
}

/// Strict mode: `base_model_name_or_path` must lead to a `config.json` of the served architecture.
fn check_base_model(name: &str, dir: &Path, config: &AdapterConfig, shapes: &ModelShapes) -> Result<()> {
    let base = config.base_model_name_or_path.clone().unwrap_or_default();
    let mismatch = |found: String| Error::BaseModelMismatch {
        adapter: name.into(),
        base: base.clone(),
        found,
        expected: format!("{} ({})", shapes.architecture, shapes.model_type),
    };
    if base.is_empty() {
        return Err(mismatch("not named (base_model_name_or_path is empty)".into()));
    }
    let local: PathBuf = if Path::new(&base).is_absolute() { PathBuf::from(&base) } else { dir.join(&base) };
    let config_path = if local.join("config.json").is_file() {
        Some(local.join("config.json"))
    } else {
        crate::source::HubConfig::from_env().cached_file(&base, "main", "config.json")
    };
    let Some(config_path) = config_path else {
        return Err(mismatch("unknown: no config.json locally or in the hub cache".into()));
    };
    let text = std::fs::read_to_string(&config_path).map_err(|source| Error::Io {
        adapter: name.into(),
        path: config_path.clone(),
        source,
    })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| mismatch(format!("unreadable ({e})")))?;
    let arch = value.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).unwrap_or("");
    let model_type = value.get("model_type").and_then(|a| a.as_str()).unwrap_or("");
    let same_arch = !arch.is_empty() && arch == shapes.architecture;
    let same_type = !model_type.is_empty() && model_type == shapes.model_type;
    if same_arch || (arch.is_empty() && same_type) { Ok(()) } else { Err(mismatch(format!("{arch} ({model_type})"))) }
}
