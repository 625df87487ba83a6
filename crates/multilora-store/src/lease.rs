//! `SlotLease`: a running request's hold on its adapter generation. While any lease on a
//! generation lives, its CPU entry stays and its slot, once it has one, is not evicted. Dropping
//! the last pin of any kind (a `SlotLease` or a [`crate::HostLease`]) on a generation that was
//! superseded or unloaded removes it from both tiers, and the last pin of any generation lets in
//! a load that was waiting for a CPU entry. Nothing releases a pin by hand: a lease is returned
//! by being dropped.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::host_lease::HostLease;
use crate::slots::PinKind;
use crate::status::LoadEvent;
use crate::store::{Inner, Shared};
use multilora_types::AdapterGen;

/// One pin on `generation`, returned on drop. From [`crate::Store::lease`].
#[must_use = "a lease pins its generation only while it is held"]
pub struct SlotLease {
    shared: Arc<Shared>,
    generation: AdapterGen,
}

impl SlotLease {
    /// Pins `generation`, which must be in the CPU tier or in a slot.
    pub(crate) fn new(shared: &Arc<Shared>, generation: AdapterGen) -> Result<SlotLease> {
        shared.state.lock().add_pin(generation, PinKind::Slot)?;
        Ok(SlotLease { shared: Arc::clone(shared), generation })
    }

    /// The lease of a slot pin on `generation` just added under the store's lock.
    pub(crate) fn pinned(shared: &Arc<Shared>, generation: AdapterGen) -> SlotLease {
        SlotLease { shared: Arc::clone(shared), generation }
    }

    /// The generation this lease pins.
    pub fn generation(&self) -> AdapterGen {
        self.generation
    }

    /// The request is preempted: a [`HostLease`] on the same generation, taken before this
    /// lease's slot pin is returned, so the generation is never unheld.
    pub fn preempt(self) -> HostLease {
        self.shared.state.lock().slots.pin(self.generation, PinKind::Host);
        HostLease::pinned(&self.shared, self.generation)
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        let mut inner = self.shared.state.lock();
        let events = inner.drop_pin(self.generation, PinKind::Slot);
        self.shared.publish(inner, events);
    }
}

impl std::fmt::Debug for SlotLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotLease").field("generation", &self.generation).finish()
    }
}

impl Inner {
    /// Adds a pin of `kind` on `generation`, which must be in the CPU tier or in a slot.
    pub(crate) fn add_pin(&mut self, generation: AdapterGen, kind: PinKind) -> Result<()> {
        if !self.cpu.contains(&generation) && self.slots.slot_of(&generation).is_none() {
            return Err(Error::NotReady { name: self.name_of(generation.id) });
        }
        self.slots.pin(generation, kind);
        Ok(())
    }

    /// Drops a pin of `kind` on `generation`. When it was the last pin of either kind: a
    /// generation that is no longer current leaves both tiers, a current one held outside the
    /// capacity moves into a free live entry or leaves the CPU tier, and the waiting loads are
    /// retried (their events returned, for the caller to publish once it lets go of the lock).
    pub(crate) fn drop_pin(&mut self, generation: AdapterGen, kind: PinKind) -> Vec<LoadEvent> {
        if self.slots.release(&generation, kind) != Some(0) || self.slots.leased(&generation) {
            return Vec::new();
        }
        if self.registry.current(generation.id) != Some(generation) {
            self.cpu.remove(&generation);
            self.slots.remove(&generation);
            // The last pin is gone: a load waiting for room may go in.
            return self.admit_waiting();
        }
        // A current generation held outside the capacity (admitted while every entry was
        // pinned) takes a live entry only if one is free once the loads that waited for room
        // went in; otherwise it leaves the CPU tier like an evicted entry.
        let outside = self.cpu.take_outside(&generation);
        let events = self.admit_waiting();
        if let Some(adapter) = outside {
            let slots = &self.slots;
            if self.cpu.live_len() < self.cpu.capacity() {
                let _ = self.cpu.insert(generation, adapter, |g| slots.keeps_cpu(g));
            } else {
                self.counters.cpu_evictions += 1;
            }
        }
        events
    }
}
