//! Where a checkpoint comes from (a directory, a GGUF file, or a hub repo through the `hf-hub`
//! cache) and how its tensors are read (safetensors, one file or a sharded index, with
//! positioned reads; or a GGUF file's tensors, kept quantized or dequantized).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{Error as AdapterError, HubConfig};
use multilora_layers::LinearWeight;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, RawTensor};
use crate::reader::SafetensorsFiles;

/// A file of a hub repo through the shared hub settings, with the bare reason on failure (the
/// caller names the repo; an absent `model.safetensors` is expected for a sharded repo).
fn hub_file(hub: &HubConfig, repo: &str, revision: &str, file: &str) -> std::result::Result<PathBuf, String> {
    hub.file(repo, revision, file).map_err(|e| match e {
        AdapterError::Hub { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// A checkpoint's location.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ModelSource {
    /// A local directory with `config.json` and safetensors.
    Local(PathBuf),
    /// A local GGUF file (llama.cpp's format).
    Gguf(PathBuf),
    /// A hub repository `org/name` at a revision (branch, tag or commit).
    Hub {
        /// `org/name`.
        repo: String,
        /// Revision, `main` unless `@rev` was given.
        revision: String,
        /// The GGUF file of the repo to serve (`--gguf-file`), instead of its safetensors.
        gguf_file: Option<String>,
    },
}

impl ModelSource {
    /// A `.gguf` file is a GGUF model; a directory holding `config.json` is a Hugging Face
    /// checkpoint, and one without it that holds exactly one `.gguf` file is that file; otherwise
    /// `org/name[@rev]` is a hub id.
    pub fn parse(s: &str) -> Result<ModelSource> {
        let path = Path::new(s);
        if path.is_file() && is_gguf(path) {
            return Ok(ModelSource::Gguf(path.to_path_buf()));
        }
        if path.is_dir() {
            if path.join("config.json").exists() {
                return Ok(ModelSource::Local(path.to_path_buf()));
            }
            let io = |source| Error::Io { path: path.to_path_buf(), source };
            let mut ggufs = Vec::new();
            for entry in std::fs::read_dir(path).map_err(io)? {
                let p = entry.map_err(io)?.path();
                if p.is_file() && is_gguf(&p) {
                    ggufs.push(p);
                }
            }
            ggufs.sort();
            return match ggufs.len() {
                0 => Ok(ModelSource::Local(path.to_path_buf())),
                1 => Ok(ModelSource::Gguf(ggufs.remove(0))),
                n => Err(Error::Config {
                    path: path.to_path_buf(),
                    reason: format!(
                        "holds {n} .gguf files and no config.json; name the file to serve: {}",
                        ggufs
                            .iter()
                            .filter_map(|p| p.file_name())
                            .map(|f| f.to_string_lossy())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                }),
            };
        }
        let (repo, revision) = s.split_once('@').unwrap_or((s, "main"));
        let ok = |p: &str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && !p.contains("..")
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        match repo.split_once('/') {
            Some((org, name)) if ok(org) && ok(name) && !revision.is_empty() && !revision.contains("..") => {
                Ok(ModelSource::Hub { repo: repo.to_string(), revision: revision.to_string(), gguf_file: None })
            }
            _ => Err(Error::Config {
                path: path.to_path_buf(),
                reason: "neither an existing directory or .gguf file nor a hub id org/name[@revision]".into(),
            }),
        }
    }

    /// Serves the GGUF file `name` of a hub repo (vLLM's and llama.cpp's way of picking one
    /// quantization of several); an error for a source that is not a hub repo.
    pub fn with_gguf_file(self, name: &str) -> Result<ModelSource> {
        let plain = !name.is_empty() && !name.contains("..") && !name.starts_with('/') && is_gguf(Path::new(name));
        match self {
            ModelSource::Hub { repo, revision, .. } if plain => {
                Ok(ModelSource::Hub { repo, revision, gguf_file: Some(name.to_string()) })
            }
            ModelSource::Hub { .. } => Err(Error::Config {
                path: name.into(),
                reason: "a gguf file name is a relative path ending in .gguf".into(),
            }),
            other => Err(Error::Config {
                path: PathBuf::from(other.to_string()),
                reason: "--gguf-file picks a file of a hub repo; give a local file as the model itself".into(),
            }),
        }
    }

    /// The checkpoint on disk, opened: a GGUF file's header read, or a Hugging Face checkpoint's
    /// `config.json` and safetensors files found (fetched into the hub cache for a hub repo).
    pub fn open(&self, hub: &HubConfig) -> Result<Checkpoint> {
        match self {
            ModelSource::Gguf(path) => Ok(Checkpoint::Gguf(std::sync::Arc::new(GgufFile::open(path)?))),
            ModelSource::Hub { repo, revision, gguf_file: Some(file) } => {
                let path = hub_file(hub, repo, revision, file).map_err(|reason| Error::Hub {
                    repo: repo.clone(),
                    revision: revision.clone(),
                    reason,
                })?;
                Ok(Checkpoint::Gguf(std::sync::Arc::new(GgufFile::open(&path)?)))
            }
            _ => Ok(Checkpoint::Safetensors(self.resolve(hub)?)),
        }
    }

    /// The files of a Hugging Face checkpoint on disk: `config.json` and the safetensors files.
    pub fn resolve(&self, hub: &HubConfig) -> Result<CheckpointFiles> {
        match self {
            ModelSource::Local(dir) => CheckpointFiles::from_dir(dir),
            ModelSource::Gguf(_) | ModelSource::Hub { gguf_file: Some(_), .. } => Err(Error::Config {
                path: PathBuf::from(self.to_string()),
                reason: "a gguf model has no config.json; open it with ModelSource::open".into(),
            }),
            ModelSource::Hub { repo, revision, .. } => {
                let err = |reason: String| Error::Hub { repo: repo.clone(), revision: revision.clone(), reason };
                let get = |f: &str| hub_file(hub, repo, revision, f).map_err(err);
                let config = get("config.json")?;
                let weights = match hub_file(hub, repo, revision, "model.safetensors") {
                    Ok(single) => vec![single],
                    Err(single_err) => {
                        let index =
                            hub_file(hub, repo, revision, INDEX_FILE).map_err(|e| err(format!("{single_err}; {e}")))?;
                        shard_names(&index)?.iter().map(|s| get(s)).collect::<Result<Vec<_>>>()?
                    }
                };
                let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
                Ok(CheckpointFiles { dir, config, weights })
            }
        }
    }
}

const INDEX_FILE: &str = "model.safetensors.index.json";

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Local(p) | ModelSource::Gguf(p) => write!(f, "{}", p.display()),
            ModelSource::Hub { repo, revision, gguf_file } => {
                write!(f, "{repo}@{revision}")?;
                match gguf_file {
                    Some(file) => write!(f, " ({file})"),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Whether `path` names a `.gguf` file.
fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// An opened checkpoint: the files of a Hugging Face checkpoint, or a GGUF file with its header
/// read.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Checkpoint {
    /// `config.json` and safetensors.
    Safetensors(CheckpointFiles),
    /// One GGUF file (metadata, tokenizer and tensors in it).
    Gguf(std::sync::Arc<GgufFile>),
}

impl Checkpoint {
    /// The model's hyper-parameters: `config.json`, or the GGUF metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            Checkpoint::Safetensors(files) => Ok(ModelConfig::from_file(&files.config)?),
            Checkpoint::Gguf(g) => g.config(),
        }
    }

    /// The folder the checkpoint lies in (where a Hugging Face checkpoint keeps its tokenizer and
    /// generation defaults).
    pub fn dir(&self) -> PathBuf {
        match self {
            Checkpoint::Safetensors(files) => files.dir.clone(),
            Checkpoint::Gguf(g) => g.path().parent().map(Path::to_path_buf).unwrap_or_default(),
        }
    }

    /// The GGUF file, for a GGUF checkpoint.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match self {
            Checkpoint::Gguf(g) => Some(g),
            Checkpoint::Safetensors(_) => None,
        }
    }
}

/// Writes a copy of the checkpoint in `src` to `dst` with every floating-point tensor in `dtype`
/// (one `model.safetensors`) and `config.json` naming it (`torch_dtype` and `dtype`), the other
/// regular files of `src` copied as they are: e.g. a bf16 checkpoint from an f32 one, for tests
/// and benchmarks.
pub fn write_checkpoint_copy(src: &Path, dst: &Path, dtype: DType) -> Result<()> {
    let files = CheckpointFiles::from_dir(src)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let mut tensors = HashMap::new();
    for f in &files.weights {
        for (name, t) in candle_core::safetensors::load(f, &Device::Cpu)? {
            let t = if t.dtype().is_float() { t.to_dtype(dtype)? } else { t };
            tensors.insert(name, t);
        }
    }
    candle_core::safetensors::save(&tensors, dst.join("model.safetensors"))?;
    let text = std::fs::read_to_string(&files.config).map_err(io(&files.config))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Config { path: files.config.clone(), reason: format!("not valid JSON: {e}") })?;
    let name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    for key in ["torch_dtype", "dtype"] {
        cfg[key] = serde_json::Value::from(name);
    }
    let out = dst.join("config.json");
    std::fs::write(&out, cfg.to_string()).map_err(io(&out))?;
    for entry in std::fs::read_dir(src).map_err(io(src))? {
        let entry = entry.map_err(io(src))?;
        let name = entry.file_name();
        let keep = entry.file_type().map_err(io(src))?.is_file()
            && name != "config.json"
            && !name.to_string_lossy().ends_with(".safetensors")
            && name != INDEX_FILE;
        if keep {
            std::fs::copy(entry.path(), dst.join(&name)).map_err(io(&entry.path()))?;
        }
    }
    Ok(())
}

