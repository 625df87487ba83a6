//! Adapters entering and leaving the store: startup loads, background loads and resolution (run
//! by the loader threads), and the runtime `load` / `unload` / `reload_in_place`.
//!
//! Every path reads files with no lock held, then takes the lock once to publish the result. An
//! adapter is fully validated (its targets included) before anything is evicted or swapped for
//! it, so a bad one costs nothing and a failed reload leaves the old generation serving. A load,
//! background or runtime, that finds every CPU entry pinned waits for one (`waiting.rs`); a
//! background load that fails is retried after a back-off (`backoff.rs`). A load that ends after
//! its adapter was unloaded or reloaded is cached for no one, but still ends the tickets of the
//! requests accepted while it ran (`ticket.rs`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use multilora_adapter::LoraAdapter;
use multilora_types::AdapterSource;
use multilora_types::{AdapterGen, AdapterId, ModuleKind};

use crate::backoff::Failure;
use crate::cpu_tier::TierFull;
use crate::error::{Error, Result};
use crate::registry::LoadState;
use crate::resolver::resolver_error;
use crate::security::{confine, parse_runtime_source};
use crate::status::{LoadEvent, Loaded, Unloaded};
use crate::store::{Inner, Job, JobKind, Shared, Store};
use crate::ticket::AdapterRef;
use crate::waiting::Waiting;

impl Shared {
    /// Runs the loader on `source`, outside the lock, timing it, and checks the adapter's
    /// targets. A panicking loader becomes an error.
    fn read(&self, name: &str, source: &AdapterSource) -> (Result<LoraAdapter>, Duration) {
        let started = Instant::now();
        let loaded = catch_unwind(AssertUnwindSafe(|| {
            self.loader.load(name, source, &self.config.shapes, &self.opts).map_err(Error::from)
        }))
        .unwrap_or_else(|_| Err(Error::LoaderPanicked { name: name.to_string() }));
        (loaded.and_then(|adapter| self.check_targets(name, adapter)), started.elapsed())
    }

    /// Refuses an adapter that targets module kinds without slot buffers: the model could not
    /// apply it, so it must never become a current generation.
    fn check_targets(&self, name: &str, adapter: LoraAdapter) -> Result<LoraAdapter> {
        let lora = &self.config.lora;
        let modules: Vec<ModuleKind> = adapter.target_kinds().into_iter().filter(|&k| !lora.targets(k)).collect();
        if modules.is_empty() { Ok(adapter) } else { Err(Error::UntargetedModules { name: name.to_string(), modules }) }
    }

    /// Asks the resolvers in order for `name`'s source, and confines the answer.
    fn resolve(&self, name: &str) -> Result<AdapterSource> {
        for resolver in &self.resolvers {
            if let Some(source) = resolver.resolve(name).map_err(|e| resolver_error(name, e))? {
                return confine(name, &source, &self.config);
            }
        }
        Err(Error::UnknownAdapter { name: name.to_string() })
    }

    /// Registers and loads a trusted startup adapter.
    pub(crate) fn add_loaded(&self, name: &str, source: AdapterSource) -> Result<AdapterGen> {
        self.state.lock().registry.check_new(name)?;
        let (loaded, elapsed) = self.read(name, &source);
        let mut inner = self.state.lock();
        let adapter = loaded.inspect_err(|e| inner.counters.failure(e.kind()))?;
        let id = inner.registry.register(name, source)?;
        inner.insert_loaded(id, adapter, elapsed, self.config.max_cpu_loras).inspect_err(|e| {
            inner.registry.remove(name);
            inner.counters.failure(e.kind());
        })
    }

