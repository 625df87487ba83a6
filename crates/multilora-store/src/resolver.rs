//! Resolvers: asked in order, on a loader thread, for the source of an adapter name nobody
//! registered. Two built in: a directory of adapters, and a hub organisation.

use std::path::{Path, PathBuf};

use multilora_adapter::{AdapterSource, CONFIG_FILE};

use crate::error::Result;
use crate::security::confine_path;

/// Maps an unknown adapter name to a source. Synchronous: it runs on a loader thread, never on
/// the engine's. The store confines what it returns like any runtime source.
pub trait Resolver: Send + Sync {
    /// `Ok(None)`: this resolver does not provide `name` (the next one is asked). An error fails
    /// the request for `name` with it.
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>>;
}

/// `name` → `<root>/<name>`, when that directory holds an `adapter_config.json` and lies inside
/// `root` after resolving symlinks. Names are validated before any resolver sees them (no
/// separators, not `..`), and the store checks the result against its allowed roots as well.
#[derive(Clone, Debug)]
pub struct DirectoryResolver {
    root: PathBuf,
}

impl DirectoryResolver {
    /// A resolver over the adapters under `root`.
    pub fn new(root: impl Into<PathBuf>) -> DirectoryResolver {
        DirectoryResolver { root: root.into() }
    }

    /// The directory it looks in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/<name>` once every link is resolved, when it holds an `adapter_config.json` and
    /// lies inside `root`: what [`Resolver::resolve`] answers, as a directory.
    pub fn resolve_dir(&self, name: &str) -> Result<Option<PathBuf>> {
        let dir = self.root.join(name);
        if !dir.join(CONFIG_FILE).is_file() {
            return Ok(None);
        }
        confine_path(name, &dir, std::slice::from_ref(&self.root)).map(Some)
    }
}

impl Resolver for DirectoryResolver {
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>> {
        Ok(self.resolve_dir(name)?.map(AdapterSource::Local))
    }
}

/// `name` → hub repo `<org>/<name>` at `main`. Off unless the engine adds it, and the store
/// refuses its answers unless hub loading at run time is enabled.
#[derive(Clone, Debug)]
pub struct HubResolver {
    org: String,
}

impl HubResolver {
    /// A resolver into the hub organisation (or user) `org`.
    pub fn new(org: impl Into<String>) -> HubResolver {
        HubResolver { org: org.into() }
    }
}

impl Resolver for HubResolver {
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>> {
        // Only names that are valid hub repo names map; anything else is not this resolver's.
        let valid = !name.starts_with(['.', '-'])
            && !name.contains("..")
            && name.len() <= 96
            && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid {
            return Ok(None);
        }
        Ok(Some(AdapterSource::Hub { repo: format!("{}/{name}", self.org), revision: "main".to_string() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_resolver_maps_names_under_its_root() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("sql")).unwrap();
        std::fs::write(tmp.path().join("sql").join(CONFIG_FILE), "{}").unwrap();
        std::fs::create_dir_all(tmp.path().join("empty")).unwrap();
        let resolver = DirectoryResolver::new(tmp.path());
        let expected = tmp.path().join("sql").canonicalize().unwrap();
        assert_eq!(resolver.resolve("sql").unwrap(), Some(AdapterSource::Local(expected)));
        assert_eq!(resolver.resolve("empty").unwrap(), None);
        assert_eq!(resolver.resolve("missing").unwrap(), None);
    }

    #[cfg(unix)]
    #[test]
    fn directory_resolver_refuses_a_symlink_out() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join(CONFIG_FILE), "{}").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("evil")).unwrap();
        let err = DirectoryResolver::new(&root).resolve("evil").unwrap_err();
        assert_eq!(err.kind(), "path_outside_roots");
    }

    #[test]
    fn hub_resolver_maps_valid_names_only() {
        let resolver = HubResolver::new("acme");
        assert_eq!(
            resolver.resolve("sql-lora").unwrap(),
            Some(AdapterSource::Hub { repo: "acme/sql-lora".into(), revision: "main".into() })
        );
        for name in ["..x", "a b", ".hidden", "日本"] {
            assert_eq!(resolver.resolve(name).unwrap(), None, "{name}");
        }
    }
}
