//! What the engine loop publishes for readers that must never wait on it: its state (running,
//! stopped, failed with the panic's message), a heartbeat it beats every iteration (and at least
//! every [`HEARTBEAT`] while idle), and its latest metrics snapshot. `/health` and `/metrics`
//! read these without a round trip through the loop, so a stuck or dead loop is seen as one, and
//! a scrape flood costs the loop nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::metrics::MetricsSnapshot;

/// How often an idle loop beats (it blocks on its channel for at most this long).
pub(crate) const HEARTBEAT: Duration = Duration::from_millis(500);

/// The least time between two published snapshots while steps run (one is always published
/// before the loop goes idle, so an idle engine's snapshot is exact).
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_millis(20);

/// Where the engine loop is.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoopState {
    /// Running (it may still be stuck: see [`EngineHealth::since_heartbeat`]).
    Running,
    /// Shut down on request.
    Stopped,
    /// A step panicked: every request then live failed with [`crate::EngineError::EngineFailed`],
    /// and new ones are refused with it.
    Failed {
        /// The panic's message.
        reason: String,
    },
}

/// The engine loop's health, read without waiting on the loop.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineHealth {
    /// Running, stopped or failed.
    pub state: LoopState,
    /// Time since the loop last showed it was alive. An idle loop beats every half second; a
    /// large value means a step has not returned for that long.
    pub since_heartbeat: Duration,
}

impl EngineHealth {
    /// Running, and alive within `stall_timeout`.
    pub fn is_healthy(&self, stall_timeout: Duration) -> bool {
        self.state == LoopState::Running && self.since_heartbeat <= stall_timeout
    }
}

/// Shared by the loop (writer) and every handle (readers).
#[derive(Debug)]
pub(crate) struct Published {
    start: Instant,
    /// Milliseconds after `start` of the last heartbeat.
    beat_ms: AtomicU64,
    state: Mutex<LoopState>,
    snapshot: Mutex<Arc<MetricsSnapshot>>,
}

impl Published {
    pub(crate) fn new() -> Arc<Published> {
        Arc::new(Published {
            start: Instant::now(),
            beat_ms: AtomicU64::new(0),
            state: Mutex::new(LoopState::Running),
            snapshot: Mutex::new(Arc::new(MetricsSnapshot::default())),
        })
    }

    /// The loop is alive now.
    pub(crate) fn beat(&self) {
        self.beat_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    pub(crate) fn publish(&self, snapshot: MetricsSnapshot) {
        *self.snapshot.lock() = Arc::new(snapshot);
        self.beat();
    }

    pub(crate) fn set_state(&self, state: LoopState) {
        *self.state.lock() = state;
    }

    pub(crate) fn state(&self) -> LoopState {
        self.state.lock().clone()
    }

    pub(crate) fn snapshot(&self) -> Arc<MetricsSnapshot> {
        Arc::clone(&self.snapshot.lock())
    }

    pub(crate) fn health(&self) -> EngineHealth {
        let now = self.start.elapsed().as_millis() as u64;
        let since = now.saturating_sub(self.beat_ms.load(Ordering::Relaxed));
        EngineHealth { state: self.state(), since_heartbeat: Duration::from_millis(since) }
    }
}

/// A panic payload's message.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}
