//! Where a checkpoint comes from (a directory, or a hub repo through the `hf-hub` cache) and how
//! its tensors are read (memory-mapped safetensors, one file or a sharded index).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use multilora_layers::{AdapterError, HubConfig};

use crate::error::{Error, Result};
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
    /// A hub repository `org/name` at a revision (branch, tag or commit).
    Hub {
        /// `org/name`.
        repo: String,
        /// Revision, `main` unless `@rev` was given.
        revision: String,
    },
}

impl ModelSource {
    /// An existing directory is local; otherwise `org/name[@rev]` is a hub id.
    pub fn parse(s: &str) -> Result<ModelSource> {
        let path = Path::new(s);
        if path.is_dir() {
            return Ok(ModelSource::Local(path.to_path_buf()));
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
                Ok(ModelSource::Hub { repo: repo.to_string(), revision: revision.to_string() })
            }
            _ => Err(Error::Config {
                path: path.to_path_buf(),
                reason: "neither an existing directory nor a hub id org/name[@revision]".into(),
            }),
        }
    }

    /// The files of the checkpoint on disk: `config.json` and the safetensors files.
    pub fn resolve(&self, hub: &HubConfig) -> Result<CheckpointFiles> {
        match self {
            ModelSource::Local(dir) => CheckpointFiles::from_dir(dir),
            ModelSource::Hub { repo, revision } => {
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

    pub(crate) fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Files(st) => st.shape(name).is_some(),
            Source::Memory(m) => m.contains_key(name),
        }
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
        };
        if got != shape {
            return Err(Error::ShapeMismatch { tensor: name.to_string(), got, expected: shape.to_vec() });
        }
        let t = match &self.source {
            Source::Files(st) => st.load(name)?.ok_or_else(missing)?,
            Source::Memory(m) => m.get(name).ok_or_else(missing)?.to_device(&Device::Cpu)?,
        };
        Ok(t)
    }
}
