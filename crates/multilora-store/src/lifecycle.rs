//! Adapters entering and leaving the store: startup loads, background loads and resolution (run
//! by the loader threads), and the runtime `load` / `unload` / `reload_in_place`.
//!
//! Every path reads files with no lock held, then takes the lock once to publish the result. An
//! adapter is fully validated before anything is evicted for it, so a bad one costs nothing.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use multilora_adapter::{AdapterSource, LoraAdapter};

use crate::cpu_tier::TierFull;
use crate::error::{Error, Result};
use crate::registry::LoadState;
use crate::security::confine;
use crate::status::{LoadEvent, Unloaded};
use crate::store::{Inner, Job, JobKind, Shared, Store};
use multilora_types::{AdapterGen, AdapterId};

impl Shared {
    /// Runs the loader on `source`, outside the lock, timing it. A panicking loader becomes an error.
    fn read(&self, name: &str, source: &AdapterSource) -> (Result<LoraAdapter>, Duration) {
        let started = Instant::now();
        let loaded = catch_unwind(AssertUnwindSafe(|| {
            self.loader.load(name, source, &self.config.shapes, &self.opts).map_err(Error::from)
        }))
        .unwrap_or_else(|_| Err(Error::LoaderPanicked { name: name.to_string() }));
        (loaded, started.elapsed())
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
        let max_cpu_loras = self.config.max_cpu_loras;
        let mut inner = self.state.lock();
        inner.loading -= 1;
        let events = match job.kind {
            JobKind::Registered { id, .. } => {
                let current =
                    inner.registry.get(id).is_some_and(|e| matches!(e.state, LoadState::Loading(t) if t == job.ticket));
                if !current {
                    return;
                }
                let published =
                    loaded.and_then(|(_, adapter)| inner.insert_loaded(id, adapter, elapsed, max_cpu_loras));
                inner.outcome(id, job.name, published)
            }
            JobKind::Resolve => {
                if inner.resolving.get(&job.name) != Some(&job.ticket) {
                    return;
                }
                inner.resolving.remove(&job.name);
                match loaded {
                    Ok((source, adapter)) => match inner.registry.register(&job.name, source) {
                        Ok(id) => {
                            let published = inner.insert_loaded(id, adapter, elapsed, max_cpu_loras);
                            inner.outcome(id, job.name, published)
                        }
                        // A runtime `load` took the name meanwhile and published its own event.
                        Err(_) => Vec::new(),
                    },
                    Err(e) => {
                        inner.counters.failure(e.kind());
                        let error = Arc::new(e);
                        inner.resolve_failures.put(job.name.clone(), Arc::clone(&error));
                        vec![LoadEvent::Failed { name: job.name, error }]
                    }
                }
            }
        };
        self.publish(inner, events);
    }
}

impl Inner {
    /// Puts a validated adapter in the CPU tier as `id`'s current generation: the previous
    /// generation is retired (running requests pin it) or dropped, then the LRU unpinned entry is
    /// evicted if the tier is full.
    pub(crate) fn insert_loaded(
        &mut self,
        id: AdapterId,
        adapter: LoraAdapter,
        elapsed: Duration,
        max_cpu_loras: usize,
    ) -> Result<AdapterGen> {
        let generation = AdapterGen { id, fingerprint: adapter.fingerprint() };
        let previous = self.registry.current(id).filter(|p| *p != generation);
        if let Some(old) = previous {
            self.retire_or_drop(old);
        }
        let adapter = Arc::new(adapter);
        let slots = &self.slots;
        match self.cpu.insert(generation, Arc::clone(&adapter), |g| slots.is_pinned(g)) {
            Ok(evicted) => self.counters.cpu_evictions += u64::from(evicted.is_some()),
            Err(TierFull) => {
                if previous.is_some() {
                    // The old generation is gone and the new one has no room: not loaded.
                    if let Some(entry) = self.registry.get_mut(id) {
                        entry.info.fingerprint = None;
                    }
                }
                return Err(Error::CpuTierFull { name: adapter.name().to_string(), max_cpu_loras });
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

    /// `generation` stops being current: running requests keep it (retired, outside the capacity, in its
    /// slot) until their last release; without pins it leaves both tiers now.
    pub(crate) fn retire_or_drop(&mut self, generation: AdapterGen) {
        self.slots.set_operator_pin(generation, false);
        if self.slots.pins(&generation) > 0 {
            self.cpu.retire(&generation);
        } else {
            self.cpu.remove(&generation);
            self.slots.remove(&generation);
        }
    }

    /// The event for a finished background load; a failure also becomes the entry's sticky state.
    fn outcome(&mut self, id: AdapterId, name: String, published: Result<AdapterGen>) -> Vec<LoadEvent> {
        match published {
            Ok(generation) => vec![LoadEvent::Ready { name, generation }],
            Err(e) => {
                self.counters.failure(e.kind());
                let error = Arc::new(e);
                if let Some(entry) = self.registry.get_mut(id) {
                    entry.state = LoadState::Failed(Arc::clone(&error));
                }
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
    /// generation leaves both tiers now, or, if running requests pin it, when the last of them
    /// releases it. Requests waiting for it should fail with `model_not_found`.
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
        let draining = generation.is_some_and(|generation| inner.slots.pins(&generation) > 0);
        if let Some(generation) = generation {
            inner.retire_or_drop(generation);
        }
        Ok(Unloaded { id: entry.info.id, name: entry.info.name, generation, draining })
    }

    /// Replaces `name`'s weights from `source`, keeping its id: a new generation (new
    /// fingerprint) that new requests get, while running requests finish on the old one, which
    /// keeps its CPU entry and slot until their last release. Same checks as [`Store::load`]; on
    /// failure the old generation stays current.
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
            // A background load of the old source in flight is now stale.
            entry.state = LoadState::Idle;
        }
        self.shared.publish(inner, vec![LoadEvent::Ready { name: name.to_string(), generation }]);
        Ok(generation)
    }
}
