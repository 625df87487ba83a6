//! `HostLease`: a waiting or preempted request's hold on its adapter generation, weaker than a
//! [`crate::SlotLease`]. While any host lease on a generation lives, its CPU entry is never
//! evicted, and a reload or unload retires the generation instead of dropping it, so the request
//! runs (or resumes) on the weights it was accepted with; its device slot is not pinned, so
//! waiting requests never hold slots that running ones need (`activate` writes the slot again
//! from the CPU entry when it runs). The counts live with the slot pins (`slots.rs`); releasing
//! the last pin of either kind is handled alike (`lease.rs`). A host lease becomes a slot lease
//! when its request runs ([`HostLease::run`]) and back when it is preempted, in one step each
//! so that the generation is never unheld; it is returned by being dropped.

use std::sync::Arc;

use crate::error::Result;
use crate::lease::SlotLease;
use crate::slots::PinKind;
use crate::store::Shared;
use multilora_types::AdapterGen;

/// One host pin on `generation`, returned on drop. From [`crate::Store::host_lease`].
#[must_use = "a host lease keeps its generation in host memory only while it is held"]
pub struct HostLease {
    shared: Arc<Shared>,
    generation: AdapterGen,
}

impl HostLease {
    /// Host-pins `generation`, which must be in the CPU tier or in a slot.
    pub(crate) fn new(shared: &Arc<Shared>, generation: AdapterGen) -> Result<HostLease> {
        shared.state.lock().add_pin(generation, PinKind::Host)?;
        Ok(HostLease { shared: Arc::clone(shared), generation })
    }

    /// The lease of a host pin on `generation` just added under the store's lock.
    pub(crate) fn pinned(shared: &Arc<Shared>, generation: AdapterGen) -> HostLease {
        HostLease { shared: Arc::clone(shared), generation }
    }

    /// The generation this lease holds.
    pub fn generation(&self) -> AdapterGen {
        self.generation
    }

    /// The request starts running: a [`SlotLease`] on the same generation, taken before this
    /// host lease is returned, so the generation is never unheld (and cannot fail: this lease
    /// keeps it in host memory).
    pub fn run(self) -> SlotLease {
        self.shared.state.lock().slots.pin(self.generation, PinKind::Slot);
        SlotLease::pinned(&self.shared, self.generation)
    }
}

impl Drop for HostLease {
    fn drop(&mut self) {
        let mut inner = self.shared.state.lock();
        let events = inner.drop_pin(self.generation, PinKind::Host);
        self.shared.publish(inner, events);
    }
}

impl std::fmt::Debug for HostLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLease").field("generation", &self.generation).finish()
    }
}
