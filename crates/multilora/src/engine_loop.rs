//! The engine loop, on its own thread: drain commands between steps, admit requests whose
//! adapter is in hand (the rest wait here in arrival order, each on the ticket of its adapter's
//! load: the loop never looks a model name up), then one step (`step.rs`: schedule →
//! activate adapter generations into slots → one forward over the flat batch → sample → update
//! → stream). The live request table's entries are in `live.rs`, what each holds of its adapter
//! in `hold.rs`, the metrics snapshot in `snapshot.rs`. When there is nothing to run it blocks on the command channel (the store's
//! load events arrive there too), waking only to beat its heartbeat twice a second, so an idle
//! engine costs next to nothing. What it publishes for readers that must not wait on it (state,
//! heartbeat, snapshot) is in `health.rs`.
//!
//! Each step runs inside the engine's own rayon pool (`install`): the step's serial parts and its
//! parallel kernels then share the pool's threads, so the dozens of parallel regions of a step
//! (every GEMM, attention, the LoRA segments) start on threads that are already awake instead of
//! being handed over from this thread one by one, and an embedding application's own rayon work
//! never competes with a step for the global pool.

mod hold;
mod live;
mod snapshot;
mod step;

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use multilora_models::{KvCache, Model};
use multilora_scheduler::{Request, Scheduler};
use multilora_store::{LoadEvent, Store};
use tokenizers::Tokenizer;

use crate::command::{Command, EventCount, Submission};
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::health::{HEARTBEAT, LoopState, PUBLISH_EVERY, Published, panic_message};
use crate::metrics::Counters;
use crate::request::{Event, FinishReason, Usage};
use crate::step_cost::CostEstimator;
use hold::{Admission, Hold};
use live::{Live, stop_ids};

/// Everything the loop thread owns.
pub(crate) struct EngineLoop {
    pub(crate) config: EngineConfig,
    pub(crate) model: Model,
    pub(crate) kv: KvCache,
    pub(crate) scheduler: Scheduler,
    pub(crate) store: Arc<Store>,
    pub(crate) tokenizer: Option<Arc<Tokenizer>>,
    pub(crate) rx: Receiver<Command>,
    /// The store's events on their way down `rx`.
    events: EventCount,
    /// State, heartbeat and snapshot for readers that must not wait on the loop.
    published: Arc<Published>,
    last_publish: Instant,
    pool: Arc<rayon::ThreadPool>,
    live: HashMap<u64, Live>,
    deferred: VecDeque<u64>,
    counters: Counters,
    seed_counter: u64,
    /// What a step costs, measured; the scheduler's step-time budget reads it.
    cost: CostEstimator,
}

