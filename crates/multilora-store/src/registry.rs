//! The registry: adapter name → id, source, and what the last load learned (fingerprint, rank,
//! target modules); name validation. A plain data structure: no locks, no I/O.

use std::collections::HashMap;

use multilora_adapter::LoraAdapter;
use multilora_types::AdapterSource;
use multilora_types::{AdapterGen, AdapterId, Fingerprint, ModuleKind};

use crate::backoff::Failure;
use crate::error::{Error, Result};

/// The longest adapter name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 256;

/// What the registry knows about one adapter (for `/v1/models` and the operator).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct AdapterInfo {
    /// Its id.
    pub id: AdapterId,
    /// Its name.
    pub name: String,
    /// Where it is loaded from.
    pub source: AdapterSource,
    /// The current generation's fingerprint; `None` until first loaded.
    pub fingerprint: Option<Fingerprint>,
    /// Its largest module rank; `None` until first loaded.
    pub rank: Option<usize>,
    /// The module kinds it adapts; empty until first loaded.
    pub target_modules: Vec<ModuleKind>,
    /// Whether the operator pinned it (`pin_adapter`).
    pub operator_pinned: bool,
}

impl AdapterInfo {
    /// The current generation, once loaded.
    pub fn generation(&self) -> Option<AdapterGen> {
        self.fingerprint.map(|fingerprint| AdapterGen { id: self.id, fingerprint })
    }
}

/// Where an adapter's background load stands.
#[derive(Clone, Debug)]
pub(crate) enum LoadState {
    /// No load in flight and none failed (loaded or not yet asked for).
    Idle,
    /// A load is queued or running; its ticket tells a stale completion from the current one.
    Loading(u64),
    /// The last load failed: requests get its error until its back-off ends (then the next
    /// request loads again), or an explicit retry, load or reload.
    Failed(Failure),
}

/// One registered adapter.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub(crate) info: AdapterInfo,
    pub(crate) state: LoadState,
    /// Background loads that failed in a row since the last success (what the back-off doubles on).
    pub(crate) failures: u32,
}

/// Name → entry, with ids handed out in order.
#[derive(Debug)]
pub(crate) struct Registry {
    base_model_name: String,
    by_name: HashMap<String, AdapterId>,
    entries: HashMap<AdapterId, Entry>,
    next_id: u64,
}

impl Registry {
    pub(crate) fn new(base_model_name: impl Into<String>) -> Registry {
        Registry {
            base_model_name: base_model_name.into(),
            by_name: HashMap::new(),
            entries: HashMap::new(),
            next_id: 0,
        }
    }

    /// Checks `name` and records it with `source`; reads no file.
    pub(crate) fn register(&mut self, name: &str, source: AdapterSource) -> Result<AdapterId> {
        self.check_new(name)?;
        let id = self.fresh_id();
        let info = AdapterInfo {
            id,
            name: name.to_string(),
            source,
            fingerprint: None,
            rank: None,
            target_modules: Vec::new(),
            operator_pinned: false,
        };
        self.by_name.insert(name.to_string(), id);
        self.entries.insert(id, Entry { info, state: LoadState::Idle, failures: 0 });
        Ok(id)
    }

    /// An id no adapter is registered under: for a resolved load whose name a runtime `load`
    /// took meanwhile, which serves only the requests accepted while it ran.
    pub(crate) fn fresh_id(&mut self) -> AdapterId {
        let id = AdapterId(self.next_id);
        self.next_id += 1;
        id
    }

    /// Whether `name` could be registered now: valid and not taken.
    pub(crate) fn check_new(&self, name: &str) -> Result<()> {
        validate_name(name, &self.base_model_name)?;
        if self.by_name.contains_key(name) {
            return Err(Error::AlreadyRegistered { name: name.to_string() });
        }
        Ok(())
    }

    pub(crate) fn id(&self, name: &str) -> Option<AdapterId> {
        self.by_name.get(name).copied()
    }

