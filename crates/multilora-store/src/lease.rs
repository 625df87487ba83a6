//! `SlotLease`: a running request's hold on its adapter generation. While any lease on a
//! generation lives, its CPU entry stays and its slot, once it has one, is not evicted; dropping
//! the last lease of a generation that was superseded or unloaded removes it from both tiers,
//! and the last lease of any generation lets in a load that was waiting for a CPU entry.
//! Nothing releases a pin by hand: a lease is returned by being dropped.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::store::Shared;
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
        let mut inner = shared.state.lock();
        if !inner.cpu.contains(&generation) && inner.slots.slot_of(&generation).is_none() {
            return Err(Error::NotReady { name: inner.name_of(generation.id) });
        }
        inner.slots.pin(generation);
        Ok(SlotLease { shared: Arc::clone(shared), generation })
    }

    /// The generation this lease pins.
    pub fn generation(&self) -> AdapterGen {
        self.generation
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        let mut inner = self.shared.state.lock();
        let g = self.generation;
        if inner.slots.release(&g) != Some(0) {
            return;
        }
        if inner.registry.current(g.id) != Some(g) {
            inner.cpu.remove(&g);
            inner.slots.remove(&g);
        }
        // The last pin is gone: a load waiting for room may go in (its event sent from here).
        let events = inner.admit_waiting();
        self.shared.publish(inner, events);
    }
}

impl std::fmt::Debug for SlotLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotLease").field("generation", &self.generation).finish()
    }
}
