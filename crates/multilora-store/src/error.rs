//! The store's error type: one enum, each variant naming the adapter it concerns.

use std::path::PathBuf;

use multilora_types::ModuleKind;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything the store can refuse or fail at.
///
/// Messages are lowercase and name the adapter. [`Error::kind`] gives a stable label for metrics;
/// for [`Error::Adapter`] it is the adapter crate's own label (`shape_mismatch`, `rank_too_large`…),
/// so load failures are counted by their real cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No adapter of that name is registered, and no resolver provides one. The engine answers
    /// `model_not_found`.
    #[error("adapter {name:?} not found")]
    UnknownAdapter {
        /// The name asked for.
        name: String,
    },
    /// The name cannot name an adapter.
    #[error("adapter name {name:?} is invalid: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `load` of a name that is taken; `reload_in_place` replaces an adapter.
    #[error("adapter {name:?} is already registered; use reload_in_place to replace it")]
    AlreadyRegistered {
        /// The name.
        name: String,
    },
    /// A runtime change (load, unload, reload, resolvers) while runtime updates are off.
    #[error("cannot {op} adapter {name:?}: runtime adapter updates are disabled")]
    RuntimeUpdatesDisabled {
        /// What was attempted: `load`, `unload`, `reload`, `resolve`.
        op: &'static str,
        /// The adapter.
        name: String,
    },
    /// A runtime source lies outside every allowed root (after resolving `..` and links). One
    /// message for every such path, whether it exists or not and whatever it is, and the roots
    /// are not named: the answer tells a client nothing about the file system outside them.
    #[error("adapter {name:?}: source {} is outside the allowed roots", path.display())]
    PathOutsideRoots {
        /// The adapter.
        name: String,
        /// The path as the caller gave it.
        path: PathBuf,
    },
    /// A hub source at run time while hub loading at run time is off.
    #[error("adapter {name:?}: hub source {repo:?} refused: loading from the hub at run time is disabled")]
    HubDisabled {
        /// The adapter.
        name: String,
        /// The hub repository id.
        repo: String,
    },
    /// `activate` found every slot pinned by running requests (or the operator); with
    /// `max_loras` 0 there are no slots at all.
    #[error("cannot activate adapter {name:?}: all {max_loras} slots are pinned")]
    AllSlotsPinned {
        /// The adapter that wanted a slot.
        name: String,
        /// The number of slots.
        max_loras: usize,
    },
    /// Every entry of the CPU tier is pinned, so a start-up adapter has no room (having changed
    /// nothing). Loads at run time, background or the operator's, wait for room instead.
    #[error("cannot cache adapter {name:?}: all {max_cpu_loras} entries of the cpu tier are pinned")]
    CpuTierFull {
        /// The adapter that wanted room.
        name: String,
        /// The capacity.
        max_cpu_loras: usize,
    },
    /// The adapter targets module kinds that have no slot buffers (not in the store's
    /// [`LoraLimits::target_modules`](multilora_types::LoraLimits::target_modules)): it could not
    /// be served, so it is refused before it is registered or swapped in.
    #[error("adapter {name:?} targets {}, which have no lora slots", module_list(modules))]
    UntargetedModules {
        /// The adapter.
        name: String,
        /// The module kinds it targets that have no slot buffers, sorted.
        modules: Vec<ModuleKind>,
    },
    /// `activate` or `lease` of a generation that is not in the CPU tier (not loaded yet, evicted,
    /// or superseded and released).
    #[error("adapter {name:?} is not loaded")]
    NotReady {
        /// The adapter (or its id when it is no longer registered).
        name: String,
    },
    /// The configuration is inconsistent.
    #[error("invalid store configuration: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// A loader thread could not be started.
    #[error("cannot start loader thread {index}: {source}")]
    LoaderThread {
        /// Which thread.
        index: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading or validating the adapter failed.
    #[error(transparent)]
    Adapter(#[from] multilora_adapter::Error),
    /// The adapter loader panicked (a bug in it); the store carries on.
    #[error("adapter {name:?}: the loader panicked")]
    LoaderPanicked {
        /// The adapter.
        name: String,
    },
    /// A start-up adapter failed to load: what [`crate::StoreBuilder::build`] returns, naming it.
    /// [`Error::kind`] is the cause's.
    #[error("{}", startup_message(name, source))]
    Startup {
        /// The start-up adapter.
        name: String,
        /// Why it failed.
        source: Box<Error>,
    },
    /// A resolver other than the store's own failed for `name` (an embedder's: its error is
    /// kept as the source).
    #[error("adapter {name:?}: the resolver failed: {source}")]
    Resolver {
        /// The adapter name asked for.
        name: String,
        /// The resolver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A resolver's directory could not be listed.
    #[error("the adapter directory {}: {source}", root.display())]
    ResolverIo {
        /// The directory.
        root: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store is shutting down; the load was abandoned.
    #[error("adapter {name:?}: the store is shutting down")]
    Shutdown {
        /// The adapter.
        name: String,
    },
}

impl Error {
    /// A stable snake_case label for metrics and API error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::UnknownAdapter { .. } => "unknown_adapter",
            Error::InvalidName { .. } => "invalid_name",
            Error::AlreadyRegistered { .. } => "already_registered",
            Error::RuntimeUpdatesDisabled { .. } => "runtime_updates_disabled",
            Error::PathOutsideRoots { .. } => "path_outside_roots",
            Error::HubDisabled { .. } => "hub_disabled",
            Error::AllSlotsPinned { .. } => "all_slots_pinned",
            Error::CpuTierFull { .. } => "cpu_tier_full",
            Error::UntargetedModules { .. } => "not_a_target",
            Error::NotReady { .. } => "not_ready",
            Error::Config { .. } | Error::LoaderThread { .. } => "config",
            Error::Adapter(e) => e.kind(),
            Error::LoaderPanicked { .. } => "loader_panicked",
            Error::Resolver { .. } => "resolver",
            Error::ResolverIo { .. } => "resolver_io",
            Error::Shutdown { .. } => "shutdown",
            Error::Startup { source, .. } => source.kind(),
        }
    }
}

/// The cause's message, prefixed with the start-up adapter's name unless it already names it.
fn startup_message(name: &str, source: &Error) -> String {
    let message = source.to_string();
    if message.contains(&format!("{name:?}")) { message } else { format!("start-up adapter {name:?}: {message}") }
}

/// `q_proj, lm_head`: module kinds by their short names.
fn module_list(modules: &[ModuleKind]) -> String {
    modules.iter().map(|k| k.short_name()).collect::<Vec<_>>().join(", ")
}