/// The files of one checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckpointFiles {
    /// The directory (snapshot folder for a hub repo); errors name it.
    pub dir: PathBuf,
    /// `config.json`.
    pub config: PathBuf,
    /// `model.safetensors`, or every shard listed in the index.
    pub weights: Vec<PathBuf>,
}

impl CheckpointFiles {
    /// The files of a local directory.
    pub fn from_dir(dir: &Path) -> Result<CheckpointFiles> {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(Error::Config { path: config, reason: "file not found".into() });
        }
        let single = dir.join("model.safetensors");
        let weights = if single.is_file() {
            vec![single]
        } else {
            let index = dir.join(INDEX_FILE);
            if !index.is_file() {
                return Err(Error::Config { path: single, reason: format!("file not found (nor {INDEX_FILE})") });
            }
            shard_names(&index)?.iter().map(|s| dir.join(s)).collect()
        };
        Ok(CheckpointFiles { dir: dir.to_path_buf(), config, weights })
    }
}

fn shard_names(index: &Path) -> Result<Vec<String>> {
    let bad = |reason: String| Error::Config { path: index.to_path_buf(), reason };
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io { path: index.to_path_buf(), source })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no weight_map object".into()))?;
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| bad(format!("weight_map entry {tensor} is not a string")))?;
        if file.contains('/') || file.contains('\\') || file.contains("..") {
            return Err(bad(format!("shard name {file:?} is not a plain file name")));
        }
        files.insert(file.to_string());
    }
    Ok(files.into_iter().collect())
}

