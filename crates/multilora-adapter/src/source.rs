//! Where an adapter comes from: a local directory, or a Hugging Face hub repo read through
//! `hf-hub` (standard cache, offline when `HF_HUB_OFFLINE` is set).

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use multilora_types::AdapterSource;

use crate::error::{Error, Result};
use crate::load::{CONFIG_FILE, WEIGHTS_FILE};

/// What the loader adds to the shared [`AdapterSource`]: reading a client's string, and the
/// local path of the files (fetched from the hub first for a hub source).
pub trait SourceExt: Sized {
    /// Reads a source string as vLLM does: a string that names an existing local path is a
    /// directory (or, named `*.gguf`, a llama.cpp LoRA file); otherwise `org/name[@revision]` is
    /// a hub id; anything else is an error saying which it tried.
    fn parse(s: &str) -> Result<Self>;
    /// The local directory holding the adapter's files (the file itself for a GGUF source),
    /// fetching them into the hub cache first for a hub source (from the cache alone when
    /// `HF_HUB_OFFLINE` is set). Reads the hub settings from the environment; see
    /// [`SourceExt::resolve_with`].
    fn resolve(&self) -> Result<PathBuf>;
    /// [`SourceExt::resolve`] with explicit hub settings.
    fn resolve_with(&self, hub: &HubConfig) -> Result<PathBuf>;
}

impl SourceExt for AdapterSource {
    fn parse(s: &str) -> Result<AdapterSource> {
        let path = Path::new(s);
        if path.exists() {
            return if path.is_dir() {
                Ok(AdapterSource::Local(path.to_path_buf()))
            } else if crate::gguf_lora::is_gguf_path(path) {
                Ok(AdapterSource::Gguf(path.to_path_buf()))
            } else {
                Err(Error::Source {
                    source_str: s.into(),
                    reason: "is a file; an adapter source is a directory, a .gguf LoRA file or a hub id".into(),
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

    fn resolve(&self) -> Result<PathBuf> {
        self.resolve_with(&HubConfig::from_env())
    }

    fn resolve_with(&self, hub: &HubConfig) -> Result<PathBuf> {
        match self {
            AdapterSource::Local(dir) | AdapterSource::Gguf(dir) => Ok(dir.clone()),
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

/// Where the hub cache is, whether the network may be used, and the credentials and endpoint
/// for it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HubConfig {
    /// The cache root (`$HF_HOME/hub`, or `~/.cache/huggingface/hub`).
    pub cache_dir: PathBuf,
    /// Serve from the cache alone (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`): sent as a bearer token, for gated and
    /// private repos; never printed. Without it, the token file `huggingface-cli login` writes
    /// is used, as `hf-hub` does.
    token: Option<String>,
    /// `HF_ENDPOINT`: another hub (a mirror); `https://huggingface.co` when `None`.
    endpoint: Option<String>,
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubConfig")
            .field("cache_dir", &self.cache_dir)
            .field("offline", &self.offline)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl HubConfig {
    /// Settings as `huggingface_hub` reads them: `HF_HOME`, `HF_HUB_OFFLINE`, `HF_TOKEN` (else
    /// `HUGGING_FACE_HUB_TOKEN`) and `HF_ENDPOINT`.
    pub fn from_env() -> HubConfig {
        HubConfig::from_vars(Cache::from_env().path().clone(), |k| std::env::var(k).ok())
    }

    /// [`HubConfig::from_env`] over `var` instead of the process environment.
    fn from_vars(cache_dir: PathBuf, var: impl Fn(&str) -> Option<String>) -> HubConfig {
        let offline = var("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let nonempty = |k: &str| var(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let token = nonempty("HF_TOKEN").or_else(|| nonempty("HUGGING_FACE_HUB_TOKEN"));
        HubConfig { cache_dir, offline, token, endpoint: nonempty("HF_ENDPOINT") }
    }

    /// Explicit settings (no token, the default endpoint).
    pub fn new(cache_dir: impl Into<PathBuf>, offline: bool) -> HubConfig {
        HubConfig { cache_dir: cache_dir.into(), offline, token: None, endpoint: None }
    }

    /// Sends `token` to the hub (for gated and private repos).
    pub fn with_token(mut self, token: impl Into<String>) -> HubConfig {
        self.token = Some(token.into());
        self
    }

    /// Talks to the hub at `url` instead of `https://huggingface.co`.
    pub fn with_endpoint(mut self, url: impl Into<String>) -> HubConfig {
        self.endpoint = Some(url.into());
        self
    }

    /// Whether a token will be sent (its value is never shown).
    pub fn has_token(&self) -> bool {
        self.token.is_some()
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
        let mut builder = hf_hub::api::sync::ApiBuilder::from_env().with_cache_dir(self.cache_dir.clone());
        if let Some(token) = &self.token {
            builder = builder.with_token(Some(token.clone()));
        }
        if let Some(url) = &self.endpoint {
            builder = builder.with_endpoint(url.clone());
        }
        let api = builder.build().map_err(|e| hub_err(format!("cannot start the hub client: {e}")))?;
        api.repo(Repo::with_revision(repo.into(), RepoType::Model, revision.into()))
            .get(file)
            .map_err(|e| hub_err(format!("cannot fetch {file}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_comes_from_hf_token_and_is_never_printed() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let hub =
            HubConfig::from_vars("/c".into(), vars(&[("HF_TOKEN", " hf_abc "), ("HUGGING_FACE_HUB_TOKEN", "old")]));
        assert!(hub.has_token() && hub.token.as_deref() == Some("hf_abc"));
        assert!(!format!("{hub:?}").contains("hf_abc"), "{hub:?}");
        let hub =
            HubConfig::from_vars("/c".into(), vars(&[("HUGGING_FACE_HUB_TOKEN", "old"), ("HF_HUB_OFFLINE", "1")]));
        assert_eq!((hub.token.as_deref(), hub.offline), (Some("old"), true));
        let hub = HubConfig::from_vars("/c".into(), vars(&[("HF_TOKEN", ""), ("HF_ENDPOINT", "http://mirror")]));
        assert_eq!((hub.has_token(), hub.endpoint.as_deref()), (false, Some("http://mirror")));
    }

    /// A fetch sends `Authorization: Bearer <HF_TOKEN>` (to a stand-in hub on loopback, which
    /// refuses it as the hub refuses a gated repo without access), and the error names the
    /// file, not the token.
    #[test]
    fn a_fetch_sends_the_token_as_a_bearer() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            conn.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            let _ = conn.write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            String::from_utf8_lossy(&head).to_ascii_lowercase()
        });
        let cache = tempfile::tempdir().unwrap();
        let hub = HubConfig::new(cache.path(), false).with_endpoint(url).with_token("hf_secret_value");
        let err = hub.file("org/gated", "main", "config.json").unwrap_err().to_string();
        let head = server.join().unwrap();
        assert!(head.contains("authorization: bearer hf_secret_value"), "{head}");
        assert!(head.contains("/org/gated/resolve/main/config.json"), "{head}");
        assert!(err.contains("config.json") && !err.contains("hf_secret_value"), "{err}");
    }

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
