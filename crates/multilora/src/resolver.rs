//! Resolvers of adapter names nobody registered (vLLM's `LoRAResolver`), in the engine's own
//! types: [`Resolver`] answers an [`AdapterSource`] or a [`ResolveError`], and lists what it
//! offers; [`DirectoryResolver`] (vLLM's filesystem resolver) and [`HubResolver`] (an allow-list
//! of hub repositories) are the built-in ones. The store below runs them on its loader threads
//! through `StoreResolver`, which converts the error, so an embedder names no crate below the
//! engine ([`AdapterSource`] is the shared type of `multilora-types`, re-exported).

use std::fmt;
use std::path::{Path, PathBuf};

pub use multilora_types::AdapterSource;

/// Why a resolver could not answer for a name. The request for that name fails with
/// `adapter_error` (`cause_kind` `resolver`) and this error as its source; a path the built-in
/// [`DirectoryResolver`] finds outside its root fails it with `invalid_request`, as any runtime
/// source outside the allowed roots does.
#[derive(Debug)]
pub struct ResolveError(Repr);

#[derive(Debug)]
enum Repr {
    /// The store's own refusal, from [`DirectoryResolver`]: handed back to it as it is.
    Store(multilora_store::Error),
    /// An embedder's resolver's error.
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl ResolveError {
    /// A resolver's failure: any error, or a message.
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> ResolveError {
        ResolveError(Repr::Other(error.into()))
    }

    /// The store's error for `name`.
    fn into_store(self, name: &str) -> multilora_store::Error {
        match self.0 {
            Repr::Store(e) => e,
            Repr::Other(source) => multilora_store::Error::Resolver { name: name.to_string(), source },
        }
    }
}

// Transparent: the message and the source are those of the error it holds.
impl fmt::Display for ResolveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Store(e) => e.fmt(f),
            Repr::Other(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ResolveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0 {
            Repr::Store(e) => e.source(),
            Repr::Other(e) => e.source(),
        }
    }
}

/// Maps an adapter name nobody registered to where its files are. Synchronous: it runs on one of
/// the store's loader threads, never on the engine's, and the engine confines what it answers
/// to the allowed roots like any runtime source.
pub trait Resolver: Send + Sync {
    /// `Ok(None)`: this resolver does not provide `name` (the next one is asked). An error fails
    /// the requests for `name` with it.
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>, ResolveError>;

    /// The names this resolver answers for and their sources, as far as it can tell without
    /// loading anything: what [`crate::EngineHandle::discoverable_adapters`] lists, so that a
    /// router that reads a server's model list sends it adapters nobody requested yet. A
    /// resolver over an open-ended space of names (a lookup service) offers none up front, which
    /// is what this default says.
    fn offered(&self) -> Result<Vec<(String, AdapterSource)>, ResolveError> {
        Ok(Vec::new())
    }
}

/// `name` → `<root>/<name>`, when that directory holds an `adapter_config.json` and lies inside
/// `root` after resolving symlinks. Names are validated before any resolver sees them (no
/// separators, not `..`), and the result is checked against the allowed roots as well.
#[derive(Clone, Debug)]
pub struct DirectoryResolver {
    inner: multilora_store::DirectoryResolver,
}

impl DirectoryResolver {
    /// A resolver over the adapters under `root`.
    pub fn new(root: impl Into<PathBuf>) -> DirectoryResolver {
        DirectoryResolver { inner: multilora_store::DirectoryResolver::new(root) }
    }

    /// The directory it looks in.
    pub fn root(&self) -> &Path {
        self.inner.root()
    }
}

impl Resolver for DirectoryResolver {
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>, ResolveError> {
        match self.inner.resolve_dir(name) {
            Ok(dir) => Ok(dir.map(AdapterSource::Local)),
            Err(e) => Err(ResolveError(Repr::Store(e))),
        }
    }