/// Checkpoint tensors, read one at a time into the requested dtype and device: memory-mapped
/// safetensors, or tensors handed over in memory.
pub(crate) struct Weights {
    source: Source,
    dir: PathBuf,
    dtype: DType,
    device: Device,
}

enum Source {
    Files(SafetensorsFiles),
    Memory(HashMap<String, Tensor>),
    /// A GGUF file, and the config its q / k rows are un-permuted by.
    Gguf(Arc<GgufFile>, Box<ModelConfig>),
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights").field("dir", &self.dir).field("dtype", &self.dtype).finish()
    }
}

impl Weights {
    pub(crate) fn open(files: &CheckpointFiles, dtype: DType, device: &Device) -> Result<Weights> {
        for f in &files.weights {
            if !f.is_file() {
                return Err(Error::Config { path: f.clone(), reason: "file not found".into() });
            }
        }
        let st = SafetensorsFiles::open(&files.weights)?;
        Ok(Weights { source: Source::Files(st), dir: files.dir.clone(), dtype, device: device.clone() })
    }

    pub(crate) fn in_memory(tensors: HashMap<String, Tensor>, dtype: DType, device: &Device) -> Weights {
        Weights { source: Source::Memory(tensors), dir: PathBuf::from("<memory>"), dtype, device: device.clone() }
    }

    /// The tensors of an open GGUF file; `cfg` is the file's own config (its heads un-permute the
    /// q / k rows of a llama-layout file).
    pub(crate) fn gguf(file: Arc<GgufFile>, cfg: &ModelConfig, dtype: DType, device: &Device) -> Weights {
        let dir = file.path().to_path_buf();
        Weights { source: Source::Gguf(file, Box::new(cfg.clone())), dir, dtype, device: device.clone() }
    }