    pub(crate) fn get(&self, id: AdapterId) -> Option<&Entry> {
        self.entries.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: AdapterId) -> Option<&mut Entry> {
        self.entries.get_mut(&id)
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<&Entry> {
        self.id(name).and_then(|id| self.entries.get(&id))
    }

    /// The name of `id`, for messages; ids outlive their entries in retired generations.
    pub(crate) fn name_of(&self, id: AdapterId) -> Option<&str> {
        self.entries.get(&id).map(|e| e.info.name.as_str())
    }

    pub(crate) fn remove(&mut self, name: &str) -> Option<Entry> {
        let id = self.by_name.remove(name)?;
        self.entries.remove(&id)
    }

    /// Records what a completed load learned: the adapter's current generation is now its.
    pub(crate) fn set_loaded(&mut self, id: AdapterId, adapter: &LoraAdapter) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.info.fingerprint = Some(adapter.fingerprint());
            entry.info.rank = Some(adapter.max_rank());
            entry.info.target_modules = adapter.target_kinds();
            entry.state = LoadState::Idle;
            entry.failures = 0;
        }
    }

    /// The current generation of `id`, if it is registered and loaded.
    pub(crate) fn current(&self, id: AdapterId) -> Option<AdapterGen> {
        self.entries.get(&id).and_then(|e| e.info.generation())
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every adapter, ordered by id (registration order).
    pub(crate) fn infos(&self) -> Vec<AdapterInfo> {
        let mut infos: Vec<AdapterInfo> = self.entries.values().map(|e| e.info.clone()).collect();
        infos.sort_by_key(|i| i.id);
        infos
    }
}

/// Checks that `name` can name an adapter: non-empty, at most [`MAX_NAME_LEN`] bytes, no path
/// separators or control characters, not `.` or `..` (a resolver joins names onto directories),
/// and not the base model's name (which requests use to mean "no adapter").
pub fn validate_name(name: &str, base_model_name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        Some("it is empty".to_string())
    } else if name.len() > MAX_NAME_LEN {
        Some(format!("it is {} bytes long; the limit is {MAX_NAME_LEN}", name.len()))
    } else if name.contains(['/', '\\']) {
        Some("it contains a path separator".to_string())
    } else if name.chars().any(char::is_control) {
        Some("it contains a control character".to_string())
    } else if name == "." || name == ".." {
        Some("it is a relative directory name".to_string())
    } else if name == base_model_name {
        Some("it is the base model's name".to_string())
    } else {
        None
    };
    match reason {
        Some(reason) => Err(Error::InvalidName { name: name.to_string(), reason }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn source(dir: &str) -> AdapterSource {
        AdapterSource::Local(PathBuf::from(dir))
    }

    #[test]
    fn names_are_validated() {
        let long = "x".repeat(MAX_NAME_LEN + 1);
        for (bad, why) in [
            ("", "empty"),
            ("a/b", "separator"),
            ("a\\b", "separator"),
            ("a\nb", "control"),
            ("a\0", "control"),
            ("..", "relative"),
            ("base", "base model"),
            (long.as_str(), "limit"),
        ] {
            let err = validate_name(bad, "base").unwrap_err();
            assert_eq!(err.kind(), "invalid_name");
            assert!(err.to_string().contains(why), "{bad:?}: {err}");
        }
        for good in ["sql-lora", "Sql_Lora.v2", "日本語", "a b", &"x".repeat(MAX_NAME_LEN)] {
            validate_name(good, "base").unwrap();
        }
    }

    #[test]
    fn ids_are_assigned_in_order_and_names_are_unique() {
        let mut registry = Registry::new("base");
        assert_eq!(registry.register("a", source("/a")).unwrap(), AdapterId(0));
        assert_eq!(registry.register("b", source("/b")).unwrap(), AdapterId(1));
        let err = registry.register("a", source("/other")).unwrap_err();
        assert_eq!(err.kind(), "already_registered");
        assert_eq!(registry.len(), 2);
        assert!(registry.remove("a").is_some());
        // A name freed by unload is registrable again, under a fresh id.
        assert_eq!(registry.register("a", source("/a")).unwrap(), AdapterId(2));
        let names: Vec<String> = registry.infos().into_iter().map(|i| i.name).collect();
        assert_eq!(names, ["b", "a"]);
        assert!(registry.by_name("b").is_some_and(|e| e.info.fingerprint.is_none()));
    }
}
