//! What every handler shares: the engine handle, the configuration, the chat template, and the
//! admission counter that answers 429 once too many requests are in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use multilora::EngineHandle;

use crate::config::ServerConfig;
use crate::drain::Drain;
use crate::error::{Error, Result};
use crate::responses::ResponseStore;
use crate::template::ChatTemplate;

/// Shared by all handlers (cheap to clone).
#[derive(Clone, Debug)]
pub(crate) struct AppState {
    pub(crate) engine: EngineHandle,
    pub(crate) config: Arc<ServerConfig>,
    pub(crate) chat_template: Option<ChatTemplate>,
    /// The server's drain; its counter is the admission counter.
    pub(crate) drain: Drain,
    in_flight: Arc<AtomicUsize>,
    next_id: Arc<AtomicU64>,
    /// Seconds since the epoch at start: `created` of `/v1/models` entries.
    pub(crate) started: u64,
    /// The responses `/v1/responses` keeps.
    pub(crate) responses: Arc<ResponseStore>,
    /// HTTP requests per generation and tokenizer endpoint (`ENDPOINTS`' order).
    pub(crate) endpoint_requests: Arc<[AtomicU64; ENDPOINTS.len()]>,
}

/// The endpoints whose requests `/metrics` counts (`multilora_http_requests_total{endpoint}`).
pub(crate) const ENDPOINTS: [&str; 8] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/v1/models",
];

impl AppState {
    pub(crate) fn new(engine: EngineHandle, config: ServerConfig, chat_template: Option<ChatTemplate>) -> AppState {
        let drain = config.drain.clone();
        let responses = Arc::new(ResponseStore::new(config.responses_store));
        AppState {
            engine,
            config: Arc::new(config),
            chat_template,
            in_flight: drain.counter(),
            drain,
            next_id: Arc::new(AtomicU64::new(1)),
            started: unix_now(),
            responses,
            endpoint_requests: Arc::new(std::array::from_fn(|_| AtomicU64::new(0))),
        }
    }

    /// Counts a request to `path`, if it is one of [`ENDPOINTS`].
    pub(crate) fn count_request(&self, path: &str) {
        if let Some(i) = ENDPOINTS.iter().position(|&e| e == path) {
            self.endpoint_requests[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The most engine requests in flight through this server: the engine's running capacity
    /// (`max_num_seqs`) plus the configured waiting bound.
    pub(crate) fn limit(&self) -> usize {
        self.engine.config().max_num_seqs.saturating_add(self.config.max_waiting_requests)
    }

    /// Admits `n` engine requests, or answers 400 (more than one HTTP request may ask for), 503
    /// (the server is draining) or 429 (too many in flight). Called with the count alone, before
    /// any request is built.
    pub(crate) fn admit(&self, n: usize) -> Result<Admission> {
        let cap = self.config.max_choices_per_request;
        if n > cap {
            return Err(Error::bad(
                "n",
                format!("{n} completions (prompts × n) in one request; at most {cap} (--max-choices-per-request)"),
            ));
        }
        let limit = self.limit();
        let before = self.in_flight.fetch_add(n, Ordering::AcqRel);
        let admission = Admission { counter: Arc::clone(&self.in_flight), n };
        // Counted first, then the flag: a drain that saw no request in flight after it started
        // cannot miss one admitted here.
        if self.drain.is_draining() {
            return Err(Error::Draining);
        }
        if before + n > limit {
            return Err(Error::Overloaded { in_flight: before, limit });
        }
        Ok(admission)
    }

    /// A response id: `prefix-` and 32 hex digits, unique within this process.
    pub(crate) fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        format!("{prefix}-{nanos:016x}{n:016x}")
    }
}

/// Engine requests admitted; released when dropped (the response is done or abandoned).
#[derive(Debug)]
pub(crate) struct Admission {
    counter: Arc<AtomicUsize>,
    n: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