    /// A loader thread's job: load (after resolving, for an unknown name), then publish the
    /// outcome unless the adapter was unloaded, reloaded or retried meanwhile.
    pub(crate) fn run(&self, job: Job) {
        let (loaded, elapsed) = if self.shutdown.load(Ordering::SeqCst) {
            (Err(Error::Shutdown { name: job.name.clone() }), Duration::ZERO)
        } else {
            match &job.kind {
                JobKind::Registered { source, .. } => {
                    let (loaded, elapsed) = self.read(&job.name, source);
                    (loaded.map(|a| (source.clone(), a)), elapsed)
                }
                JobKind::Resolve => match self.resolve(&job.name) {
                    Ok(source) => {
                        let (loaded, elapsed) = self.read(&job.name, &source);
                        (loaded.map(|a| (source, a)), elapsed)
                    }
                    Err(e) => (Err(e), Duration::ZERO),
                },
            }
        };
        let base = self.config.load_retry_backoff;
        let mut inner = self.state.lock();
        inner.loading -= 1;
        let events = match job.kind {
            JobKind::Registered { id, .. } => {
                let current =
                    inner.registry.get(id).is_some_and(|e| matches!(e.state, LoadState::Loading(t) if t == job.ticket));
                let loaded = loaded.map(|(_, adapter)| adapter);
                match loaded {
                    Ok(adapter) if current => inner.place(id, job.name, job.ticket, adapter, elapsed),
                    Err(e) if current => inner.fail(id, job.name, job.ticket, e, base),
                    // Unloaded, reloaded or retried meanwhile: not cached, but the requests that
                    // hold its ticket get what it read.
                    loaded => inner.settle_superseded(job.name, job.ticket, Some(id), loaded.map(Arc::new), elapsed),
                }
            }
            JobKind::Resolve => inner.resolved(job.name, job.ticket, loaded, elapsed, base),
        };
        self.publish(inner, events);
    }
}

impl Inner {
    /// A resolution's load ended. Still current (no runtime `load` took the name meanwhile): the
    /// name is registered and the adapter placed, or the failure remembered with its back-off.
    /// Otherwise the requests holding its ticket run on what it read, under an id of its own.
    fn resolved(
        &mut self,
        name: String,
        ticket: u64,
        loaded: Result<(AdapterSource, LoraAdapter)>,
        elapsed: Duration,
        base: Duration,
    ) -> Vec<LoadEvent> {
        let current = self.resolving.get(&name) == Some(&ticket);
        if current {
            self.resolving.remove(&name);
        }
        match loaded {
            Ok((source, adapter)) if current => match self.registry.register(&name, source) {
                Ok(id) => {
                    self.resolve_failures.pop(&name);
                    // Registered and still loading until it has room in the CPU tier.
                    if let Some(entry) = self.registry.get_mut(id) {
                        entry.state = LoadState::Loading(ticket);
                    }
                    self.place(id, name, ticket, adapter, elapsed)
                }
                Err(_) => self.settle_superseded(name, ticket, None, Ok(Arc::new(adapter)), elapsed),
            },
            Err(e) if current => {
                self.counters.failure(e.kind());
                let error = Arc::new(e);
                let consecutive = self.resolve_failures.peek(&name).map_or(1, |f| f.consecutive.saturating_add(1));
                let failure = Failure::new(Arc::clone(&error), base, consecutive);
                self.resolve_failures.put(name.clone(), failure);
                self.settle(ticket, Err(Arc::clone(&error)));
                vec![LoadEvent::Failed { name, error }]
            }
            loaded => self.settle_superseded(name, ticket, None, loaded.map(|(_, adapter)| Arc::new(adapter)), elapsed),
        }
    }
}

impl Inner {
    /// [`Inner::try_insert`] for a start-up adapter, which has no requests to wait for room: no
    /// room is [`Error::CpuTierFull`], and nothing changed.
    pub(crate) fn insert_loaded(
        &mut self,
        id: AdapterId,
        adapter: LoraAdapter,
        elapsed: Duration,
        max_cpu_loras: usize,
    ) -> Result<AdapterGen> {
        self.try_insert(id, Arc::new(adapter), elapsed)
            .map_err(|adapter| Error::CpuTierFull { name: adapter.name().to_string(), max_cpu_loras })
    }

