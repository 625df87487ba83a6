//! `Drain`: the server's way out of a fleet. Once started (on SIGTERM, before the listener
//! closes), `/health` answers 503 and new generation requests are refused with 503, so a router
//! that probes health or retries elsewhere moves away, while the requests already admitted run
//! to their end; [`Drain::finished`] resolves when none is left. Whoever stops the server bounds
//! the wait (a grace period), then shuts the listener.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// How often [`Drain::finished`] looks at the count of requests in flight.
const POLL: Duration = Duration::from_millis(20);

/// Shared by the routes of one server ([`crate::ServerConfig::drain`]) and whoever stops it.
/// Cheap to clone; every clone is the same drain.
#[derive(Clone, Debug, Default)]
pub struct Drain {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    draining: AtomicBool,
    /// Engine requests admitted and not yet finished (the admission counter behind 429).
    in_flight: Arc<AtomicUsize>,
}

impl Drain {
    /// A drain not started.
    pub fn new() -> Drain {
        Drain::default()
    }

    /// Starts draining: from now on `/health` is 503 and new generation requests are refused.
    /// Idempotent.
    pub fn start(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }

    /// Whether [`Drain::start`] was called.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Engine requests admitted through this server and not finished (a streamed response counts
    /// until its last byte is sent or its client goes).
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Resolves once draining and no request is in flight. A request is admitted only if it
    /// counts itself before it looks at the flag, so none slips in after this resolved.
    pub async fn finished(&self) {
        while !self.is_draining() || self.in_flight() > 0 {
            tokio::time::sleep(POLL).await;
        }
    }

    /// The admission counter the server's state shares.
    pub(crate) fn counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.inner.in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn finished_waits_for_the_start_and_the_last_request() {
        let drain = Drain::new();
        let counter = drain.counter();
        counter.fetch_add(1, Ordering::SeqCst);
        let waiter = tokio::spawn({
            let drain = drain.clone();
            async move { drain.finished().await }
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!waiter.is_finished(), "not draining yet");
        drain.start();
        assert!(drain.is_draining());
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!waiter.is_finished(), "a request is still in flight");
        counter.fetch_sub(1, Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("finished").expect("task");
    }
}
