//! Where an adapter comes from: a local directory, or a Hugging Face hub repo read through
//! `hf-hub` (standard cache, offline when `HF_HUB_OFFLINE` is set).

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, Result};
use crate::load::{CONFIG_FILE, WEIGHTS_FILE};

/// An adapter's source.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AdapterSource {
    /// A directory holding `adapter_config.json` and `adapter_model.safetensors`.
    Local(PathBuf),
    /// A hub repository at a revision (branch, tag or commit; `main` by default).
    Hub {
        /// `org/name`.
        repo: String,
        /// The revision.
        revision: String,
    },
}

impl AdapterSource {
    /// Reads a source string as vLLM does: a string that names an existing local path is a
    /// directory; otherwise `org/name[@revision]` is a hub id; anything else is an error saying
    /// which it tried.
    pub fn parse(s: &str) -> Result<AdapterSource> {
        let path = Path::new(s);
        if path.exists() {
            return if path.is_dir() {
                Ok(AdapterSource::Local(path.to_path_buf()))
            } else {
                Err(Error::Source {
                    source_str: s.into(),
                    reason: "is a file; an adapter source is a directory or a hub id".into(),
                })
            };
        }
        let (repo, revision) = match s.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (s, "main"),
        };
        if is_hub_id(repo) && is_revision(revision) {
            Ok(AdapterSource::Hub { repo: repo.into(), revision: revision.into() })
        } else {
            Err(Error::Source {
                source_str: s.into(),
                reason: "is neither an existing local directory nor a hub id of the form org/name[@revision]".into(),
            })
        }
    }

    /// The local directory holding the adapter's files, fetching them into the hub cache first
    /// for a hub source (from the cache alone when `HF_HUB_OFFLINE` is set). Reads the hub
    /// settings from the environment; see [`AdapterSource::resolve_with`].
    pub fn resolve(&self) -> Result<PathBuf> {
        self.resolve_with(&HubConfig::from_env())
    }

    /// [`AdapterSource::resolve`] with explicit hub settings.
    pub fn resolve_with(&self, hub: &HubConfig) -> Result<PathBuf> {
        match self {
            AdapterSource::Local(dir) => Ok(dir.clone()),
            AdapterSource::Hub { repo, revision } => {
                let config = hub.file(repo, revision, CONFIG_FILE)?;
                hub.file(repo, revision, WEIGHTS_FILE)?;
                config.parent().map(Path::to_path_buf).ok_or_else(|| Error::Hub {
                    repo: repo.clone(),
                    revision: revision.clone(),
                    reason: format!("cached file {} has no parent directory", config.display()),
                })
            }
        }
    }
}

impl std::fmt::Display for AdapterSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdapterSource::Local(dir) => write!(f, "{}", dir.display()),
            AdapterSource::Hub { repo, revision } if revision == "main" => f.write_str(repo),
            AdapterSource::Hub { repo, revision } => write!(f, "{repo}@{revision}"),
        }
    }
}

fn is_hub_id(s: &str) -> bool {
    let ok = |part: &str| {
        !part.is_empty()
            && part.len() <= 96
            && !part.starts_with(['.', '-'])
            && !part.contains("..")
            && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split_once('/'), Some((org, name)) if ok(org) && ok(name))
}

fn is_revision(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.contains("..")
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

/// Where the hub cache is and whether the network may be used.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HubConfig {
    /// The cache root (`$HF_HOME/hub`, or `~/.cache/huggingface/hub`).
    pub cache_dir: PathBuf,
    /// Serve from the cache alone (`HF_HUB_OFFLINE`).
    pub offline: bool,
}

impl HubConfig {
    /// Settings as `huggingface_hub` reads them: `HF_HOME` and `HF_HUB_OFFLINE`.
    pub fn from_env() -> HubConfig {
        let offline = std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        HubConfig { cache_dir: Cache::from_env().path().clone(), offline }
    }

    /// Explicit settings.
    pub fn new(cache_dir: impl Into<PathBuf>, offline: bool) -> HubConfig {
        HubConfig { cache_dir: cache_dir.into(), offline }
    }

    /// A file of a hub repo if the cache holds it: by ref name through `hf-hub`, or directly
    /// under `snapshots/<commit>` for a commit id.
    pub fn cached_file(&self, repo: &str, revision: &str, file: &str) -> Option<PathBuf> {
        let cache = Cache::new(self.cache_dir.clone());
        let hub_repo = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
        if let Some(path) = cache.repo(hub_repo.clone()).get(file) {
            return Some(path);
        }
        let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
        let direct = self.cache_dir.join(hub_repo.folder_name()).join("snapshots").join(revision).join(file);
        (is_commit && direct.is_file()).then_some(direct)
    }

    /// A file of a hub repo: from the cache, else (unless offline) downloaded into it.
    pub fn file(&self, repo: &str, revision: &str, file: &str) -> Result<PathBuf> {
        if let Some(path) = self.cached_file(repo, revision, file) {
            return Ok(path);
        }
        let hub_err = |reason: String| Error::Hub { repo: repo.into(), revision: revision.into(), reason };
        if self.offline {
            return Err(hub_err(format!(
                "{file} is not in the hub cache at {} and offline mode (HF_HUB_OFFLINE) is on",
                self.cache_dir.display()
            )));
        }
        let api = hf_hub::api::sync::ApiBuilder::from_env()
            .with_cache_dir(self.cache_dir.clone())
            .build()
            .map_err(|e| hub_err(format!("cannot start the hub client: {e}")))?;
        api.repo(Repo::with_revision(repo.into(), RepoType::Model, revision.into()))
            .get(file)
            .map_err(|e| hub_err(format!("cannot fetch {file}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_tells_directories_from_hub_ids() {
        let dir = std::env::temp_dir();
        assert_eq!(AdapterSource::parse(dir.to_str().unwrap()).unwrap(), AdapterSource::Local(dir.clone()));
        assert_eq!(
            AdapterSource::parse("org/sql-lora@v2").unwrap(),
            AdapterSource::Hub { repo: "org/sql-lora".into(), revision: "v2".into() }
        );
        assert_eq!(
            AdapterSource::parse("org/sql-lora").unwrap(),
            AdapterSource::Hub { repo: "org/sql-lora".into(), revision: "main".into() }
        );
        for bad in ["", "no-slash", "a/b/c", "../x/y", "org/..", "org/name@", "/does/not/exist", "org/na me"] {
            let err = AdapterSource::parse(bad).unwrap_err();
            assert_eq!(err.kind(), "source", "{bad:?}");
            assert!(err.to_string().contains("neither") || err.to_string().contains("file"), "{err}");
        }
    }
}
