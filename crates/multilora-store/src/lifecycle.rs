//! Adapters entering and leaving the store: startup loads, background loads and resolution (run
//! by the loader threads), and the runtime `load` / `unload` / `reload_in_place`.
//!
//! Every path reads files with no lock held, then takes the lock once to publish the result. An
//! adapter is fully validated (its targets included) before anything is evicted or swapped for
//! it, so a bad one costs nothing and a failed reload leaves the old generation serving. A
//! background load that finds every CPU entry pinned waits for one (`waiting.rs`); one that fails
//! is retried after a back-off (`backoff.rs`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use multilora_adapter::{AdapterSource, LoraAdapter, ModuleKind};

use crate::backoff::Failure;
use crate::cpu_tier::TierFull;
use crate::error::{Error, Result};
use crate::registry::LoadState;
use crate::security::confine;
use crate::status::{LoadEvent, Unloaded};
use crate::store::{Inner, Job, JobKind, Shared, Store};
use crate::waiting::Waiting;
use multilora_types::{AdapterGen, AdapterId};

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
            if let Some(source) = resolver.resolve(name)? {
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
                if !current {
                    return;
                }
                match loaded {
                    Ok((_, adapter)) => inner.place(id, job.name, job.ticket, adapter, elapsed),
                    Err(e) => inner.fail(id, job.name, e, base),
                }
            }
            JobKind::Resolve => {
                if inner.resolving.get(&job.name) != Some(&job.ticket) {
                    return;
                }
                inner.resolving.remove(&job.name);
                match loaded {
                    Ok((source, adapter)) => match inner.registry.register(&job.name, source) {
                        Ok(id) => {
                            inner.resolve_failures.pop(&job.name);
                            // Registered and still loading until it has room in the CPU tier.
                            if let Some(entry) = inner.registry.get_mut(id) {
                                entry.state = LoadState::Loading(job.ticket);
                            }
                            inner.place(id, job.name, job.ticket, adapter, elapsed)
                        }
                        // A runtime `load` took the name meanwhile and published its own event.
                        Err(_) => Vec::new(),
                    },
                    Err(e) => {
                        inner.counters.failure(e.kind());
                        let error = Arc::new(e);
                        let consecutive =
                            inner.resolve_failures.peek(&job.name).map_or(1, |f| f.consecutive.saturating_add(1));
                        let failure = Failure::new(Arc::clone(&error), base, consecutive);
                        inner.resolve_failures.put(job.name.clone(), failure);
                        vec![LoadEvent::Failed { name: job.name, error }]
                    }
                }
            }
        };
        self.publish(inner, events);
    }
}

impl Inner {
    /// [`Inner::try_insert`] for a caller that answers at once (start-up, runtime `load` and
    /// `reload_in_place`): no room is [`Error::CpuTierFull`], and nothing changed.
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

    /// A background load's adapter into the CPU tier (its `Ready` event), or, with every entry
    /// pinned, into the waiting queue: still loading, no failure, no event until it is admitted.
    fn place(
        &mut self,
        id: AdapterId,
        name: String,
        ticket: u64,
        adapter: LoraAdapter,
        elapsed: Duration,
    ) -> Vec<LoadEvent> {
        match self.try_insert(id, Arc::new(adapter), elapsed) {
            Ok(generation) => vec![LoadEvent::Ready { name, generation }],
            Err(adapter) => {
                self.counters.capacity_waits += 1;
                self.waiting.push_back(Waiting { id, name, ticket, adapter, elapsed });
                Vec::new()
            }
        }
    }

