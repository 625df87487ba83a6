//! What a request holds of its adapter from the moment [`crate::Store::resolve`] accepts it, so
//! that its name is never looked up again: an [`AdapterRef`] (a generation and its weights, which
//! the reference itself keeps alive) when the adapter is in host memory, or a [`LoadTicket`] on
//! the load that `resolve` started or joined.
//!
//! Each load has a pending record under the store's lock, keyed by the load's ticket number, from
//! the moment the load is started until it ends and its last ticket is dropped. A load that ends
//! after its adapter was unloaded or reloaded is not cached (it is not current) but still ends
//! its tickets with the generation it read, so a request accepted while it loaded runs on what it
//! was accepted for, as vLLM's in-flight requests keep the adapter they were accepted with.

use std::sync::Arc;

use multilora_adapter::LoraAdapter;
use multilora_types::AdapterGen;

use crate::error::Error;
use crate::store::{Inner, Shared};

/// One adapter generation and its weights. Holding it keeps the weights in memory whatever the
/// store does (an unload, a reload, an eviction from the CPU tier); [`crate::Store::admit`] turns
/// it into a [`crate::HostLease`], putting the generation back in the CPU tier from these weights
/// if it left, without reading a file.
#[derive(Clone)]
pub struct AdapterRef {
    generation: AdapterGen,
    adapter: Arc<LoraAdapter>,
}

impl AdapterRef {
    pub(crate) fn new(generation: AdapterGen, adapter: Arc<LoraAdapter>) -> AdapterRef {
        AdapterRef { generation, adapter }
    }

    /// The generation.
    pub fn generation(&self) -> AdapterGen {
        self.generation
    }

    /// Its weights.
    pub fn adapter(&self) -> &Arc<LoraAdapter> {
        &self.adapter
    }
}

impl std::fmt::Debug for AdapterRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterRef")
            .field("name", &self.adapter.name())
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// A hold on one load, from [`crate::Resolution::Loading`]: [`LoadTicket::poll`] says when it
/// has ended, and with what. Dropping the last ticket of a load that has ended lets go of its
/// outcome; a load still running finishes either way (and is cached if it is still current).
#[must_use = "a ticket is how a request learns what its adapter's load ended with"]
pub struct LoadTicket {
    shared: Arc<Shared>,
    ticket: u64,
    name: String,
}

impl LoadTicket {
    /// A new hold on the load with `ticket`, whose record `inner` has (taken under the same lock
    /// that found the load, so the load cannot end unheld in between).
    pub(crate) fn hold(shared: &Arc<Shared>, inner: &mut Inner, ticket: u64, name: &str) -> LoadTicket {
        let pending = inner.pending.entry(ticket).or_insert_with(Pending::loading);
        pending.holders += 1;
        LoadTicket { shared: Arc::clone(shared), ticket, name: name.to_string() }
    }

    /// `None` while the load runs or waits for a CPU entry; then the generation it read (cached
    /// if it is still current, held outside the tiers otherwise) or its error.
    pub fn poll(&self) -> Option<std::result::Result<AdapterRef, Arc<Error>>> {
        let inner = self.shared.state.lock();
        match inner.pending.get(&self.ticket).map(|p| &p.outcome) {
            Some(Outcome::Loading) => None,
            Some(Outcome::Loaded(adapter)) => Some(Ok(adapter.clone())),
            Some(Outcome::Failed(error)) => Some(Err(Arc::clone(error))),
            // A held record is never removed; were it gone, the load's result is lost and the
            // request must not wait for it forever.
            None => Some(Err(Arc::new(Error::NotReady { name: self.name.clone() }))),
        }
    }

    /// The adapter name the load is for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The load's ticket number.
    pub(crate) fn number(&self) -> u64 {
        self.ticket
    }
}

impl Drop for LoadTicket {
    fn drop(&mut self) {
        let mut inner = self.shared.state.lock();
        if let Some(pending) = inner.pending.get_mut(&self.ticket) {
            pending.holders -= 1;
            if pending.holders == 0 && !matches!(pending.outcome, Outcome::Loading) {
                inner.pending.remove(&self.ticket);
            }
        }
    }
}

impl std::fmt::Debug for LoadTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadTicket").field("name", &self.name).field("ticket", &self.ticket).finish_non_exhaustive()
    }
}

/// The record of one load for its tickets.
#[derive(Debug)]
pub(crate) struct Pending {
    holders: usize,
    outcome: Outcome,
}

#[derive(Debug)]
enum Outcome {
    Loading,
    Loaded(AdapterRef),
    Failed(Arc<Error>),
}

impl Pending {
    fn loading() -> Pending {
        Pending { holders: 0, outcome: Outcome::Loading }
    }
}

impl Inner {
    /// Opens the record of a load just given `ticket`.
    pub(crate) fn open_ticket(&mut self, ticket: u64) {
        self.pending.insert(ticket, Pending::loading());
    }

    /// Whether a ticket of the load holds it.
    pub(crate) fn ticket_held(&self, ticket: u64) -> bool {
        self.pending.get(&ticket).is_some_and(|p| p.holders > 0)
    }

    /// Drops the record of the load with `ticket` if no ticket holds it; whether it did.
    pub(crate) fn drop_if_unheld(&mut self, ticket: u64) -> bool {
        if self.ticket_held(ticket) {
            return false;
        }
        self.pending.remove(&ticket);
        true
    }

    /// Ends the load with `ticket`: its holders, if any, see `outcome` on their next poll (the
    /// caller publishes an event so that they look); without holders the record goes.
    pub(crate) fn settle(&mut self, ticket: u64, outcome: std::result::Result<AdapterRef, Arc<Error>>) {
        if self.drop_if_unheld(ticket) {
            return;
        }
        if let Some(pending) = self.pending.get_mut(&ticket) {
            pending.outcome = match outcome {
                Ok(adapter) => Outcome::Loaded(adapter),
                Err(error) => Outcome::Failed(error),
            };
        }
    }

    /// Pending records (for the metrics and the leak checks of the tests).
    pub(crate) fn pending_loads(&self) -> usize {
        self.pending.len()
    }
}
