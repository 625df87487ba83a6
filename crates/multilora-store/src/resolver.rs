//! The built-in resolvers, implemented once against `multilora-types`' [`Resolver`] (the trait
//! the engine re-exports for embedders): a directory of adapters, and an allow-list of hub
//! repositories. Each also lists what it offers ([`Resolver::offered`]), so that a server lists
//! adapters a router may send it before any request loaded them. Their refusals are the store's
//! own [`Error`]s inside the [`ResolveError`], which the store takes back out
//! ([`resolver_error`]), so they keep their kind (`path_outside_roots`, `resolver_io`, `config`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use multilora_adapter::CONFIG_FILE;
use multilora_types::{AdapterSource, ResolveError, Resolver};

use crate::error::{Error, Result};
use crate::registry::validate_name;
use crate::security::confine_path;

/// The most names one resolver lists: a directory holding more is listed in part (sorted by
/// name), and every name in it still resolves on request.
pub const MAX_OFFERED: usize = 4096;

/// The store's error for a resolver's failure about `name`: the store's own error as it is (a
/// built-in resolver's refusal), any other as [`Error::Resolver`].
pub(crate) fn resolver_error(name: &str, e: ResolveError) -> Error {
    match e.downcast::<Error>() {
        Ok(own) => own,
        Err(other) => Error::Resolver { name: name.to_string(), source: other.into_inner() },
    }
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
    fn resolve_dir(&self, name: &str) -> Result<Option<PathBuf>> {
        let dir = self.root.join(name);
        if !dir.join(CONFIG_FILE).is_file() {
            return Ok(None);
        }
        confine_path(name, &dir, std::slice::from_ref(&self.root)).map(Some)
    }

    /// The subdirectories of `root` that [`DirectoryResolver::resolve_dir`] answers for, sorted
    /// by name, at most [`MAX_OFFERED`]: names that are not valid adapter names (hidden ones
    /// included) and links out of the root are left out, as a request for them is refused.
    fn list(&self) -> Result<Vec<(String, PathBuf)>> {
        let entries =
            std::fs::read_dir(&self.root).map_err(|source| Error::ResolverIo { root: self.root.clone(), source })?;
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| !n.starts_with('.') && validate_name(n, "").is_ok())
            .collect();
        names.sort_unstable();
        let mut out = Vec::new();
        for name in names {
            if out.len() == MAX_OFFERED {
                break;
            }
            if let Ok(Some(dir)) = self.resolve_dir(&name) {
                out.push((name, dir));
            }
        }
        Ok(out)
    }
}

impl Resolver for DirectoryResolver {
    fn resolve(&self, name: &str) -> std::result::Result<Option<AdapterSource>, ResolveError> {
        Ok(self.resolve_dir(name).map_err(ResolveError::new)?.map(AdapterSource::Local))
    }

    /// The subdirectories of the root holding an `adapter_config.json`, sorted by name (at most
    /// [`MAX_OFFERED`]); names a request could not use, and links out of the root, are left out.
    fn offered(&self) -> std::result::Result<Vec<(String, AdapterSource)>, ResolveError> {
        let list = self.list().map_err(ResolveError::new)?;
        Ok(list.into_iter().map(|(name, dir)| (name, AdapterSource::Local(dir))).collect())
    }
}

/// An allow-list of hub repositories (vLLM's hub resolver, `VLLM_LORA_RESOLVER_HF_REPO_LIST`),
/// each served under its repository name: `acme/sql-lora` answers the name `sql-lora` (a name
/// cannot hold a `/`, since names also name directories), at the revision given (`org/name@rev`)
/// or `main`. Nothing outside the list is ever asked of the hub; the store loads these
/// repositories at run time because they are on the list ([`crate::StoreConfig::allowed_hub_repo`],
/// the engine's `allowed_lora_hub_repo`), not because hub sources are allowed in general.
#[derive(Clone, Debug)]
pub struct HubResolver {
    /// Name → (repo, revision).
    repos: BTreeMap<String, (String, String)>,
}

impl HubResolver {
    /// A resolver over `repos` (`org/name` or `org/name@revision` each). Refused: a repo id that
    /// is not `org/name`, and two repos with the same name (a request could not say which); the
    /// error holds the store's [`Error::Config`] naming it.
    pub fn new<S: AsRef<str>>(repos: impl IntoIterator<Item = S>) -> std::result::Result<HubResolver, ResolveError> {
        HubResolver::parse(repos).map_err(ResolveError::new)
    }