    /// A failed background load: its event, and the entry's state until the back-off from `base`
    /// (doubled per failure in a row) ends.
    fn fail(&mut self, id: AdapterId, name: String, e: Error, base: Duration) -> Vec<LoadEvent> {
        self.counters.failure(e.kind());
        let error = Arc::new(e);
        if let Some(entry) = self.registry.get_mut(id) {
            entry.failures = entry.failures.saturating_add(1);
            entry.state = LoadState::Failed(Failure::new(Arc::clone(&error), base, entry.failures));
        }
        vec![LoadEvent::Failed { name, error }]
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

    /// Registers and loads `name` from a runtime `source` (vLLM's `/v1/load_lora_adapter`),
    /// returning once it is validated and in the CPU tier. Refused unless runtime updates are on;
    /// a local source must lie inside the allowed roots, a hub source needs hub loading at run
    /// time. Files are read with no lock held; a failure registers and evicts nothing.
    pub fn load(&self, name: &str, source: AdapterSource) -> Result<AdapterGen> {
        self.counted(self.load_inner(name, source))
    }

    fn load_inner(&self, name: &str, source: AdapterSource) -> Result<AdapterGen> {
        self.runtime_allowed("load", name)?;
        self.shared.state.lock().registry.check_new(name)?;
        let source = confine(name, &source, &self.shared.config)?;
        let (loaded, elapsed) = self.shared.read(name, &source);
        let adapter = loaded?;
        let mut inner = self.shared.state.lock();
        let id = inner.registry.register(name, source)?;
        let generation =
            inner.insert_loaded(id, adapter, elapsed, self.shared.config.max_cpu_loras).inspect_err(|_| {
                inner.registry.remove(name);
            })?;
        // Requests waiting on a resolution of this name can go: the name is served now.
        inner.resolving.remove(name);
        inner.resolve_failures.pop(name);
        self.shared.publish(inner, vec![LoadEvent::Ready { name: name.to_string(), generation }]);
        Ok(generation)
    }

    /// Removes `name` (vLLM's `/v1/unload_lora_adapter`). The name is gone at once; its current
    /// generation leaves both tiers now, or, if leases (running requests' or preempted requests'
    /// host leases) hold it, when the last of them is dropped. Requests waiting for it should
    /// fail with `model_not_found`.
    pub fn unload(&self, name: &str) -> Result<Unloaded> {
        self.counted(self.unload_inner(name))
    }

    fn unload_inner(&self, name: &str) -> Result<Unloaded> {
        self.runtime_allowed("unload", name)?;
        let mut inner = self.shared.state.lock();
        // An in-flight load of it finds the entry gone and discards its result.
        let entry = inner.registry.remove(name).ok_or_else(|| Error::UnknownAdapter { name: name.to_string() })?;
        inner.resolve_failures.pop(name);
        let generation = entry.info.generation();
        let draining = generation.is_some_and(|generation| inner.slots.leased(&generation));
        if let Some(generation) = generation {
            inner.retire_or_drop(generation);
        }
        // Its entry left the live tier: a load waiting for room may go in.
        let events = inner.admit_waiting();
        self.shared.publish(inner, events);
        Ok(Unloaded { id: entry.info.id, name: entry.info.name, generation, draining })
    }

    /// Replaces `name`'s weights from `source`, keeping its id: a new generation (new
    /// fingerprint) that new requests get, while running requests finish on the old one, which
    /// keeps its CPU entry and slot until their last release. Same checks as [`Store::load`]
    /// (validation, targets with slot buffers, room in the CPU tier), all made before the swap:
    /// on failure the old generation stays current and keeps serving.
    pub fn reload_in_place(&self, name: &str, source: AdapterSource) -> Result<AdapterGen> {
        self.counted(self.reload_inner(name, source))
    }

    fn reload_inner(&self, name: &str, source: AdapterSource) -> Result<AdapterGen> {
        self.runtime_allowed("reload", name)?;
        let unknown = || Error::UnknownAdapter { name: name.to_string() };
        let id = self.shared.state.lock().registry.id(name).ok_or_else(unknown)?;
        let source = confine(name, &source, &self.shared.config)?;
        let (loaded, elapsed) = self.shared.read(name, &source);
        let adapter = loaded?;
        let mut inner = self.shared.state.lock();
        if inner.registry.id(name) != Some(id) {
            return Err(unknown());
        }
        let generation = inner.insert_loaded(id, adapter, elapsed, self.shared.config.max_cpu_loras)?;
        if let Some(entry) = inner.registry.get_mut(id) {
            entry.info.source = source;
            // A background load of the old source, in flight or waiting for room, is now stale.
            entry.state = LoadState::Idle;
        }
        let mut events = vec![LoadEvent::Ready { name: name.to_string(), generation }];
        events.extend(inner.admit_waiting());
        self.shared.publish(inner, events);
        Ok(generation)
    }
}
