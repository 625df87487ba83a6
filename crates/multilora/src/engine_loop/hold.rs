//! `Hold`: what a live request holds of its adapter, from `submit`, where its model name is
//! resolved once, to its end, and every transition between its states. One state at a time, so
//! "a slot lease or a host lease, never both" holds by construction, and each change of pin is
//! one store call that takes the new pin before the old one goes, so the generation is never
//! unheld:
//!
//! ```text
//!  Loading(ticket) --load ends--> Accepted(ref) --admit--> Host(lease) --run--> Running(lease)
//!        \--load failed: the request fails            ^-------preempt-----------/
//! ```
//!
//! A request on the base model holds nothing (`Base`). Whatever an unload or reload does after
//! `submit`, the request finishes on the generation it was accepted with (the one whose load
//! `submit` started, for a cold adapter): the ticket ends with what that load read, the reference
//! keeps the weights alive, and `Store::admit` puts them back in host memory if they left. The
//! hold goes with the request: dropping it returns its pin.

use std::sync::Arc;

use multilora_store::{AdapterRef, HostLease, LoadTicket, Resolution, SlotLease, Store};
use multilora_types::AdapterGen;

/// What a live request holds of its adapter.
#[derive(Debug)]
pub(super) enum Hold {
    /// The base model: nothing to hold.
    Base,
    /// Accepted while its adapter loads: the ticket of the load `submit` started or joined.
    Loading(LoadTicket),
    /// Accepted on this generation, its weights in hand; not yet in the scheduler.
    Accepted(AdapterRef),
    /// In the scheduler, waiting or preempted: its generation's host-memory entry is pinned
    /// (never evicted, retired rather than dropped), its slot is not.
    Host(HostLease),
    /// Running: its slot is pinned too, so it is never evicted under the step.
    Running(SlotLease),
}

/// Where a request's adapter stands when the loop looks at it before admission.
#[derive(Debug)]
pub(super) enum Admission {
    /// In the scheduler's hands now: on this generation, or the base model (`None`).
    Admitted(Option<AdapterGen>),
    /// Its load is still running or waiting for a CPU entry.
    Loading,
    /// Its load failed.
    Failed(Arc<multilora_store::Error>),
}

impl Hold {
    /// What `submit` resolved the request's model to: `None` for the base model. A failure
    /// `submit` saw is refused there; here it fails the request.
    pub(super) fn accept(resolution: Option<Resolution>) -> Result<Hold, Arc<multilora_store::Error>> {
        match resolution {
            None => Ok(Hold::Base),
            Some(Resolution::Ready(adapter)) => Ok(Hold::Accepted(adapter)),
            Some(Resolution::Loading(ticket)) => Ok(Hold::Loading(ticket)),
            Some(Resolution::Failed(error)) => Err(error),
        }
    }

    /// Takes the request into the scheduler if its adapter is in hand: `Loading` becomes
    /// `Accepted` once its load ended, and `Accepted` becomes `Host`, pinning the generation's
    /// host-memory entry (`Store::admit` puts it back first if it left). Called once per request
    /// that leaves the engine's queue; a request already admitted stays as it is.
    pub(super) fn admit(&mut self, store: &Store) -> Admission {
        if let Hold::Loading(ticket) = self {
            match ticket.poll() {
                None => return Admission::Loading,
                Some(Err(error)) => return Admission::Failed(error),
                Some(Ok(adapter)) => *self = Hold::Accepted(adapter),
            }
        }
        if let Hold::Accepted(adapter) = self {
            *self = Hold::Host(store.admit(adapter));
        }
        Admission::Admitted(self.generation())
    }

    /// The request runs this step: its slot is pinned (`Host` → `Running`).
    pub(super) fn run(&mut self) {
        if let Hold::Host(_) = self
            && let Hold::Host(host) = std::mem::replace(self, Hold::Base)
        {
            *self = Hold::Running(host.run());
        }
    }

    /// The request is preempted: its slot is let go (a waiting request must not pin one), its
    /// host-memory entry kept (`Running` → `Host`).
    pub(super) fn preempt(&mut self) {
        if let Hold::Running(_) = self
            && let Hold::Running(lease) = std::mem::replace(self, Hold::Base)
        {
            *self = Hold::Host(lease.preempt());
        }
    }

    /// The generation the request runs on, once known (`None` for the base model and while its
    /// load runs).
    pub(super) fn generation(&self) -> Option<AdapterGen> {
        match self {
            Hold::Base | Hold::Loading(_) => None,
            Hold::Accepted(adapter) => Some(adapter.generation()),
            Hold::Host(lease) => Some(lease.generation()),
            Hold::Running(lease) => Some(lease.generation()),
        }
    }

    /// Whether it may take part in a step on `generation` (`None`: the base model).
    pub(super) fn runs_on(&self, generation: Option<AdapterGen>) -> bool {
        match (self, generation) {
            (Hold::Base, None) => true,
            (Hold::Running(lease), Some(g)) => lease.generation() == g,
            _ => false,
        }
    }
}
