//! `HostLease`: a preempted request's hold on its adapter generation, weaker than a
//! [`crate::SlotLease`]. While any host lease on a generation lives, its CPU entry is never
//! evicted, and a reload or unload retires the generation instead of dropping it, so the request
//! can resume on the weights it started with; its device slot is not pinned, so waiting requests
//! never hold slots that running ones need (`activate` writes the slot again from the CPU entry
//! on resume). The counts live with the slot pins (`slots.rs`); releasing the last pin of either
//! kind is handled alike (`lease.rs`). A host lease is returned by being dropped.

use std::sync::Arc;

use crate::error::Result;
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

    /// The generation this lease holds.
    pub fn generation(&self) -> AdapterGen {
        self.generation
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
