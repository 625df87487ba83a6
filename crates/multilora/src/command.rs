//! `Command`: what handles and the adapter store send to the engine loop (its one channel), and
//! `Submission`, a request as the handle validated and prepared it. Below the handle and the loop, which both use them.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::time::Instant;

use multilora_store::{LoadEvent, Resolution};
use tokio::sync::mpsc::UnboundedSender;

use crate::guided::Guide;
use crate::metrics::MetricsSnapshot;
use crate::request::{Event, SamplingParams};
use crate::stop::StopStrings;

/// What handles send to the loop.
#[derive(Debug)]
pub(crate) enum Command {
    /// A validated, tokenized request.
    Submit(Box<Submission>),
    /// Cancel a request (its stream was dropped).
    Abort(u64),
    /// Send a metrics snapshot.
    Metrics(SyncSender<MetricsSnapshot>),
    /// A background load finished (the store's events come down this same channel): the
    /// tickets of the deferred requests are looked at again.
    Adapter(LoadEvent),
    /// Stop: fail what is left and exit.
    Shutdown,
}

/// The store's load events sent down the loop's channel and not yet taken by the loop: the
/// length of the event channel, for `MetricsSnapshot::adapter_events_pending`.
#[derive(Clone, Debug, Default)]
pub(crate) struct EventCount(Arc<AtomicUsize>);

impl EventCount {
    /// One more event is on its way to the loop.
    pub(crate) fn sent(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// The loop took one.
    pub(crate) fn taken(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }

    /// Events sent and not yet taken.
    pub(crate) fn pending(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A request as the handle prepared it.
#[derive(Debug)]
pub(crate) struct Submission {
    pub(crate) id: u64,
    pub(crate) model: String,
    /// What `model` resolved to at submit, held by the request from then on (`None`: the base
    /// model); the loop never looks the name up again.
    pub(crate) adapter: Option<Resolution>,
    pub(crate) prompt: Vec<u32>,
    pub(crate) params: SamplingParams,
    /// `params.stop`, compiled.
    pub(crate) stops: Option<StopStrings>,
    /// `params.constraint`, compiled.
    pub(crate) guide: Option<Guide>,
    pub(crate) events: UnboundedSender<Event>,
    pub(crate) arrived: Instant,
}
