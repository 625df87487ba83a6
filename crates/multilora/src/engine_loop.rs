//! The engine loop, on its own thread: drain commands between steps, admit requests whose
//! adapter is ready (the rest wait here in arrival order), then one step: schedule → activate
//! adapter generations into slots → one forward over the flat batch → sample → update → stream.
//! When there is nothing to run it blocks on the command channel (the store's load notifications
//! arrive there too), so an idle engine costs nothing.
//!
//! Each step runs inside the engine's own rayon pool (`install`): the step's serial parts and its
//! parallel kernels then share the pool's threads, so the dozens of parallel regions of a step
//! (every GEMM, attention, the LoRA segments) start on threads that are already awake instead of
//! being handed over from this thread one by one, and an embedding application's own rayon work
//! never competes with a step for the global pool.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use multilora_models::{Batch, KvCache, LogitsRows, Model, SeqInput};
use multilora_scheduler::{LogitsWanted, Request, RequestResult, Scheduler, SchedulerOutput};
use multilora_store::{AdapterGen, AdapterStatus, LoadEvent, SlotLease, Store};
use parking_lot::Mutex;
use tokenizers::Tokenizer;

use crate::command::{Command, Submission};
use crate::config::EngineConfig;
use crate::detokenize::Detokenizer;
use crate::error::{EngineError, Result};
use crate::metrics::{Counters, Histogram, MetricsSnapshot, TierOccupancy};
use crate::request::{Event, FinishReason, PromptLogprob, SamplingParams, Usage};
use crate::sampling::{SamplerState, log_softmax, top_n};
use crate::step_cost::CostEstimator;

/// A live request: deferred (waiting for its adapter) or in the scheduler.
#[derive(Debug)]
struct Live {
    sub: Submission,
    generation: Option<AdapterGen>,
    /// This request's pin on `generation`: held from the step it starts running until it
    /// finishes, is cancelled or is preempted (a waiting request must not hold a slot, or
    /// waiting requests of running adapters could pin every slot). Dropped with the request,
    /// so a pin cannot outlive it.
    lease: Option<SlotLease>,
    sampler: SamplerState,
    detok: Option<Detokenizer>,
    /// Generated text so far; kept only when stop strings need it.
    text: String,
    prompt_lp: Option<Vec<Option<PromptLogprob>>>,
    last_token: Option<Instant>,
}

/// Everything the loop thread owns.
pub(crate) struct EngineLoop {
    pub(crate) config: EngineConfig,
    pub(crate) model: Model,
    pub(crate) kv: KvCache,
    pub(crate) scheduler: Scheduler,
    pub(crate) store: Arc<Store>,
    pub(crate) tokenizer: Option<Arc<Tokenizer>>,
    pub(crate) rx: Receiver<Command>,
    pub(crate) last_metrics: Arc<Mutex<Option<MetricsSnapshot>>>,
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
        rx: Receiver<Command>,
        last_metrics: Arc<Mutex<Option<MetricsSnapshot>>>,
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
            last_metrics,
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

    /// Seeds the step cost model before the first request: a 32-token prefill and decode steps
    /// of 1 and 8 rows, each run twice and timed the second time (the first pays one-time
    /// costs). They write into the first KV blocks, which are free; no real step reads what a
    /// request did not write. Skipped when the cache is too small to hold them.
    fn warm_up(&mut self) {
        let bs = self.config.block_size;
        let prompt = 32.min(self.config.max_model_len.saturating_sub(2));
        let blocks = (prompt + 1).div_ceil(bs);
        if prompt < 2 || blocks > self.config.num_kv_blocks {
            return;
        }
        let table: Vec<u32> = (0..blocks as u32).collect();
        let ids: Vec<u32> = (0..prompt as u32).map(|t| (t * 7 + 3) % self.config.vocab_size.max(1) as u32).collect();
        let prefill = Batch::new(vec![SeqInput::new(ids.clone(), 0, table.clone(), -1)]);
        let decode = |rows: usize| {
            Batch::new((0..rows).map(|_| SeqInput::new(vec![ids[0]], prompt, table.clone(), -1)).collect())
        };
        for (batch, rows, tokens) in [(prefill, 0, prompt), (decode(1), 1, 0), (decode(8), 8, 0)] {
            let mut seconds = f64::NAN;
            for _ in 0..2 {
                let t = Instant::now();
                if let Err(e) = self.model.forward(&batch, &mut self.kv).and_then(|l| Ok(l.to_vec2::<f32>()?)) {
                    tracing::warn!(error = %e, "warm-up step failed; the step cost model starts from traffic");
                    return;
                }
                seconds = t.elapsed().as_secs_f64();
            }
            self.cost.observe(rows, tokens, seconds);
        }
        if let Some(c) = self.cost.cost() {
            tracing::info!(
                fixed_ms = c.fixed_s * 1e3,
                per_decode_row_ms = c.per_decode_row_s * 1e3,
                per_prefill_token_ms = c.per_prefill_token_s * 1e3,
                step_time = self.config.step_time.name(),
                "step cost model seeded"
            );
        }
    }

