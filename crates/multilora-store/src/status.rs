//! What the store tells the engine: an adapter's readiness, completed loads, and what an unload
//! leaves behind.

use std::sync::Arc;

use crate::error::Error;
use multilora_types::{AdapterGen, AdapterId};

/// Where an adapter stands for a new request.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum AdapterStatus {
    /// In the CPU tier: the request can be scheduled on this generation.
    Ready(AdapterGen),
    /// A load is queued or running, or has finished and waits for a CPU entry to unpin (every
    /// entry was pinned: not a failure); a [`LoadEvent`] follows.
    Loading,
    /// The last load failed. Within the back-off ([`crate::StoreConfig::load_retry_backoff`],
    /// doubled per failure in a row) later requests get the same error without a new load; the
    /// first request after it loads again. [`crate::Store::retry`], a runtime `load` or a
    /// `reload_in_place` end it early.
    Failed(Arc<Error>),
}

/// A background load that finished, as [`crate::Store::poll_completed`] reports it. The engine
/// resolves its requests waiting on `name` from it: schedule them, or fail them with the error.
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
            LoadEvent::Ready { name, .. } | LoadEvent::Failed { name, .. } => name,
        }
    }
}

/// What [`crate::Store::unload`] did. The name is gone at once: new requests, and requests still
/// waiting for it, get `model_not_found`. Running requests keep `generation` (its CPU entry and
/// slot) until their last pin is released.
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