    /// Puts a validated adapter in the CPU tier as `id`'s current generation, if there is room
    /// once the previous generation leaves: the previous one is then retired (a lease of either
    /// kind holds it) or dropped, and the LRU entry that nothing pins (no slot pin, operator pin
    /// or host pin) is evicted if the tier is full. Without room, hands the adapter back having
    /// changed nothing, so the previous generation serves on.
    pub(crate) fn try_insert(
        &mut self,
        id: AdapterId,
        adapter: Arc<LoraAdapter>,
        elapsed: Duration,
    ) -> std::result::Result<AdapterGen, Arc<LoraAdapter>> {
        let generation = AdapterGen { id, fingerprint: adapter.fingerprint() };
        let previous = self.registry.current(id).filter(|p| *p != generation);
        let slots = &self.slots;
        if !self.cpu.has_room(&generation, previous.as_ref(), |g| slots.keeps_cpu(g)) {
            return Err(adapter);
        }
        if let Some(old) = previous {
            self.retire_or_drop(old);
        }
        let slots = &self.slots;
        match self.cpu.insert(generation, Arc::clone(&adapter), |g| slots.keeps_cpu(g)) {
            Ok(evicted) => self.counters.cpu_evictions += u64::from(evicted.is_some()),
            Err(TierFull) => {
                // `has_room` rules this out; were it to happen, the old generation is gone and
                // the new one has no room: not loaded.
                if previous.is_some()
                    && let Some(entry) = self.registry.get_mut(id)
                {
                    entry.info.fingerprint = None;
                }
                return Err(adapter);
            }
        }
        self.registry.set_loaded(id, &adapter);
        if self.registry.get(id).is_some_and(|e| e.info.operator_pinned) {
            self.slots.set_operator_pin(generation, true);
        }
        self.counters.loads += 1;
        self.counters.load_time.observe(elapsed);
        Ok(generation)
    }

    /// `generation` stops being current: leases (running requests', and preempted requests' host
    /// leases) keep it (retired, outside the capacity, in its slot while it has one) until their
    /// last release; without leases it leaves both tiers now.
    pub(crate) fn retire_or_drop(&mut self, generation: AdapterGen) {
        self.slots.set_operator_pin(generation, false);
        if self.slots.leased(&generation) {
            self.cpu.retire(&generation);
        } else {
            self.cpu.remove(&generation);
            self.slots.remove(&generation);
        }
    }

    /// A background load's adapter into the CPU tier (its `Ready` event; its tickets end with
    /// it), or, with every entry pinned, into the waiting queue: still loading, no failure, no
    /// event until it is admitted.
    fn place(
        &mut self,
        id: AdapterId,
        name: String,
        ticket: u64,
        adapter: LoraAdapter,
        elapsed: Duration,
    ) -> Vec<LoadEvent> {
        let adapter = Arc::new(adapter);
        match self.try_insert(id, Arc::clone(&adapter), elapsed) {
            Ok(generation) => {
                self.settle(ticket, Ok(AdapterRef::new(generation, adapter)));
                vec![LoadEvent::Ready { name, generation }]
            }
            Err(adapter) => {
                self.wait_for_room(Waiting { id, name, ticket, adapter, elapsed });
                Vec::new()
            }
        }
    }

    /// A validated adapter that found every CPU entry pinned: it waits, still `Loading` under its
    /// ticket, until an entry unpins (`waiting.rs`).
    fn wait_for_room(&mut self, waiting: Waiting) {
        self.counters.capacity_waits += 1;
        self.waiting.push_back(waiting);
    }

    /// A failed background load: its event, its tickets' outcome, and the entry's state until
    /// the back-off from `base` (doubled per failure in a row) ends.
    fn fail(&mut self, id: AdapterId, name: String, ticket: u64, e: Error, base: Duration) -> Vec<LoadEvent> {
        self.counters.failure(e.kind());
        let error = Arc::new(e);
        if let Some(entry) = self.registry.get_mut(id) {
            entry.failures = entry.failures.saturating_add(1);
            entry.state = LoadState::Failed(Failure::new(Arc::clone(&error), base, entry.failures));
        }
        self.settle(ticket, Err(Arc::clone(&error)));
        vec![LoadEvent::Failed { name, error }]
    }

