//! The built-in resolvers of adapter names nobody registered, as the engine's own types:
//! [`DirectoryResolver`] (vLLM's filesystem resolver) and [`HubResolver`] (an allow-list of hub
//! repositories). Each is the store's one implementation behind a handle of the engine's, so the
//! API names no type of the store; both answer through the shared [`Resolver`] trait, which the
//! store runs on its loader threads (and an embedder's own resolver can wrap either).

use std::path::{Path, PathBuf};

use multilora_types::{AdapterSource, ResolveError, Resolver};

/// `name` → `<root>/<name>`, when that directory holds an `adapter_config.json` and lies inside
/// `root` after resolving symlinks. Names are validated before any resolver sees them (no
/// separators, not `..`), and the store checks the result against its allowed roots as well
/// ([`crate::EngineBuilder::allowed_lora_root`]).
#[derive(Clone, Debug)]
pub struct DirectoryResolver(multilora_store::DirectoryResolver);

impl DirectoryResolver {
    /// A resolver over the adapters under `root`.
    pub fn new(root: impl Into<PathBuf>) -> DirectoryResolver {
        DirectoryResolver(multilora_store::DirectoryResolver::new(root))
    }

    /// The directory it looks in.
    pub fn root(&self) -> &Path {
        self.0.root()
    }
}

impl Resolver for DirectoryResolver {
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>, ResolveError> {
        self.0.resolve(name)
    }

    fn offered(&self) -> Result<Vec<(String, AdapterSource)>, ResolveError> {
        self.0.offered()
    }
}

/// `name` → the hub repository of that name on its allow-list (`org/name`, at its revision or
/// `main`). Nothing outside the list is ever asked of the hub; the store loads these
/// repositories at run time because they are on the list
/// ([`crate::EngineBuilder::allowed_lora_hub_repo`]), not because hub sources are allowed in
/// general.
#[derive(Clone, Debug)]
pub struct HubResolver(multilora_store::HubResolver);

impl HubResolver {
    /// A resolver over `repos` (`org/name` or `org/name@revision` each). Refused: a repo id that
    /// is not `org/name`, and two repos with the same name (a request could not say which).
    pub fn new<S: AsRef<str>>(repos: impl IntoIterator<Item = S>) -> Result<HubResolver, ResolveError> {
        multilora_store::HubResolver::new(repos).map(HubResolver)
    }

    /// The repository ids on the list (without revisions).
    pub fn repos(&self) -> impl Iterator<Item = &str> {
        self.0.repos()
    }
}

impl Resolver for HubResolver {
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>, ResolveError> {
        self.0.resolve(name)
    }

    fn offered(&self) -> Result<Vec<(String, AdapterSource)>, ResolveError> {
        self.0.offered()
    }
}