    /// The subdirectories of the root holding an `adapter_config.json`, sorted by name (at most
    /// 4,096); names a request could not use, and links out of the root, are left out.
    fn offered(&self) -> Result<Vec<(String, AdapterSource)>, ResolveError> {
        match self.inner.list() {
            Ok(list) => Ok(list.into_iter().map(|(name, dir)| (name, AdapterSource::Local(dir))).collect()),
            Err(e) => Err(ResolveError(Repr::Store(e))),
        }
    }
}

/// An allow-list of hub repositories (vLLM's hub resolver, `VLLM_LORA_RESOLVER_HF_REPO_LIST`),
/// each served under its repository's name: `acme/sql-lora` answers requests for `sql-lora`, at
/// the revision given (`org/name@rev`) or `main` (a name here holds no `/`, since names also name
/// directories). Nothing outside the list is asked of the hub. The engine loads a hub source at
/// run time only from a repository it was told to allow: pass each of [`HubResolver::repos`] to
/// [`crate::EngineBuilder::allowed_lora_hub_repo`].
#[derive(Clone, Debug)]
pub struct HubResolver {
    inner: multilora_store::HubResolver,
}

impl HubResolver {
    /// A resolver over `repos` (`org/name` or `org/name@revision`). Refused with an error naming
    /// it: a repo id that is not `org/name`, and two repositories of the same name.
    pub fn new<S: AsRef<str>>(repos: impl IntoIterator<Item = S>) -> Result<HubResolver, ResolveError> {
        match multilora_store::HubResolver::new(repos) {
            Ok(inner) => Ok(HubResolver { inner }),
            Err(e) => Err(ResolveError(Repr::Store(e))),
        }
    }

    /// The repository ids on the list (`org/name`, without revisions).
    pub fn repos(&self) -> impl Iterator<Item = &str> {
        self.inner.repos()
    }
}

impl Resolver for HubResolver {
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>, ResolveError> {
        match multilora_store::Resolver::resolve(&self.inner, name) {
            Ok(source) => Ok(source),
            Err(e) => Err(ResolveError(Repr::Store(e))),
        }
    }

    /// Every name on the list.
    fn offered(&self) -> Result<Vec<(String, AdapterSource)>, ResolveError> {
        match multilora_store::Resolver::offered(&self.inner) {
            Ok(list) => Ok(list),
            Err(e) => Err(ResolveError(Repr::Store(e))),
        }
    }
}

/// An embedder's resolver as the store asks it: the error converted to the store's.
pub(crate) struct StoreResolver<R>(pub(crate) R);

impl<R: Resolver> multilora_store::Resolver for StoreResolver<R> {
    fn resolve(&self, name: &str) -> multilora_store::Result<Option<AdapterSource>> {
        match self.0.resolve(name) {
            Ok(source) => Ok(source),
            Err(e) => Err(e.into_store(name)),
        }
    }

    fn offered(&self) -> multilora_store::Result<Vec<(String, AdapterSource)>> {
        match self.0.offered() {
            Ok(list) => Ok(list),
            Err(e) => Err(e.into_store("(listing)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_and_errors_convert_for_the_store() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("sql")).unwrap();
        std::fs::write(tmp.path().join("sql/adapter_config.json"), "{}").unwrap();
        let store = StoreResolver(DirectoryResolver::new(tmp.path()));
        let dir = tmp.path().join("sql").canonicalize().unwrap();
        let got = multilora_store::Resolver::resolve(&store, "sql").unwrap();
        assert_eq!(got, Some(AdapterSource::Local(dir)));
        assert_eq!(multilora_store::Resolver::resolve(&store, "absent").unwrap(), None);

        struct Failing;
        impl Resolver for Failing {
            fn resolve(&self, _: &str) -> Result<Option<AdapterSource>, ResolveError> {
                Err(ResolveError::new("registry unreachable"))
            }
        }
        let err = multilora_store::Resolver::resolve(&StoreResolver(Failing), "sql").unwrap_err();
        assert_eq!(err.kind(), "resolver");
        assert_eq!(err.to_string(), "adapter \"sql\": the resolver failed: registry unreachable");
        assert_eq!(std::error::Error::source(&err).map(|s| s.to_string()).as_deref(), Some("registry unreachable"));
    }
}
