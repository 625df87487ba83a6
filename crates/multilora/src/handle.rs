//! `Engine` (owns the loop thread), `EngineHandle` (cloneable, `Send + Sync`: submit, manage
//! adapters, read metrics from any thread or task) and `RequestStream` (one request's events;
//! dropping it cancels the request).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use multilora_models::{KvCache, Model};
use multilora_scheduler::Scheduler;
use multilora_store::{Resolution, Store};
use multilora_types::AdapterSource;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::command::{Command, EventCount, Submission};
use crate::config::EngineConfig;
use crate::engine_loop::EngineLoop;
use crate::error::{BuildError, EngineError, Result};
use crate::guided::Grammars;
use crate::health::{EngineHealth, LoopState, Published};
use crate::metrics::MetricsSnapshot;
use crate::request::{Completion, Event, FinishReason, GenerateRequest, Prompt, TokenLogprob, Usage};
use crate::stop::StopStrings;

/// Where an adapter's weights are now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Tier {
    /// In a device slot (the base model is always here).
    Device,
    /// In host memory.
    Cpu,
    /// Registered, not loaded; or offered by a resolver and not loaded yet.
    Disk,
}

/// One served model: the base or an adapter (vLLM's `/v1/models` entry).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelInfo {
    /// The name requests use.
    pub id: String,
    /// The base model's name, for adapters.
    pub parent: Option<String>,
    /// Where it was loaded from.
    pub source: String,
    /// Largest rank, once loaded.
    pub rank: Option<usize>,
    /// Content fingerprint (hex), once loaded.
    pub fingerprint: Option<String>,
    /// Where it is now.
    pub tier: Tier,
}

/// How long [`EngineHandle::metrics`] waits for the loop before it answers with the last
/// published snapshot.
pub const METRICS_WAIT: Duration = Duration::from_secs(1);

/// What every handle shares.
#[derive(Debug)]
struct Shared {
    tx: Sender<Command>,
    store: Arc<Store>,
    tokenizer: Option<Arc<Tokenizer>>,
    /// Structured outputs' compiler and cache, over `tokenizer`'s vocabulary.
    grammars: Grammars,
    config: EngineConfig,
    next_id: AtomicU64,
    published: Arc<Published>,
}

/// A cloneable handle on a running engine.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

/// The engine: its loop thread runs until [`Engine::shutdown`] or drop.
#[derive(Debug)]
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        config: EngineConfig,
        model: Model,
        kv: KvCache,
        scheduler: Scheduler,
        store: Store,
        tokenizer: Option<Tokenizer>,
        (tx, rx, events): (Sender<Command>, Receiver<Command>, EventCount),
    ) -> std::result::Result<Engine, BuildError> {
        let store = Arc::new(store);
        let tokenizer = tokenizer.map(Arc::new);
        let published = Published::new();
        // As many compute threads as the global pool would use (`RAYON_NUM_THREADS` or the cores).
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("multilora-compute-{i}"))
            .build()
            .map_err(|e| BuildError::Spawn { what: "the engine's compute threads", source: Arc::new(e) })?;
        let lp = EngineLoop::new(
            config.clone(),
            model,
            kv,
            scheduler,
            Arc::clone(&store),
            tokenizer.clone(),
            (rx, events),
            Arc::clone(&published),
            pool,
        );
        let thread = std::thread::Builder::new()
            .name("multilora-engine".into())
            .spawn(move || lp.run())
            .map_err(|e| BuildError::Spawn { what: "the engine thread", source: Arc::new(e) })?;
        #[cfg(feature = "failpoints")]
        crate::failpoints::from_env();
        let grammars = Grammars::new(tokenizer.clone(), config.vocab_size, config.eos_token_ids.clone());
        let shared = Shared { tx, store, tokenizer, grammars, config, next_id: AtomicU64::new(1), published };
        Ok(Engine { handle: EngineHandle { shared: Arc::new(shared) }, thread: Some(thread) })
    }

    /// A handle for other threads and tasks.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Submits a request; see [`EngineHandle::submit`].
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream> {
        self.handle.submit(request)
    }

    /// A metrics snapshot; see [`EngineHandle::metrics`].
    pub fn metrics(&self) -> MetricsSnapshot {
        self.handle.metrics()
    }

    /// The served models; see [`EngineHandle::models`].
    pub fn models(&self) -> Vec<ModelInfo> {
        self.handle.models()
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        self.handle.config()
    }

    /// Stops the loop (live requests fail with `shutdown`) and waits for it.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.handle.shared.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

