//! Loads waiting for room: a load (background, or an operator's runtime load or reload) that
//! finished while every CPU entry was pinned is not a failure. Its validated adapter is held
//! here, the adapter stays `Loading` (new requests wait on it), and the store admits it when an
//! entry unpins or leaves (a last slot or host lease dropped, an operator pin cleared, an
//! unload): those calls retry the queue, so nothing polls. One superseded meanwhile (unloaded,
//! reloaded) is cached for no one; the requests that hold its ticket get it all the same.

use std::sync::Arc;
use std::time::Duration;

use multilora_adapter::LoraAdapter;
use multilora_types::AdapterId;

use crate::registry::LoadState;
use crate::status::LoadEvent;
use crate::store::Inner;
use crate::ticket::AdapterRef;

/// A loaded, validated adapter that found the CPU tier full of pinned entries.
#[derive(Debug)]
pub(crate) struct Waiting {
    pub(crate) id: AdapterId,
    pub(crate) name: String,
    /// The load's ticket: a waiting load whose adapter was unloaded, reloaded or loaded again
    /// meanwhile no longer matches its entry, and is dropped.
    pub(crate) ticket: u64,
    pub(crate) adapter: Arc<LoraAdapter>,
    /// How long the load itself took (observed once it is admitted).
    pub(crate) elapsed: Duration,
}

impl Inner {
    /// Retries the waiting loads, oldest first, after an entry unpinned or left: each that fits
    /// goes in the CPU tier (a `Ready` event; its tickets end with it), each that is stale ends
    /// for its tickets' holders only, the rest wait on.
    pub(crate) fn admit_waiting(&mut self) -> Vec<LoadEvent> {
        let mut events = Vec::new();
        for waiting in std::mem::take(&mut self.waiting) {
            let Waiting { id, name, ticket, adapter, elapsed } = waiting;
            let current =
                self.registry.get(id).is_some_and(|e| matches!(e.state, LoadState::Loading(t) if t == ticket));
            if !current {
                events.extend(self.settle_superseded(name, ticket, Some(id), Ok(adapter), elapsed));
                continue;
            }
            match self.try_insert(id, Arc::clone(&adapter), elapsed) {
                Ok(generation) => {
                    self.settle(ticket, Ok(AdapterRef::new(generation, adapter)));
                    events.push(LoadEvent::Ready { name, generation });
                }
                Err(adapter) => self.waiting.push_back(Waiting { id, name, ticket, adapter, elapsed }),
            }
        }
        events
    }
}