    fn parse<S: AsRef<str>>(repos: impl IntoIterator<Item = S>) -> Result<HubResolver> {
        let mut map = BTreeMap::new();
        for spec in repos {
            let spec = spec.as_ref().trim();
            let bad = |reason: &str| Error::Config { reason: format!("hub resolver repo {spec:?}: {reason}") };
            let (repo, revision) = match spec.split_once('@') {
                Some((repo, rev)) if !rev.is_empty() => (repo, rev),
                Some(_) => return Err(bad("an empty revision after '@'")),
                None => (spec, "main"),
            };
            let (org, name) = repo.split_once('/').ok_or_else(|| bad("not an `org/name` repo id"))?;
            let part_ok = |p: &str| {
                !p.is_empty()
                    && !p.starts_with(['.', '-'])
                    && !p.contains("..")
                    && p.len() <= 96
                    && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            };
            if !part_ok(org) || !part_ok(name) {
                return Err(bad("not an `org/name` repo id"));
            }
            if let Some((other, _)) = map.get(name) {
                return Err(bad(&format!("its name {name:?} is also the name of {other:?}")));
            }
            map.insert(name.to_string(), (repo.to_string(), revision.to_string()));
        }
        Ok(HubResolver { repos: map })
    }

    /// The repository ids on the list (without revisions).
    pub fn repos(&self) -> impl Iterator<Item = &str> {
        self.repos.values().map(|(repo, _)| repo.as_str())
    }

    fn source(&self, name: &str) -> Option<AdapterSource> {
        let (repo, revision) = self.repos.get(name)?;
        Some(AdapterSource::Hub { repo: repo.clone(), revision: revision.clone() })
    }
}

impl Resolver for HubResolver {
    fn resolve(&self, name: &str) -> std::result::Result<Option<AdapterSource>, ResolveError> {
        Ok(self.source(name))
    }

    /// Every name on the list.
    fn offered(&self) -> std::result::Result<Vec<(String, AdapterSource)>, ResolveError> {
        Ok(self.repos.keys().filter_map(|name| Some((name.clone(), self.source(name)?))).take(MAX_OFFERED).collect())
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
        let err = resolver_error("evil", DirectoryResolver::new(&root).resolve("evil").unwrap_err());
        assert_eq!(err.kind(), "path_outside_roots");
    }

    #[test]
    fn directory_resolver_lists_what_it_resolves() {
        let tmp = tempfile::tempdir().unwrap();
        for name in ["sql", "chat", ".hidden"] {
            std::fs::create_dir_all(tmp.path().join(name)).unwrap();
            std::fs::write(tmp.path().join(name).join(CONFIG_FILE), "{}").unwrap();
        }
        std::fs::create_dir_all(tmp.path().join("empty")).unwrap();
        std::fs::write(tmp.path().join("file"), "x").unwrap();
        let resolver = DirectoryResolver::new(tmp.path());
        let names: Vec<String> = resolver.list().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["chat", "sql"]);
        let offered = resolver.offered().unwrap();
        assert_eq!(
            offered[1],
            ("sql".to_string(), AdapterSource::Local(tmp.path().join("sql").canonicalize().unwrap()))
        );
        let missing = DirectoryResolver::new(tmp.path().join("nope")).list().unwrap_err();
        assert_eq!(missing.kind(), "resolver_io");
        assert!(missing.to_string().contains("nope"), "{missing}");
    }

    #[test]
    fn hub_resolver_answers_its_allow_list_only() {
        let resolver = HubResolver::new(["acme/sql-lora", "acme/chat@v2"]).unwrap();
        assert_eq!(
            resolver.resolve("sql-lora").unwrap(),
            Some(AdapterSource::Hub { repo: "acme/sql-lora".into(), revision: "main".into() })
        );
        assert_eq!(
            resolver.resolve("chat").unwrap(),
            Some(AdapterSource::Hub { repo: "acme/chat".into(), revision: "v2".into() })
        );
        for name in ["acme", "other", "sql", "..", "acme/sql-lora"] {
            assert_eq!(resolver.resolve(name).unwrap(), None, "{name}");
        }
        let names: Vec<String> = resolver.offered().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["chat", "sql-lora"]);
        assert_eq!(resolver.repos().collect::<Vec<_>>(), ["acme/chat", "acme/sql-lora"]);
        for (bad, why) in [
            (vec!["sql-lora"], "org/name"),
            (vec!["acme/../x"], "org/name"),
            (vec!["acme/x@"], "empty revision"),
            (vec!["a/x", "b/x"], "also the name of"),
        ] {
            let err = resolver_error("", HubResolver::new(bad.clone()).unwrap_err());
            assert_eq!(err.kind(), "config");
            assert!(err.to_string().contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn an_embedders_error_is_the_resolvers_and_the_stores_own_stays_itself() {
        struct Failing;
        impl Resolver for Failing {
            fn resolve(&self, _: &str) -> std::result::Result<Option<AdapterSource>, ResolveError> {
                Err(ResolveError::new("registry unreachable"))
            }
        }
        let err = resolver_error("sql", Failing.resolve("sql").unwrap_err());
        assert_eq!(err.kind(), "resolver");
        assert_eq!(err.to_string(), "adapter \"sql\": the resolver failed: registry unreachable");
        assert_eq!(std::error::Error::source(&err).map(|s| s.to_string()).as_deref(), Some("registry unreachable"));
        let own = ResolveError::new(Error::UnknownAdapter { name: "x".into() });
        assert_eq!(own.to_string(), Error::UnknownAdapter { name: "x".into() }.to_string());
        assert_eq!(resolver_error("x", own).kind(), "unknown_adapter");
    }
}