impl EngineHandle {
    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// Tokenizes `request` on the caller's thread, then queues it. Its parameters were validated
    /// once, by [`crate::SamplingParams::validate`]; only their token ids are checked here, against
    /// the engine's vocabulary. Token ids outside it, an untokenizable or too long prompt, an unknown model and an adapter whose
    /// last load failed fail here, before anything is queued. The model name is resolved here,
    /// once: the request holds the adapter generation it was accepted with (or the load of it
    /// that this call started or joined, for an adapter not in host memory yet) until it ends,
    /// so an unload or reload of the adapter after this call never fails it; it finishes on that
    /// generation, as in vLLM. If the load fails, the error arrives on the stream as
    /// [`Event::Error`] ([`RequestStream::adapter_ready`] says which case a stream is in).
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream> {
        let config = &self.shared.config;
        self.check_alive()?;
        request.params.check_vocab(config.vocab_size)?;
        let prompt = match request.prompt {
            Prompt::Tokens(ids) => ids,
            Prompt::Text(text) => self.tokenize(&text, true)?,
        };
        if prompt.is_empty() {
            return Err(EngineError::invalid("the prompt is empty"));
        }
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= config.vocab_size) {
            return Err(EngineError::invalid(format!(
                "prompt token {t} is outside the vocabulary of {}",
                config.vocab_size
            )));
        }
        if prompt.len() >= config.max_model_len {
            return Err(EngineError::PromptTooLong { prompt_len: prompt.len(), max_model_len: config.max_model_len });
        }
        let params = request.params.into_params();
        let stops = StopStrings::new(&params.stop)?;
        // Compiled here, on the caller's thread, so a constraint that does not compile is refused
        // before anything is queued; forced tokens carry no logprobs, so a request that asks for
        // logprobs samples every token; a row without top-k, top-p or min-p tries a token before
        // any mask.
        let guide = match &params.constraint {
            Some(c) => {
                let p = &params;
                let speculate = p.temperature == 0.0 || (p.top_k <= 0 && p.top_p >= 1.0 && p.min_p == 0.0);
                let guide = self.shared.grammars.guide(c, p.logprobs.is_none(), speculate);
                Some(guide.map_err(|reason| EngineError::Constraint { kind: c.kind(), reason })?)
            }
            None => None,
        };
        let adapter = self.resolve(&request.model)?;
        let adapter_ready = !matches!(adapter, Some(Resolution::Loading(_)));
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = unbounded_channel();
        let sub = Submission {
            id,
            model: request.model,
            adapter,
            prompt,
            params,
            stops,
            guide,
            events,
            arrived: Instant::now(),
        };
        self.shared.tx.send(Command::Submit(Box::new(sub))).map_err(|_| EngineError::Shutdown)?;
        Ok(RequestStream { id, rx, tx: self.shared.tx.clone(), done: false, adapter_ready })
    }

    /// What `model` is: `None` for the base model; for an adapter, what the store resolves it
    /// to (its generation in host memory, or the ticket of the load this starts or joins). An
    /// unknown model, LoRA being off, and an adapter whose last load failed are errors.
    fn resolve(&self, model: &str) -> Result<Option<Resolution>> {
        let config = &self.shared.config;
        if model == config.served_model_name {
            return Ok(None);
        }
        if config.lora.is_off() {
            return Err(EngineError::ModelNotFound { name: model.to_string() });
        }
        match self.shared.store.resolve(model) {
            Ok(Resolution::Failed(e)) => Err(EngineError::from_store_arc(model, &e)),
            Ok(resolution) => Ok(Some(resolution)),
            Err(e) => Err(EngineError::from_store(model, e)),
        }
    }

    /// Tokenizes `text` with the model's tokenizer; `add_special_tokens` adds what the tokenizer's
    /// post-processor adds (BOS for Llama). Chat prompts rendered from a template that already
    /// writes the BOS token use `false`, as vLLM does.
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let tok = self.tokenizer()?;
        let enc = tok.encode(text, add_special_tokens).map_err(|e| EngineError::invalid(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids` with the model's tokenizer (special tokens left out when
    /// `skip_special_tokens`).
    pub fn detokenize(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let tok = self.tokenizer()?;
        tok.decode(ids, skip_special_tokens).map_err(|e| EngineError::invalid(format!("decoding: {e}")))
    }

    /// Each token's own text (special tokens included), as OpenAI's logprobs report tokens.
    pub fn token_texts(&self, ids: &[u32]) -> Result<Vec<String>> {
        let tok = self.tokenizer()?;
        ids.iter()
            .map(|&id| tok.decode(&[id], false).map_err(|e| EngineError::invalid(format!("decoding token {id}: {e}"))))
            .collect()
    }

    fn tokenizer(&self) -> Result<&Tokenizer> {
        self.shared
            .tokenizer
            .as_deref()
            .ok_or_else(|| EngineError::invalid("text prompts need the model's tokenizer.json"))
    }

    /// A metrics snapshot, taken by the loop between steps; if the loop does not answer within
    /// [`METRICS_WAIT`] (a long step, or a stuck loop) or is gone, the last one it published.
    pub fn metrics(&self) -> MetricsSnapshot {
        let (reply, rx) = std::sync::mpsc::sync_channel(1);
        if self.shared.published.state() == LoopState::Running
            && self.shared.tx.send(Command::Metrics(reply)).is_ok()
            && let Ok(m) = rx.recv_timeout(METRICS_WAIT)
        {
            return m;
        }
        (*self.shared.published.snapshot()).clone()
    }

    /// The snapshot the loop last published (at most 20 ms old while steps run, exact while it
    /// is idle), without waiting on the loop: what `/metrics` serves.
    pub fn published_metrics(&self) -> Arc<MetricsSnapshot> {
        self.shared.published.snapshot()
    }

    /// The loop's state and the time since its last heartbeat, without waiting on it: what
    /// `/health` answers from.
    pub fn health(&self) -> EngineHealth {
        self.shared.published.health()
    }

    /// Whether the engine loop still runs: false after shutdown or a loop that panicked. Does not
    /// wait on the loop (see [`EngineHandle::health`] for a stuck one).
    pub fn is_running(&self) -> bool {
        self.shared.published.state() == LoopState::Running
    }

    /// The base model first, then every registered adapter with its tier.
    pub fn models(&self) -> Vec<ModelInfo> {
        let config = &self.shared.config;
        let store = &self.shared.store;
        let mut out = vec![ModelInfo {
            id: config.served_model_name.clone(),
            parent: None,
            source: config.model.clone(),
            rank: None,
            fingerprint: None,
            tier: Tier::Device,
        }];
        for info in store.adapters() {
            let generation = info.generation();
            let tier = match generation {
                Some(g) if store.slot_of(g).is_some() => Tier::Device,
                Some(g) if store.adapter(g).is_some() => Tier::Cpu,
                _ => Tier::Disk,
            };
            out.push(ModelInfo {
                id: info.name,
                parent: Some(config.served_model_name.clone()),
                source: info.source.to_string(),
                rank: info.rank,
                fingerprint: info.fingerprint.map(|f| f.to_hex()),
                tier,
            });
        }
        out
    }

    /// The adapters the resolvers offer that no request has loaded yet (tier [`Tier::Disk`], no
    /// rank or fingerprint until loaded), for a model list that shows every name a request may
    /// use: a router that routes by `/v1/models` then sends this server an adapter it never
    /// served. Empty unless runtime updating is allowed (resolvers are asked only then). Lists
    /// directories: call it off async threads. A resolver whose listing fails is logged and
    /// skipped.
    pub fn discoverable_adapters(&self) -> Vec<ModelInfo> {
        let (offered, errors) = self.shared.store.offered();
        for e in errors {
            tracing::warn!(error = %e, "a lora resolver could not list its adapters");
        }
        let base = &self.shared.config.served_model_name;
        offered
            .into_iter()
            .map(|(id, source)| ModelInfo {
                id,
                parent: Some(base.clone()),
                source: source.to_string(),
                rank: None,
                fingerprint: None,
                tier: Tier::Disk,
            })
            .collect()
    }

    /// Registers and loads adapter `name` from `source` (vLLM's `/v1/load_lora_adapter`),
    /// returning once it is validated and registered: `Ok(true)` when it is in host memory,
    /// `Ok(false)` when every host-memory entry is pinned by requests (it is not refused: it goes
    /// in when the first entry unpins, and requests for it wait until then). The files are read
    /// on the caller's thread, never inside a step. Refused unless `allow_runtime_lora_updating`.
    pub fn load_adapter(&self, name: &str, source: &str) -> Result<bool> {
        let src = self.runtime_source(name, source)?;
        // The store refuses an adapter targeting modules without slot buffers before it is
        // registered, so a refused load leaves nothing behind.
        let loaded = self.shared.store.load(name, src).map_err(|e| EngineError::from_store(name, e))?;
        Ok(loaded.is_cached())
    }

    /// Replaces `name`'s weights in place: new requests get the new generation, requests
    /// accepted before finish on the one they were accepted with; prefix-cache blocks of the old
    /// generation are never reused. A new version that fails any check (unreadable, invalid,
    /// targeting modules without slots) is refused and the previous one stays current.
    /// `Ok(true)` when the new version is in host memory, `Ok(false)` when every host-memory
    /// entry is pinned: new requests wait for it until the first entry unpins.
    pub fn reload_adapter(&self, name: &str, source: &str) -> Result<bool> {
        let src = self.runtime_source(name, source)?;
        let loaded = self.shared.store.reload_in_place(name, src).map_err(|e| EngineError::from_store(name, e))?;
        Ok(loaded.is_cached())
    }

    /// Starts loading adapter `name` again now, after a failed load, without waiting for its
    /// back-off (a failed load is otherwise retried by the first request after the back-off).
    /// `Ok(true)` once it is in host memory, `Ok(false)` while the new load runs.
    pub fn retry_adapter(&self, name: &str) -> Result<bool> {
        self.check_alive()?;
        self.shared.store.retry(name);
        match self.shared.store.resolve(name) {
            Ok(Resolution::Ready(_)) => Ok(true),
            Ok(Resolution::Loading(_)) => Ok(false),
            Ok(Resolution::Failed(e)) => Err(EngineError::from_store_arc(name, &e)),
            Err(e) => Err(EngineError::from_store(name, e)),
        }
    }

    /// Removes `name`: new requests for it get `model_not_found`; requests accepted before run
    /// to their end on the generation they were accepted with (or the load of it they wait on).
    pub fn unload_adapter(&self, name: &str) -> Result<()> {
        if !self.shared.config.allow_runtime_lora_updating {
            return Err(EngineError::RuntimeUpdatesDisabled);
        }
        self.check_alive()?;
        self.shared.store.unload(name).map_err(|e| EngineError::from_store(name, e))?;
        Ok(())
    }

    /// `Ok` while the loop runs; a stopped or failed engine refuses every call that would
    /// change what it serves.
    fn check_alive(&self) -> Result<()> {
        match self.shared.published.state() {
            LoopState::Running => Ok(()),
            LoopState::Stopped => Err(EngineError::Shutdown),
            LoopState::Failed { reason } => Err(EngineError::EngineFailed { reason }),
        }
    }

    /// A client's source string for adapter `name`, read and confined by the store, which asks
    /// the file system nothing about a path outside the allowed roots (one answer for all of
    /// them). A string that is no adapter source is `invalid_request`, as before.
    fn runtime_source(&self, name: &str, source: &str) -> Result<AdapterSource> {
        if !self.shared.config.allow_runtime_lora_updating {
            return Err(EngineError::RuntimeUpdatesDisabled);
        }
        self.check_alive()?;
        self.shared.store.runtime_source(name, source).map_err(|e| match e {
            multilora_store::Error::Adapter(e @ multilora_adapter::Error::Source { .. }) => {
                EngineError::invalid(e.to_string())
            }
            other => EngineError::from_store(name, other),
        })
    }
}

/// One request's events. Works blocking ([`RequestStream::recv_blocking`]) and async
/// ([`RequestStream::recv`]); dropping it before `Finished` cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    id: u64,
    rx: UnboundedReceiver<Event>,
    tx: Sender<Command>,
    done: bool,
    adapter_ready: bool,
}

impl RequestStream {
    /// The engine's id of this request.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the request's model was in host memory when it was submitted (the base model
    /// always is). When it was not, its adapter was still loading, and a failed load arrives
    /// on this stream as its first event, [`Event::Error`]; otherwise the request was valid
    /// when it was queued.
    pub fn adapter_ready(&self) -> bool {
        self.adapter_ready
    }

    /// The next event, waiting for it; `None` once the request is over. Must not be called
    /// from inside an async runtime (use [`RequestStream::recv`] there).
    pub fn recv_blocking(&mut self) -> Option<Event> {
        let ev = self.rx.blocking_recv();
        self.note(&ev);
        ev
    }

    /// The next event; `None` once the request is over.
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        self.note(&ev);
        ev
    }

    fn note(&mut self, ev: &Option<Event>) {
        if matches!(ev, None | Some(Event::Finished { .. }) | Some(Event::Error(_))) {
            self.done = true;
        }
    }

    /// Waits for the whole output; an [`Event::Error`] becomes `Err`.
    pub fn collect_blocking(mut self) -> Result<Completion> {
        let mut c = Completion {
            token_ids: Vec::new(),
            text: String::new(),
            logprobs: None,
            prompt_logprobs: None,
            finish_reason: FinishReason::Error,
            stop_reason: None,
            usage: Usage::default(),
        };
        while let Some(ev) = self.recv_blocking() {
            match ev {
                Event::PromptLogprobs(p) => c.prompt_logprobs = Some(p),
                Event::Token { id, text_delta, logprob, top_logprobs } => {
                    c.token_ids.push(id);
                    c.text.push_str(&text_delta);
                    if let Some(logprob) = logprob {
                        c.logprobs.get_or_insert_with(Vec::new).push(TokenLogprob { token: id, logprob, top_logprobs });
                    }
                }
                Event::Finished { reason, usage, stop_reason } => {
                    c.finish_reason = reason;
                    c.stop_reason = stop_reason;
                    c.usage = usage;
                    return Ok(c);
                }
                Event::Error(e) => return Err(e),
            }
        }
        Err(EngineError::Shutdown)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}
