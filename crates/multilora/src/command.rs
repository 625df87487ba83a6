//! `Command`: what handles send to the engine loop, and `Submission`, a request as the handle
//! validated and prepared it. Below the handle and the loop, which both use them.

use std::sync::mpsc::SyncSender;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::error::Result;
use crate::metrics::MetricsSnapshot;
use crate::request::{Event, SamplingParams};

/// What handles send to the loop.
#[derive(Debug)]
pub(crate) enum Command {
    /// A validated, tokenized request.
    Submit(Box<Submission>),
    /// Cancel a request (its stream was dropped).
    Abort(u64),
    /// Unload an adapter and fail the requests waiting for it.
    Unload(String, SyncSender<Result<()>>),
    /// Send a metrics snapshot.
    Metrics(SyncSender<MetricsSnapshot>),
    /// A background load finished: look at the deferred requests again.
    Wake,
    /// Stop: fail what is left and exit.
    Shutdown,
}

/// A request as the handle prepared it.
#[derive(Debug)]
pub(crate) struct Submission {
    pub(crate) id: u64,
    pub(crate) model: String,
    pub(crate) prompt: Vec<u32>,
    pub(crate) params: SamplingParams,
    pub(crate) events: UnboundedSender<Event>,
    pub(crate) arrived: Instant,
}