    /// A load that ended after its adapter was unloaded, reloaded or retried (or, for a
    /// resolution, after a runtime `load` took the name): it is not cached, as it is not
    /// current. The requests that hold its ticket get what it read, under `id` (a fresh id when
    /// `None`), and an event tells them to look; without holders it is dropped as if it never ran.
    pub(crate) fn settle_superseded(
        &mut self,
        name: String,
        ticket: u64,
        id: Option<AdapterId>,
        loaded: Result<Arc<LoraAdapter>>,
        elapsed: Duration,
    ) -> Vec<LoadEvent> {
        if self.drop_if_unheld(ticket) {
            return Vec::new();
        }
        match loaded {
            Ok(adapter) => {
                let id = id.unwrap_or_else(|| self.registry.fresh_id());
                let generation = AdapterGen { id, fingerprint: adapter.fingerprint() };
                self.counters.loads += 1;
                self.counters.load_time.observe(elapsed);
                self.settle(ticket, Ok(AdapterRef::new(generation, adapter)));
                vec![LoadEvent::Superseded { name, generation }]
            }
            Err(e) => {
                self.counters.failure(e.kind());
                let error = Arc::new(e);
                self.settle(ticket, Err(Arc::clone(&error)));
                vec![LoadEvent::Failed { name, error }]
            }
        }
    }
}

impl Store {
    fn runtime_allowed(&self, op: &'static str, name: &str) -> Result<()> {
        if self.shared.config.allow_runtime_updates {
            Ok(())
        } else {
            Err(Error::RuntimeUpdatesDisabled { op, name: name.to_string() })
        }
    }