    /// Whether the tensors come from a GGUF file.
    pub(crate) fn is_gguf(&self) -> bool {
        matches!(self.source, Source::Gguf(..))
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Files(st) => st.shape(name).is_some(),
            Source::Memory(m) => m.contains_key(name),
            Source::Gguf(g, _) => g.contains(name),
        }
    }

    /// A projection's weight `name`, checked against `shape`: kept quantized when the file
    /// stores it quantized and `quantized` is asked (for the CPU kernels, or as a `QTensor` on a
    /// device), otherwise a tensor in `dtype` (dequantized as ggml does, if need be).
    pub(crate) fn linear(&self, name: &str, shape: &[usize], dtype: DType, quantized: bool) -> Result<LinearWeight> {
        let Source::Gguf(g, cfg) = &self.source else {
            return Ok(LinearWeight::Dense(self.get_in(name, shape, dtype)?));
        };
        self.linear_from_raw(name, g.read_raw(name, shape, cfg)?, dtype, quantized)
    }

    /// A GGUF tensor's bytes as [`Weights::linear`] gives them.
    fn linear_from_raw(&self, name: &str, raw: RawTensor, dtype: DType, quantized: bool) -> Result<LinearWeight> {
        if !quantized || raw.quant_type().is_none() {
            let t = raw.dense()?;
            return Ok(LinearWeight::Dense(if self.device.is_cpu() {
                t.to_dtype(dtype)?
            } else {
                t.to_device(&self.device)?.to_dtype(dtype)?
            }));
        }
        if self.device.is_cpu() {
            return Ok(LinearWeight::Quant(raw.quant()?.ok_or_else(|| Error::Gguf {
                path: self.dir.clone(),
                reason: format!("tensor {name} is not quantized"),
            })?));
        }
        Ok(LinearWeight::Device(Arc::new(raw.qtensor(&self.device)?)))
    }

    /// A fused projection's weight `name` (`[Σ rows, cols]`: Phi-3's `qkv_proj`, `gate_up_proj`)
    /// as one weight per part, `rows[i]` rows each, as [`Weights::linear`] gives a weight: a GGUF
    /// file's quantized rows stay quantized when `quantized` is asked (a row is whole blocks, so
    /// a part is its rows' bytes).
    pub(crate) fn linear_parts(
        &self,
        name: &str,
        rows: &[usize],
        cols: usize,
        dtype: DType,
        quantized: bool,
    ) -> Result<Vec<LinearWeight>> {
        let total: usize = rows.iter().sum();
        if let Source::Gguf(g, cfg) = &self.source {
            let raw = g.read_raw(name, &[total, cols], cfg)?;
            let row_bytes = raw.bytes.len() / total.max(1);
            let mut at = 0;
            let mut parts = Vec::with_capacity(rows.len());
            for &r in rows {
                let bytes = raw.bytes[at * row_bytes..(at + r) * row_bytes].to_vec();
                parts.push(self.linear_from_raw(
                    name,
                    RawTensor { dtype: raw.dtype, shape: vec![r, cols], bytes },
                    dtype,
                    quantized,
                )?);
                at += r;
            }
            return Ok(parts);
        }
        let t = self.get_in(name, &[total, cols], dtype)?;
        let mut at = 0;
        let mut parts = Vec::with_capacity(rows.len());
        for &r in rows {
            parts.push(LinearWeight::Dense(t.narrow(0, at, r)?.contiguous()?));
            at += r;
        }
        Ok(parts)
    }

    /// The tensor `name`, checked against `shape`, in the model dtype on the model device: a
    /// tensor handed over on the device stays there; one read from disk is converted on the host
    /// for the CPU, and on the device after its upload otherwise.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get_in(name, shape, self.dtype)
    }

    /// [`Weights::get`] in `dtype` instead of the default one (a tensor already stored in it is
    /// not copied again).
    pub(crate) fn get_in(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if let Source::Memory(m) = &self.source
            && let Some(t) = m.get(name)
            && t.dims() == shape
            && t.device().same_device(&self.device)
        {
            return Ok(t.to_dtype(dtype)?);
        }
        let t = self.get_as_stored(name, shape)?;
        Ok(if self.device.is_cpu() { t.to_dtype(dtype)? } else { t.to_device(&self.device)?.to_dtype(dtype)? })
    }

    /// The tensor `name`, checked against `shape`, in the checkpoint's own dtype, on the CPU.
    pub(crate) fn get_as_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let missing = || Error::TensorMissing { tensor: name.to_string(), dir: self.dir.clone() };
        let got = match &self.source {
            Source::Files(st) => st.shape(name).ok_or_else(missing)?.to_vec(),
            Source::Memory(m) => m.get(name).ok_or_else(missing)?.dims().to_vec(),
            Source::Gguf(g, _) => g.shape(name).ok_or_else(missing)?,
        };
        if got != shape {
            return Err(Error::ShapeMismatch { tensor: name.to_string(), got, expected: shape.to_vec() });
        }
        let t = match &self.source {
            Source::Files(st) => st.load(name)?.ok_or_else(missing)?,
            Source::Memory(m) => m.get(name).ok_or_else(missing)?.to_device(&Device::Cpu)?,
            Source::Gguf(g, cfg) => g.read_raw(name, shape, cfg)?.dense()?,
        };
        Ok(t)
    }
}