    /// Runs until `Shutdown` (or every sender is gone).
    pub(crate) fn run(mut self) {
        if self.config.step_time != multilora_scheduler::StepTime::Unbounded {
            let pool = Arc::clone(&self.pool);
            pool.install(|| self.warm_up());
        }
        'outer: loop {
            if !self.scheduler.has_unfinished() {
                match self.rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break 'outer;
                        }
                    }
                    Err(_) => break 'outer,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                if !self.handle(cmd) {
                    break 'outer;
                }
            }
            // The store's load events woke the loop (its notify sends `Wake`); taking them keeps
            // the store's queue bounded. Deferred requests are re-checked against the store
            // below on every iteration, so the events are only logged.
            for ev in self.store.poll_completed() {
                match ev {
                    LoadEvent::Ready { name, .. } => tracing::debug!(adapter = %name, "adapter in host memory"),
                    LoadEvent::Failed { name, error } => tracing::warn!(adapter = %name, %error, "adapter load failed"),
                    _ => {}
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
                            break 'outer;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break 'outer,
                }
            }
        }
        self.shutdown();
    }

    /// Handles one command; `false` to stop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(sub) => self.submit(*sub),
            Command::Abort(id) => self.abort(id),
            Command::Unload(name, reply) => {
                let _ = reply.send(self.unload(&name));
            }
            Command::Metrics(reply) => {
                let _ = reply.send(self.snapshot());
            }
            Command::Wake => {}
            Command::Shutdown => return false,
        }
        true
    }

    fn submit(&mut self, sub: Submission) {
        let stop = stop_ids(&sub.params, &self.config.eos_token_ids);
        let seed = sub.params.seed.unwrap_or_else(|| {
            self.seed_counter = self.seed_counter.wrapping_add(0x9e37_79b9_7f4a_7c15);
            self.seed_counter ^ sub.id.rotate_left(32)
        });
        let detok = self.tokenizer.as_ref().map(|_| Detokenizer::new(&sub.prompt, sub.params.skip_special_tokens));
        let live = Live {
            sampler: SamplerState::new(seed, &sub.prompt, stop, &sub.params),
            prompt_lp: sub.params.prompt_logprobs.map(|_| vec![None; sub.prompt.len()]),
            sub,
            generation: None,
            lease: None,
            detok,
            text: String::new(),
            last_token: None,
        };
        let id = live.sub.id;
        let name = live.sub.model.clone();
        self.live.insert(id, live);
        if name == self.config.served_model_name {
            self.admit(id, None);
            return;
        }
        // `submit` refused names that are not served (LoRA off included); the store is asked
        // again because the adapter may have loaded, failed or been unloaded since.
        let earlier = self.deferred.iter().any(|d| self.live.get(d).is_some_and(|l| l.sub.model == name));
        match self.store.request(&name) {
            Ok(AdapterStatus::Ready(g)) if !earlier => self.admit(id, Some(g)),
            Ok(AdapterStatus::Failed(e)) => self.fail(id, EngineError::from_store_arc(&name, &e)),
            Ok(_) => self.deferred.push_back(id),
            Err(e) => self.fail(id, EngineError::from_store(&name, &e)),
        }
    }

    /// Hands request `id` to the scheduler on `generation` (pinned once it first runs).
    fn admit(&mut self, id: u64, generation: Option<AdapterGen>) {
        let Some(live) = self.live.get_mut(&id) else { return };
        live.generation = generation;
        let p = &live.sub.params;
        let room = self.config.max_model_len.saturating_sub(live.sub.prompt.len()).max(1);
        let mut req = Request::new(id, live.sub.prompt.clone(), p.max_tokens.unwrap_or(room).min(room))
            .stop_token_ids(stop_ids(p, &self.config.eos_token_ids))
            .prompt_logprobs(p.prompt_logprobs.is_some());
        if let Some(g) = generation {
            req = req.adapter(multilora_scheduler::AdapterGen::new(g.id.0, g.fingerprint.0));
        }
        if let Err(e) = self.scheduler.add_request(req) {
            let err = match e {
                multilora_scheduler::Error::PromptTooLong { prompt_len, max_model_len, .. } => {
                    EngineError::PromptTooLong { prompt_len, max_model_len }
                }
                other => EngineError::invalid(other.to_string()),
            };
            return self.fail(id, err);
        }
        let prompt_len = live.sub.prompt.len() as u64;
        let usage = self.counters.adapter(&live.sub.model);
        usage.requests += 1;
        usage.prompt_tokens += prompt_len;
        self.counters.prompt_tokens += prompt_len;
    }

    /// Admits deferred requests whose adapter became ready, and fails those whose load failed.
    fn admit_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        let mut status: HashMap<String, std::result::Result<AdapterStatus, EngineError>> = HashMap::new();
        let queue = std::mem::take(&mut self.deferred);
        for id in queue {
            let Some(name) = self.live.get(&id).map(|l| l.sub.model.clone()) else { continue };
            let st = status
                .entry(name.clone())
                .or_insert_with(|| self.store.request(&name).map_err(|e| EngineError::from_store(&name, &e)))
                .clone();
            match st {
                Ok(AdapterStatus::Ready(g)) => self.admit(id, Some(g)),
                Ok(AdapterStatus::Failed(e)) => self.fail(id, EngineError::from_store_arc(&name, &e)),
                Ok(_) => self.deferred.push_back(id),
                Err(e) => self.fail(id, e),
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

    /// Removes request `id` (its lease goes with it), counts it, sends `Finished`.
    fn finish(&mut self, id: u64, reason: FinishReason, completion_tokens: usize) {
        let Some(mut live) = self.live.remove(&id) else { return };
        live.lease = None;
        *self.counters.finished.entry(reason.as_str()).or_default() += 1;
        if reason != FinishReason::Error && reason != FinishReason::Aborted {
            self.counters.e2e.observe(live.sub.arrived.elapsed());
        }
        let usage = Usage { prompt_tokens: live.sub.prompt.len(), completion_tokens };
        let _ = live.sub.events.send(Event::Finished { reason, usage });
    }

    fn unload(&mut self, name: &str) -> Result<()> {
        self.store.unload(name).map_err(|e| EngineError::from_store(name, &e))?;
        let waiting: Vec<u64> =
            self.deferred.iter().copied().filter(|d| self.live.get(d).is_some_and(|l| l.sub.model == name)).collect();
        for id in waiting {
            self.fail(id, EngineError::ModelNotFound { name: name.to_string() });
        }
        Ok(())
    }

    /// One step; `false` when nothing was scheduled.
    fn step(&mut self) -> bool {
        let started = Instant::now();
        let out = match self.cost.cost() {
            Some(cost) => self.scheduler.schedule_with_cost(&cost),
            None => self.scheduler.schedule(),
        };
        self.note_deferred();
        if out.is_empty() {
            return false;
        }
        self.update_pins(&out);
        let slots = self.activate(&out);
        let mut seqs = Vec::with_capacity(out.scheduled.len());
        let mut kept = Vec::with_capacity(out.scheduled.len());
        for s in &out.scheduled {
            let slot = match s.adapter {
                None => -1,
                Some(g) => match slots.get(&g) {
                    Some(&slot) => slot,
                    None => continue,
                },
            };
            // Failed, re-deferred or unpinned since `schedule`: not part of this step.
            match self.live.get(&s.id) {
                Some(live) if s.adapter.is_none() || live.lease.is_some() => {}
                _ => continue,
            }
            let rows = match s.logits {
                LogitsWanted::None => LogitsRows::Skip,
                LogitsWanted::Last => LogitsRows::Last,
                LogitsWanted::AllPrompt => LogitsRows::All,
            };
            seqs.push(
                SeqInput::new(s.token_ids.clone(), s.num_computed_tokens, s.block_table.clone(), slot)
                    .with_logits(rows),
            );
            kept.push(s);
        }
        if seqs.is_empty() {
            return true;
        }
        let batch = Batch::new(seqs);
        let logits = self.model.forward(&batch, &mut self.kv).and_then(|t| Ok(t.to_vec2::<f32>()?));
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "forward failed; failing the step's requests");
                for s in kept {
                    self.fail(s.id, EngineError::Internal(format!("forward: {e}")));
                }
                return true;
            }
        };
        let mut results = Vec::new();
        let mut token_events = Vec::new();
        let mut row = 0;
        for (s, seq) in kept.iter().zip(&batch.seqs) {
            let n = seq.num_logit_rows();
            let rows = &logits[row..row + n];
            row += n;
            if let Some(r) = self.process(s, rows, &mut token_events) {
                results.push(r);
            }
        }
        let finished = match self.scheduler.update(&results) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, "scheduler update failed");
                for s in kept {
                    self.fail(s.id, EngineError::Internal(format!("update: {e}")));
                }
                return true;
            }
        };
        for (id, ev) in token_events {
            if let Some(live) = self.live.get(&id) {
                let _ = live.sub.events.send(ev);
            }
        }
        for f in finished {
            self.finish(f.id, f.reason, f.output_token_ids.len());
        }
        let decode_rows = batch.seqs.iter().filter(|s| s.tokens.len() == 1).count();
        let prefill_tokens: usize = batch.seqs.iter().map(|s| s.tokens.len()).filter(|&n| n > 1).sum();
        let adapters = kept.iter().filter_map(|s| s.adapter).collect::<std::collections::HashSet<_>>().len();
        let elapsed = started.elapsed();
        self.cost.observe(decode_rows, prefill_tokens, elapsed.as_secs_f64());
        let c = &mut self.counters;
        c.steps += 1;
        c.step_duration.observe(elapsed);
        c.iteration_tokens.observe_value((decode_rows + prefill_tokens) as f64);
        c.step_rows.observe_value(batch.seqs.len() as f64);
        c.step_adapters.observe_value(adapters as f64);
        if prefill_tokens > 0 {
            c.prefill_tokens.observe_value(prefill_tokens as f64);
        }
        true
    }

    /// Pins the generation of every request that starts running this step, and releases the
    /// pins of preempted requests (they wait again).
    fn update_pins(&mut self, out: &SchedulerOutput) {
        for &id in &out.preempted {
            if let Some(live) = self.live.get_mut(&id) {
                live.lease = None;
                self.counters.preemptions += 1;
            }
        }
        for s in &out.scheduled {
            let Some(live) = self.live.get_mut(&s.id) else { continue };
            let Some(g) = live.generation else { continue };
            if live.lease.is_some() {
                continue;
            }
            if let Ok(lease) = self.store.lease(g) {
                live.lease = Some(lease);
            } else if live.sampler.num_generated == 0 {
                // Evicted from the CPU tier while waiting: back to the engine's queue until it
                // is loaded again (nothing was generated, so nothing is lost).
                self.scheduler.abort(s.id);
                live.generation = None;
                live.prompt_lp = live.sub.params.prompt_logprobs.map(|_| vec![None; live.sub.prompt.len()]);
                self.store.prefetch([live.sub.model.as_str()]);
                self.deferred.push_back(s.id);
            } else {
                let name = live.sub.model.clone();
                self.fail(s.id, EngineError::Internal(format!("adapter {name:?} left host memory mid-request")));
            }
        }
    }

    /// Puts every adapter generation of the step in a slot; requests whose generation cannot be
    /// activated fail alone.
    fn activate(&mut self, out: &SchedulerOutput) -> HashMap<multilora_scheduler::AdapterGen, i32> {
        let mut slots = HashMap::new();
        for &g in &out.active_adapters {
            let Some(generation) = out
                .scheduled
                .iter()
                .find(|s| s.adapter == Some(g))
                .and_then(|s| self.live.get(&s.id))
                .and_then(|l| l.generation)
            else {
                continue;
            };
            match self.store.activate(generation, &mut self.model) {
                Ok(slot) => {
                    slots.insert(g, slot as i32);
                }
                Err(e) => {
                    let ids: Vec<u64> = out.scheduled.iter().filter(|s| s.adapter == Some(g)).map(|s| s.id).collect();
                    for id in ids {
                        let name = self.live.get(&id).map(|l| l.sub.model.clone()).unwrap_or_default();
                        self.fail(id, EngineError::from_store(&name, &e));
                    }
                }
            }
        }
        slots
    }

    /// Prompt logprobs and sampling for one scheduled request.
    fn process(
        &mut self,
        s: &multilora_scheduler::ScheduledRequest,
        rows: &[Vec<f32>],
        events: &mut Vec<(u64, Event)>,
    ) -> Option<RequestResult> {
        let live = self.live.get_mut(&s.id)?;
        if s.logits == LogitsWanted::AllPrompt
            && let Some(entries) = live.prompt_lp.as_mut()
        {
            let k = live.sub.params.prompt_logprobs.unwrap_or(0);
            for (j, r) in rows.iter().enumerate() {
                let target = s.num_computed_tokens + j + 1;
                if target < s.num_prompt_tokens && entries[target].is_none() {
                    let lp = log_softmax(r);
                    let token = live.sub.prompt[target];
                    entries[target] =
                        Some(PromptLogprob { token, logprob: lp[token as usize], top_logprobs: top_n(&lp, k) });
                }
            }
            if s.num_computed_tokens + s.token_ids.len() >= s.num_prompt_tokens
                && let Some(entries) = live.prompt_lp.take()
            {
                events.push((s.id, Event::PromptLogprobs(entries)));
            }
        }
        if !s.sample {
            return None;
        }
        let raw = rows.last()?;
        let params = &live.sub.params;
        let (logprob, top) = match params.logprobs {
            Some(k) => {
                let lp = log_softmax(raw);
                (Some(lp), k)
            }
            None => (None, 0),
        };
        let mut work = raw.clone();
        let token = live.sampler.sample(&mut work, params);
        live.sampler.push(token);
        let now = Instant::now();
        match live.last_token {
            None => self.counters.ttft.observe(now - live.sub.arrived),
            Some(t) => self.counters.itl.observe(now - t),
        }
        live.last_token = Some(now);
        self.counters.generation_tokens += 1;
        self.counters.adapter(&live.sub.model).generation_tokens += 1;
        let mut delta = match (&mut live.detok, &self.tokenizer) {
            (Some(d), Some(t)) => d.push(t, token),
            _ => String::new(),
        };
        let mut finish = None;
        if !params.stop.is_empty() {
            let prev = live.text.len();
            live.text.push_str(&delta);
            let longest = params.stop.iter().map(String::len).max().unwrap_or(0);
            let mut from = prev.saturating_sub(longest);
            while !live.text.is_char_boundary(from) {
                from -= 1;
            }
            let hit = params.stop.iter().filter_map(|st| live.text[from..].find(st.as_str()).map(|p| p + from)).min();
            if let Some(pos) = hit {
                delta = live.text.get(prev..pos).unwrap_or_default().to_string();
                live.text.truncate(pos);
                finish = Some(FinishReason::Stop);
            }
        }
        let (lp, top_logprobs) = match &logprob {
            Some(lp) => (Some(lp[token as usize]), top_n(lp, top)),
            None => (None, Vec::new()),
        };
        events.push((s.id, Event::Token { id: token, text_delta: delta, logprob: lp, top_logprobs }));
        Some(RequestResult { id: s.id, token: Some(token), finish })
    }

    fn note_deferred(&mut self) {
        let now = self.deferred.len() + self.scheduler.counts().deferred;
        self.counters.deferred_max = self.counters.deferred_max.max(now);
    }

    fn snapshot(&self) -> MetricsSnapshot {
        let c = self.scheduler.counts();
        let sm = self.store.metrics();
        let names: HashMap<u64, String> = self.store.adapters().into_iter().map(|i| (i.id.0, i.name)).collect();
        let name =
            |g: &multilora_scheduler::AdapterGen| names.get(&g.id).cloned().unwrap_or_else(|| format!("#{}", g.id));
        let deferred = self.deferred.len() + c.deferred;
        let mut load_time = Histogram::new(sm.load_time.bounds);
        load_time.counts.clone_from(&sm.load_time.counts);
        load_time.sum_seconds = sm.load_time.sum_seconds;
        load_time.count = sm.load_time.count;
        MetricsSnapshot {
            running: c.running,
            waiting: c.waiting,
            deferred,
            deferred_max: self.counters.deferred_max.max(deferred),
            running_adapters: c.running_adapters.iter().map(name).collect(),
            waiting_adapters: c.waiting_adapters.iter().map(name).collect(),
            max_lora: self.config.max_loras,
            device_tier: TierOccupancy { entries: sm.device.entries, capacity: sm.device.capacity },
            cpu_tier: TierOccupancy { entries: sm.cpu.entries, capacity: sm.cpu.capacity },
            pinned_slots: sm.pinned_slots,
            kv_usage: c.kv.usage,
            kv_blocks: c.kv.num_blocks,
            prompt_tokens: self.counters.prompt_tokens,
            generation_tokens: self.counters.generation_tokens,
            requests_finished: self.counters.finished.clone(),
            request_errors: self.counters.errors.clone(),
            prefix_cache_queries: c.kv.queries,
            prefix_cache_query_tokens: c.kv.query_tokens,
            prefix_cache_hit_tokens: c.kv.hit_tokens,
            preemptions: self.counters.preemptions,
            adapter_loads: sm.loads,
            adapter_events_pending: sm.events_pending,
            adapter_evictions: sm.cpu.evictions + sm.device.evictions,
            per_adapter: self.counters.per_adapter.clone(),
            ttft: self.counters.ttft.clone(),
            inter_token_latency: self.counters.itl.clone(),
            e2e_latency: self.counters.e2e.clone(),
            adapter_load_time: load_time,
            steps: self.counters.steps,
            step_duration: self.counters.step_duration.clone(),
            iteration_tokens: self.counters.iteration_tokens.clone(),
            prefill_tokens_per_step: self.counters.prefill_tokens.clone(),
            step_rows: self.counters.step_rows.clone(),
            step_adapters: self.counters.step_adapters.clone(),
        }
    }

    /// Fails everything still live and queued, and leaves a last snapshot for `metrics()`.
    fn shutdown(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Submit(sub) => {
                    let _ = sub.events.send(Event::Error(EngineError::Shutdown));
                }
                Command::Unload(_, reply) => {
                    let _ = reply.send(Err(EngineError::Shutdown));
                }
                _ => {}
            }
        }
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            self.fail(id, EngineError::Shutdown);
        }
        *self.last_metrics.lock() = Some(self.snapshot());
    }
}

/// The tokens that end a request: its `stop_token_ids`, plus EOS unless `ignore_eos`.
fn stop_ids(p: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut ids = p.stop_token_ids.clone();
    if !p.ignore_eos {
        ids.extend(eos.iter().copied());
    }
    ids
}

impl std::fmt::Debug for EngineLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLoop").field("live", &self.live.len()).field("deferred", &self.deferred.len()).finish()
    }
}