    /// Counts a failed runtime call by kind, and passes the error on.
    fn counted<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            self.shared.state.lock().counters.failure(e.kind());
        }
        result
    }

    /// A client's source string for adapter `name`, read and confined before anything is loaded:
    /// a directory inside the allowed roots, or a hub id when hub loading at run time is on. A
    /// path outside the roots is [`Error::PathOutsideRoots`] with one message whether it is a
    /// directory, a file or nothing, and the file system outside the roots is not asked about it.
    pub fn runtime_source(&self, name: &str, source: &str) -> Result<AdapterSource> {
        self.counted(parse_runtime_source(name, source, &self.shared.config))
    }

    /// Registers and loads `name` from a runtime `source` (vLLM's `/v1/load_lora_adapter`),
    /// returning once it is validated and registered. Refused unless runtime updates are on; a
    /// local source must lie inside the allowed roots, a hub source needs hub loading at run
    /// time. Files are read with no lock held; a failure registers and evicts nothing. With
    /// every CPU entry pinned it is not refused: it is [`Loaded::WaitingForRoom`], queued like a
    /// background load for the first entry that unpins, and its requests wait until then.
    pub fn load(&self, name: &str, source: AdapterSource) -> Result<Loaded> {
        self.counted(self.load_inner(name, source))
    }

    fn load_inner(&self, name: &str, source: AdapterSource) -> Result<Loaded> {
        self.runtime_allowed("load", name)?;
        self.shared.state.lock().registry.check_new(name)?;
        let source = confine(name, &source, &self.shared.config)?;
        let (loaded, elapsed) = self.shared.read(name, &source);
        let adapter = Arc::new(loaded?);
        let mut inner = self.shared.state.lock();
        let id = inner.registry.register(name, source)?;
        // Requests holding a ticket on a resolution of this name keep it (they run on what it
        // reads); new requests get this adapter.
        inner.resolving.remove(name);
        inner.resolve_failures.pop(name);
        let (loaded, events) = match inner.try_insert(id, adapter, elapsed) {
            Ok(generation) => {
                (Loaded::Cached(generation), vec![LoadEvent::Ready { name: name.to_string(), generation }])
            }
            Err(adapter) => (inner.pend(id, name, adapter, elapsed), Vec::new()),
        };
        self.shared.publish(inner, events);
        Ok(loaded)
    }

    /// Removes `name` (vLLM's `/v1/unload_lora_adapter`). The name is gone at once: new requests
    /// get [`Error::UnknownAdapter`]. Requests accepted before keep what they hold and finish on
    /// it: its current generation leaves both tiers now, or, if leases hold it, when the last of
    /// them is dropped; a load of it in flight or waiting for room ends for the tickets that
    /// hold it (a [`LoadEvent::Superseded`]) and is cached for no one.
    pub fn unload(&self, name: &str) -> Result<Unloaded> {
        self.counted(self.unload_inner(name))
    }

    fn unload_inner(&self, name: &str) -> Result<Unloaded> {
        self.runtime_allowed("unload", name)?;
        let mut inner = self.shared.state.lock();
        let entry = inner.registry.remove(name).ok_or_else(|| Error::UnknownAdapter { name: name.to_string() })?;
        inner.resolve_failures.pop(name);
        let generation = entry.info.generation();
        let draining = generation.is_some_and(|generation| inner.slots.leased(&generation));
        if let Some(generation) = generation {
            inner.retire_or_drop(generation);
        }
        // Its entry left the live tier: a load waiting for room may go in (and one of its own
        // ends for its tickets).
        let events = inner.admit_waiting();
        self.shared.publish(inner, events);
        Ok(Unloaded { id: entry.info.id, name: entry.info.name, generation, draining })
    }

    /// Replaces `name`'s weights from `source`, keeping its id: a new generation (new
    /// fingerprint) that new requests get, while requests accepted before finish on the one they
    /// hold, which keeps its CPU entry and slot until their last release. Same checks as
    /// [`Store::load`] (validation, targets with slot buffers), all made before the swap: on
    /// failure the old generation stays current and keeps serving. With every CPU entry pinned
    /// the new generation is [`Loaded::WaitingForRoom`]: new requests wait for it (they are not
    /// given the old one), and it becomes current when it goes in.
    pub fn reload_in_place(&self, name: &str, source: AdapterSource) -> Result<Loaded> {
        self.counted(self.reload_inner(name, source))
    }

    fn reload_inner(&self, name: &str, source: AdapterSource) -> Result<Loaded> {
        self.runtime_allowed("reload", name)?;
        let unknown = || Error::UnknownAdapter { name: name.to_string() };
        let id = self.shared.state.lock().registry.id(name).ok_or_else(unknown)?;
        let source = confine(name, &source, &self.shared.config)?;
        let (loaded, elapsed) = self.shared.read(name, &source);
        let adapter = Arc::new(loaded?);
        let mut guard = self.shared.state.lock();
        let inner = &mut *guard;
        let Some(entry) = inner.registry.get_mut(id).filter(|e| e.info.name == name) else {
            return Err(unknown());
        };
        entry.info.source = source;
        // A background load of the old source, in flight or waiting for room, is now stale: its
        // tickets end with what it reads, and it is cached for no one.
        entry.state = LoadState::Idle;
        let (loaded, mut events) = match inner.try_insert(id, adapter, elapsed) {
            Ok(generation) => {
                (Loaded::Cached(generation), vec![LoadEvent::Ready { name: name.to_string(), generation }])
            }
            Err(adapter) => (inner.pend(id, name, adapter, elapsed), Vec::new()),
        };
        events.extend(inner.admit_waiting());
        self.shared.publish(guard, events);
        Ok(loaded)
    }
}

impl Inner {
    /// A runtime load or reload that found every CPU entry pinned: `id` is loading under a new
    /// ticket (what new requests for it get), and its adapter waits for room.
    fn pend(&mut self, id: AdapterId, name: &str, adapter: Arc<LoraAdapter>, elapsed: Duration) -> Loaded {
        let generation = AdapterGen { id, fingerprint: adapter.fingerprint() };
        let ticket = self.new_ticket();
        if let Some(entry) = self.registry.get_mut(id) {
            entry.state = LoadState::Loading(ticket);
        }
        self.wait_for_room(Waiting { id, name: name.to_string(), ticket, adapter, elapsed });
        Loaded::WaitingForRoom(generation)
    }
}