impl EngineLoop {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: EngineConfig,
        model: Model,
        kv: KvCache,
        scheduler: Scheduler,
        store: Arc<Store>,
        tokenizer: Option<Arc<Tokenizer>>,
        (rx, events): (Receiver<Command>, EventCount),
        published: Arc<Published>,
        pool: rayon::ThreadPool,
    ) -> EngineLoop {
        EngineLoop {
            pool: Arc::new(pool),
            config,
            model,
            kv,
            scheduler,
            store,
            tokenizer,
            rx,
            events,
            published,
            last_publish: Instant::now(),
            live: HashMap::new(),
            deferred: VecDeque::new(),
            counters: Counters::default(),
            // Unseeded requests differ between runs, as in vLLM.
            seed_counter: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x5eed, |d| d.as_nanos() as u64),
            cost: CostEstimator::default(),
        }
    }

    /// Runs until `Shutdown` (or every sender is gone). A panic anywhere in the loop is caught:
    /// the loop is then marked failed, every live request gets [`EngineError::EngineFailed`],
    /// and the thread stays to answer what still arrives with the same error (so nothing waits
    /// on a loop that is gone, and nothing ends looking like a normal finish).
    pub(crate) fn run(mut self) {
        match panic::catch_unwind(AssertUnwindSafe(|| self.serve())) {
            Ok(()) => {
                self.shutdown();
                self.published.set_state(LoopState::Stopped);
            }
            Err(payload) => {
                let reason = panic_message(&*payload);
                tracing::error!(%reason, "the engine loop panicked: failing every request; new ones are refused");
                self.die(reason);
            }
        }
    }

    fn serve(&mut self) {
        if self.config.step_time != crate::knobs::StepTime::Unbounded {
            let pool = Arc::clone(&self.pool);
            pool.install(|| self.warm_up());
        }
        loop {
            self.published.beat();
            if !self.scheduler.has_unfinished() {
                // Idle: what readers see is exact, and the heartbeat goes on while we wait.
                self.publish();
                let cmd = loop {
                    match self.rx.recv_timeout(HEARTBEAT) {
                        Ok(cmd) => break cmd,
                        Err(RecvTimeoutError::Timeout) => self.published.beat(),
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                };
                if !self.handle(cmd) {
                    return;
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                if !self.handle(cmd) {
                    return;
                }
            }
            if !self.deferred.is_empty() {
                self.note_deferred();
            }
            self.admit_deferred();
            self.reap_closed();
            let pool = Arc::clone(&self.pool);
            if self.scheduler.has_unfinished() && !pool.install(|| self.step()) {
                // Nothing could be scheduled (should not happen): wait a little rather than spin.
                match self.rx.recv_timeout(Duration::from_millis(5)) {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            if self.last_publish.elapsed() >= PUBLISH_EVERY {
                self.publish();
            }
        }
    }

    /// Publishes the current snapshot for readers that do not wait on the loop.
    fn publish(&mut self) {
        self.published.publish(self.snapshot());
        self.last_publish = Instant::now();
    }

    /// After a panic: marks the loop failed (new submissions are refused from then on), fails
    /// every live request without touching the scheduler (its state is not trusted), then
    /// answers whatever still arrives until shutdown.
    fn die(&mut self, reason: String) {
        self.published.set_state(LoopState::Failed { reason: reason.clone() });
        let failed = EngineError::EngineFailed { reason };
        self.deferred.clear();
        // Each request's hold is released here; its stream is told below.
        let streams: Vec<_> = self.live.drain().map(|(_, live)| live.sub.events.clone()).collect();
        for _ in &streams {
            *self.counters.errors.entry(failed.kind()).or_default() += 1;
            *self.counters.finished.entry(FinishReason::Error.as_str()).or_default() += 1;
        }
        // Published before any request hears of the failure, so that a client that saw its error
        // finds it counted. The snapshot reads the scheduler; if that panics too, readers keep
        // the last one.
        if let Ok(snapshot) = panic::catch_unwind(AssertUnwindSafe(|| self.snapshot())) {
            self.published.publish(snapshot);
        }
        for events in streams {
            let _ = events.send(Event::Error(failed.clone()));
        }
        loop {
            let cmd = match self.rx.recv_timeout(HEARTBEAT) {
                Ok(cmd) => cmd,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            match cmd {
                Command::Submit(sub) => {
                    let _ = sub.events.send(Event::Error(failed.clone()));
                }
                Command::Metrics(reply) => {
                    let _ = reply.send((*self.published.snapshot()).clone());
                }
                Command::Adapter(_) => self.events.taken(),
                Command::Abort(_) => {}
                Command::Shutdown => return,
            }
        }
    }

    /// Handles one command; `false` to stop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(sub) => self.submit(*sub),
            Command::Abort(id) => self.abort(id),
            Command::Metrics(reply) => {
                let _ = reply.send(self.snapshot());
            }
            // Deferred requests' tickets are looked at on every iteration, so a load event only
            // has to wake the loop; it is logged here.
            Command::Adapter(ev) => {
                self.events.taken();
                match ev {
                    LoadEvent::Ready { name, .. } => tracing::debug!(adapter = %name, "adapter in host memory"),
                    LoadEvent::Superseded { name, .. } => {
                        tracing::debug!(adapter = %name, "a superseded load ended for the requests accepted on it")
                    }
                    LoadEvent::Failed { name, error } => {
                        tracing::warn!(adapter = %name, %error, "adapter load failed")
                    }
                    _ => {}
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn submit(&mut self, mut sub: Submission) {
        let seed = sub.params.seed.unwrap_or_else(|| {
            self.seed_counter = self.seed_counter.wrapping_add(0x9e37_79b9_7f4a_7c15);
            self.seed_counter ^ sub.id.rotate_left(32)
        });
        let base = sub.adapter.is_none();
        let (hold, refused) = match Hold::accept(sub.adapter.take()) {
            Ok(hold) => (hold, None),
            Err(e) => (Hold::Base, Some(e)),
        };
        let live = Live::new(sub, hold, seed, &self.config.eos_token_ids, self.tokenizer.is_some());
        let id = live.sub.id;
        let name = live.sub.model.clone();
        self.live.insert(id, live);
        if let Some(e) = refused {
            return self.fail(id, EngineError::from_store_arc(&name, &e));
        }
        // An adapter's request waits in arrival order behind an earlier request for the same
        // adapter, and behind every deferred request while a load waits for a CPU entry (see
        // `admit_deferred`); the base model's never waits here.
        let earlier = !base
            && (self.deferred.iter().any(|d| self.live.get(d).is_some_and(|l| l.sub.model == name))
                || (!self.deferred.is_empty() && self.store.loads_waiting() > 0));
        if earlier || self.try_admit(id) {
            self.deferred.push_back(id);
        }
    }

    /// Hands request `id` to the scheduler if its adapter is in hand (`Hold::admit`: from here
    /// until it finishes it holds that generation's host-memory entry, its slot only while it
    /// runs, so it keeps its place and aging in the scheduler whatever loads, unloads and
    /// reloads come meanwhile); one whose load failed fails. Returns whether its load still
    /// runs (then the caller keeps it in the engine's queue).
    fn try_admit(&mut self, id: u64) -> bool {
        let Some(live) = self.live.get_mut(&id) else { return false };
        let generation = match live.hold.admit(&self.store) {
            Admission::Admitted(generation) => generation,
            Admission::Loading => return true,
            Admission::Failed(e) => {
                let name = live.sub.model.clone();
                self.fail(id, EngineError::from_store_arc(&name, &e));
                return false;
            }
        };
        let p = &live.sub.params;
        let room = self.config.max_model_len.saturating_sub(live.sub.prompt.len()).max(1);
        live.max_new = p.max_tokens.unwrap_or(room).min(room);
        let mut req = Request::new(id, live.sub.prompt.clone(), live.max_new)
            .stop_token_ids(stop_ids(p, &self.config.eos_token_ids))
            .prompt_logprobs(p.prompt_logprobs.is_some());
        if let Some(g) = generation {
            req = req.adapter(g);
        }
        if let Err(e) = self.scheduler.add_request(req) {
            let err = match e {
                multilora_scheduler::Error::PromptTooLong { prompt_len, max_model_len, .. } => {
                    EngineError::PromptTooLong { prompt_len, max_model_len }
                }
                other => EngineError::invalid(other.to_string()),
            };
            self.fail(id, err);
            return false;
        }
        let prompt_len = live.sub.prompt.len() as u64;
        let usage = self.counters.adapter(&live.sub.model);
        usage.requests += 1;
        usage.prompt_tokens += prompt_len;
        self.counters.prompt_tokens += prompt_len;
        false
    }

    /// Admits deferred requests whose adapter is in hand, in arrival order, and fails those
    /// whose load failed. No name is looked up: each request's ticket says how its load ended.
    fn admit_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        // While a load waits for a CPU entry to be unpinned, requests behind one still loading
        // wait too, even for adapters in host memory: admitting them would pin those entries
        // again and could starve the waiting load. (Admitted requests hold their entry until
        // they finish.) And a request never passes an earlier one for the same model.
        let capacity_wait = self.store.loads_waiting() > 0;
        let mut blocked = false;
        let mut loading: HashSet<String> = HashSet::new();
        let queue = std::mem::take(&mut self.deferred);
        for id in queue {
            let Some(name) = self.live.get(&id).map(|l| l.sub.model.clone()) else { continue };
            if blocked || loading.contains(&name) {
                self.deferred.push_back(id);
                continue;
            }
            if self.try_admit(id) {
                self.deferred.push_back(id);
                loading.insert(name);
                blocked = capacity_wait;
            }
        }
    }

    /// Aborts requests whose stream was dropped.
    fn reap_closed(&mut self) {
        let closed: Vec<u64> = self.live.iter().filter(|(_, l)| l.sub.events.is_closed()).map(|(&id, _)| id).collect();
        for id in closed {
            self.abort(id);
        }
    }

    fn abort(&mut self, id: u64) {
        if !self.live.contains_key(&id) {
            return;
        }
        self.deferred.retain(|&d| d != id);
        let done = self.scheduler.abort(id);
        let tokens = done.map_or(0, |f| f.output_token_ids.len());
        self.finish(id, FinishReason::Aborted, tokens);
    }

    /// Ends request `id` with `err`, freeing whatever it holds.
    fn fail(&mut self, id: u64, err: EngineError) {
        self.deferred.retain(|&d| d != id);
        self.scheduler.abort(id);
        *self.counters.errors.entry(err.kind()).or_default() += 1;
        if let Some(live) = self.live.get(&id) {
            let _ = live.sub.events.send(Event::Error(err));
        }
        self.finish(id, FinishReason::Error, 0);
    }

    /// Removes request `id` (its hold goes with it), counts it, sends `Finished`.
    fn finish(&mut self, id: u64, reason: FinishReason, completion_tokens: usize) {
        let Some(live) = self.live.remove(&id) else { return };
        *self.counters.finished.entry(reason.as_str()).or_default() += 1;
        if reason != FinishReason::Error && reason != FinishReason::Aborted {
            self.counters.e2e.observe(live.sub.arrived.elapsed());
        }
        let usage = Usage { prompt_tokens: live.sub.prompt.len(), completion_tokens };
        let stop_reason = if reason == FinishReason::Stop { live.stop_reason } else { None };
        let _ = live.sub.events.send(Event::Finished { reason, usage, stop_reason });
    }

    /// Fails everything still live and queued, and leaves a last snapshot for `metrics()`.
    fn shutdown(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Submit(sub) => {
                    let _ = sub.events.send(Event::Error(EngineError::Shutdown));
                }
                Command::Adapter(_) => self.events.taken(),
                _ => {}
            }
        }
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            self.fail(id, EngineError::Shutdown);
        }
        self.publish();
    }
}

impl std::fmt::Debug for EngineLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLoop").field("live", &self.live.len()).field("deferred", &self.deferred.len()).finish()
    }
}
