//! What the store tells the engine: what a name resolves to, what a runtime load did, completed
//! loads, and what an unload leaves behind.

use std::sync::Arc;

use crate::error::Error;
use crate::ticket::{AdapterRef, LoadTicket};
use multilora_types::{AdapterGen, AdapterId};

/// What [`crate::Store::resolve`] found for a name: what a request holds from the moment it is
/// accepted, so that the name is never looked up again for it.
#[derive(Debug)]
pub enum Resolution {
    /// In host memory: the current generation and its weights, kept alive by the reference
    /// whatever the store does next (an unload, a reload, an eviction);
    /// [`crate::Store::admit`] puts it back in the CPU tier if it left.
    Ready(AdapterRef),
    /// A load is queued or running, or has finished and waits for a CPU entry to unpin (every
    /// entry was pinned: not a failure). The ticket follows that load: it ends as the generation
    /// the load read, even if the adapter is unloaded or reloaded meanwhile, or as its error. A
    /// [`LoadEvent`] is published when it ends.
    Loading(LoadTicket),
    /// The last load failed. Within the back-off ([`crate::StoreConfig::load_retry_backoff`],
    /// doubled per failure in a row) later requests get the same error without a new load; the
    /// first request after it loads again. [`crate::Store::retry`], a runtime `load` or a
    /// `reload_in_place` end it early.
    Failed(Arc<Error>),
}

/// What a runtime [`crate::Store::load`] or [`crate::Store::reload_in_place`] did with an
/// adapter it validated and registered: cached it now, or, with every CPU entry pinned, queued
/// it for the first entry that unpins (requests for it wait until then; none fails).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Loaded {
    /// In the CPU tier, current: requests are served at once.
    Cached(AdapterGen),
    /// Registered and current for new requests, waiting for a CPU entry to unpin; a
    /// [`LoadEvent::Ready`] follows when it goes in.
    WaitingForRoom(AdapterGen),
}

impl Loaded {
    /// The generation loaded.
    pub fn generation(&self) -> AdapterGen {
        match *self {
            Loaded::Cached(generation) | Loaded::WaitingForRoom(generation) => generation,
        }
    }

    /// Whether it is in the CPU tier already.
    pub fn is_cached(&self) -> bool {
        matches!(self, Loaded::Cached(_))
    }
}

/// A background load that finished, as [`crate::Store::poll_completed`] reports it. Requests
/// waiting on the load hold its [`LoadTicket`], which has ended too: the event tells their owner
/// to look.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum LoadEvent {
    /// `name` is in the CPU tier as `generation`.
    Ready {
        /// The adapter.
        name: String,
        /// Its loaded generation.
        generation: AdapterGen,
    },
    /// A load that finished after its adapter was unloaded or reloaded (or, for a resolved
    /// name, taken by a runtime load): `generation` is not current and not cached, and serves
    /// only the requests accepted while it loaded (their tickets end with it).
    Superseded {
        /// The adapter.
        name: String,
        /// The generation the load read.
        generation: AdapterGen,
    },
    /// Loading `name` failed; every request waiting on it fails with `error`.
    Failed {
        /// The adapter.
        name: String,
        /// Why.
        error: Arc<Error>,
    },
}

impl LoadEvent {
    /// The adapter the event is about.
    pub fn name(&self) -> &str {
        match self {
            LoadEvent::Ready { name, .. } | LoadEvent::Superseded { name, .. } | LoadEvent::Failed { name, .. } => name,
        }
    }
}

/// What [`crate::Store::unload`] did. The name is gone at once: new requests get
/// `model_not_found`. Requests accepted before keep what they hold (their generation, or the
/// ticket of its load) and finish on it; the generation leaves both tiers with the last of them.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Unloaded {
    /// The adapter's id.
    pub id: AdapterId,
    /// Its name.
    pub name: String,
    /// Its current generation, if it was loaded.
    pub generation: Option<AdapterGen>,
    /// Whether running requests still pin it (it leaves the tiers when they finish).
    pub draining: bool,
}
