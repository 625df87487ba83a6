//! `Store`: the registry and the two tiers behind one lock, the loader pool, and the calls the
//! engine makes (resolve a name once per request, admit, pin, host-pin, activate; pins are
//! released by dropping them). Lifecycle calls are in `lifecycle.rs`.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lru::LruCache;
use multilora_adapter::{LoadOptions, LoraAdapter, SlotSink};
use multilora_types::AdapterSource;
use multilora_types::{Resolver, SlotId};
use parking_lot::{Condvar, Mutex};

use crate::backoff::Failure;
use crate::config::StoreConfig;
use crate::cpu_tier::{CpuTier, TierFull};
use crate::error::{Error, Result};
use crate::host_lease::HostLease;
use crate::lease::SlotLease;
use crate::loader::{AdapterLoader, FsLoader, LoaderPool};
use crate::metrics::{Counters, StoreMetrics, TierMetrics};
use crate::registry::{AdapterInfo, LoadState, Registry, validate_name};
use crate::slots::{AllPinned, PinKind, Placement, SlotTable};
use crate::status::{LoadEvent, Resolution};
use crate::ticket::{AdapterRef, LoadTicket, Pending};
use crate::waiting::Waiting;
use multilora_types::{AdapterGen, AdapterId};

/// How many failed resolutions of unknown names are remembered (so waiters see the failure, and
/// the name is asked again only after its back-off) before the oldest is forgotten; bounded
/// because the names come from clients.
const RESOLVE_FAILURES_KEPT: usize = 1024;

/// The tiered adapter store. `Send + Sync`: the engine loop, HTTP handlers and the loader threads
/// share it. Every call takes one short lock; none holds it during file I/O, so a load never
/// blocks `activate`, `resolve` or `lease` of other adapters.
pub struct Store {
    pub(crate) shared: Arc<Shared>,
    pool: LoaderPool,
}

/// What the loader threads share with the store.
pub(crate) struct Shared {
    pub(crate) config: StoreConfig,
    pub(crate) opts: LoadOptions,
    pub(crate) loader: Arc<dyn AdapterLoader>,
    pub(crate) resolvers: Vec<Arc<dyn Resolver>>,
    sink: Option<EventSink>,
    pub(crate) state: Mutex<Inner>,
    events_ready: Condvar,
    pub(crate) shutdown: AtomicBool,
}

/// Everything under the lock.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) registry: Registry,
    pub(crate) cpu: CpuTier,
    pub(crate) slots: SlotTable,
    pub(crate) counters: Counters,
    /// Unknown names being resolved, with their job's ticket.
    pub(crate) resolving: HashMap<String, u64>,
    pub(crate) resolve_failures: LruCache<String, Failure>,
    /// Finished loads waiting for a CPU entry to unpin, oldest first.
    pub(crate) waiting: VecDeque<Waiting>,
    /// Each load's record for the tickets that hold it, by ticket number.
    pub(crate) pending: HashMap<u64, Pending>,
    pub(crate) events: Vec<LoadEvent>,
    pub(crate) next_ticket: u64,
    pub(crate) loading: usize,
}

/// A load for a loader thread.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) name: String,
    pub(crate) ticket: u64,
    pub(crate) kind: JobKind,
}

#[derive(Debug)]
pub(crate) enum JobKind {
    /// A registered adapter not in the CPU tier.
    Registered { id: AdapterId, source: AdapterSource },
    /// An unknown name: ask the resolvers, then load and register.
    Resolve,
}

/// Builds a [`Store`]: `Store::builder(config).startup("sql", source).build()?`.
pub struct StoreBuilder {
    config: StoreConfig,
    loader: Arc<dyn AdapterLoader>,
    resolvers: Vec<Arc<dyn Resolver>>,
    startup: Vec<(String, AdapterSource)>,
    sink: Option<EventSink>,
}

/// Where load events go when the store is built with [`StoreBuilder::events`].
type EventSink = Box<dyn Fn(LoadEvent) + Send + Sync>;

impl std::fmt::Debug for StoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("config", &self.config)
            .field("resolvers", &self.resolvers.len())
            .field("startup", &self.startup)
            .finish_non_exhaustive()
    }
}

impl StoreBuilder {
    /// Replaces the loader ([`FsLoader`] by default).
    pub fn loader(mut self, loader: impl AdapterLoader + 'static) -> StoreBuilder {
        self.loader = Arc::new(loader);
        self
    }

    /// Adds a resolver, asked after those added before it. Used only with runtime updates on.
    pub fn resolver(mut self, resolver: impl Resolver + 'static) -> StoreBuilder {
        self.resolvers.push(Arc::new(resolver));
        self
    }

    /// An adapter the operator names at start: trusted (not confined to the allowed roots), and
    /// loaded into the CPU tier by [`StoreBuilder::build`], so its first request does not wait.
    pub fn startup(mut self, name: impl Into<String>, source: AdapterSource) -> StoreBuilder {
        self.startup.push((name.into(), source));
        self
    }

    /// Hands every load event to `sink` (on the thread that finished the load) instead of
    /// queueing it for [`Store::poll_completed`]: the engine sends them down its command channel,
    /// the one channel its loop drains every iteration. `sink` must not block.
    pub fn events(mut self, sink: impl Fn(LoadEvent) + Send + Sync + 'static) -> StoreBuilder {
        self.sink = Some(Box::new(sink));
        self
    }

    /// Checks the config, loads the startup adapters (failing on the first that does not
    /// validate), and starts the loader threads.
    pub fn build(self) -> Result<Store> {
        self.config.validate()?;
        let inner = Inner {
            registry: Registry::new(self.config.base_model_name.clone()),
            cpu: CpuTier::new(self.config.max_cpu_loras),
            slots: SlotTable::new(self.config.lora.max_loras()),
            counters: Counters::default(),
            resolving: HashMap::new(),
            resolve_failures: LruCache::new(NonZeroUsize::new(RESOLVE_FAILURES_KEPT).unwrap_or(NonZeroUsize::MIN)),
            waiting: VecDeque::new(),
            pending: HashMap::new(),
            events: Vec::new(),
            next_ticket: 0,
            loading: 0,
        };
        let shared = Arc::new(Shared {
            opts: self.config.load_options(),
            config: self.config,
            loader: self.loader,
            resolvers: self.resolvers,
            sink: self.sink,
            state: Mutex::new(inner),
            events_ready: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        for (name, src) in self.startup {
            shared.add_loaded(&name, src).map_err(|e| Error::Startup { name, source: Box::new(e) })?;
        }
        let pool = LoaderPool::new(shared.config.loader_threads)?;
        Ok(Store { shared, pool })
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("config", &self.shared.config)
            .field("metrics", &self.metrics())
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Queued loads are skipped; the one in hand finishes, then the pool joins its threads.
        self.shared.shutdown.store(true, Ordering::SeqCst);
    }
}

impl Store {
    /// A builder with the default loader, no resolvers and no startup adapters.
    pub fn builder(config: StoreConfig) -> StoreBuilder {
        StoreBuilder { config, loader: Arc::new(FsLoader), resolvers: Vec::new(), startup: Vec::new(), sink: None }
    }

    /// A store with the default loader, loading `startup` adapters (trusted) before returning.
    pub fn new(config: StoreConfig, startup: Vec<(String, AdapterSource)>) -> Result<Store> {
        startup.into_iter().fold(Store::builder(config), |b, (name, source)| b.startup(name, source)).build()
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.shared.config
    }

    /// Registers an adapter the operator names, without reading it: it loads on first request.
    /// Trusted like a startup adapter (not confined); not for names or paths from clients.
    pub fn register(&self, name: &str, source: AdapterSource) -> Result<AdapterId> {
        self.shared.state.lock().registry.register(name, source)
    }

    /// The one place a name is resolved: what a request for `name` holds from the moment it is
    /// accepted, returning at once. [`Resolution::Ready`] when the current generation is in host
    /// memory (a CPU hit), [`Resolution::Loading`] when a load of it is queued, running, or waiting
    /// for a CPU entry to unpin (one per adapter however many ask; this call starts it when there
    /// is none, a CPU miss), or [`Resolution::Failed`] within the back-off of its last failed
    /// load (after it, this call loads again). A name with a load pending (a reload waiting for
    /// room included) resolves to that load. An unknown name is asked of the resolvers when
    /// runtime updates are on, and is otherwise [`Error::UnknownAdapter`].
    pub fn resolve(&self, name: &str) -> Result<Resolution> {
        let (job, ticket) = {
            let mut guard = self.shared.state.lock();
            let inner = &mut *guard;
            match inner.registry.id(name) {
                Some(id) => {
                    let Some(entry) = inner.registry.get(id) else {
                        return Err(Error::UnknownAdapter { name: name.to_string() });
                    };
                    // A pending load first: a reload waiting for room is what new requests get,
                    // even while the generation it replaces is still held in host memory.
                    if let LoadState::Loading(t) = entry.state {
                        return Ok(Resolution::Loading(LoadTicket::hold(&self.shared, inner, t, name)));
                    }
                    if let Some(generation) = inner.registry.current(id)
                        && let Some(adapter) = inner.cpu.get(&generation)
                    {
                        inner.counters.cpu_hits += 1;
                        return Ok(Resolution::Ready(AdapterRef::new(generation, adapter)));
                    }
                    if let Some(entry) = inner.registry.get(id)
                        && let LoadState::Failed(f) = &entry.state
                        && f.backing_off(Instant::now())
                    {
                        return Ok(Resolution::Failed(Arc::clone(&f.error)));
                    }
                    // Not in host memory, or its last load failed and the back-off is over: load.
                    let ticket = inner.start_job();
                    let Some(entry) = inner.registry.get_mut(id) else {
                        return Err(Error::UnknownAdapter { name: name.to_string() });
                    };
                    entry.state = LoadState::Loading(ticket);
                    let source = entry.info.source.clone();
                    let held = LoadTicket::hold(&self.shared, inner, ticket, name);
                    (Job { name: name.to_string(), ticket, kind: JobKind::Registered { id, source } }, held)
                }
                None => {
                    validate_name(name, &self.shared.config.base_model_name)?;
                    if !self.shared.config.allow_runtime_updates || self.shared.resolvers.is_empty() {
                        return Err(Error::UnknownAdapter { name: name.to_string() });
                    }
                    if let Some(&t) = inner.resolving.get(name) {
                        return Ok(Resolution::Loading(LoadTicket::hold(&self.shared, inner, t, name)));
                    }
                    // A failure is kept after its back-off, while the name is asked again, so
                    // that the next failure's back-off doubles.
                    if let Some(f) = inner.resolve_failures.get(name)
                        && f.backing_off(Instant::now())
                    {
                        return Ok(Resolution::Failed(Arc::clone(&f.error)));
                    }
                    let ticket = inner.start_job();
                    inner.resolving.insert(name.to_string(), ticket);
                    let held = LoadTicket::hold(&self.shared, inner, ticket, name);
                    (Job { name: name.to_string(), ticket, kind: JobKind::Resolve }, held)
                }
            }
        };
        let shared = Arc::clone(&self.shared);
        if self.pool.submit(Box::new(move || shared.run(job))) {
            return Ok(Resolution::Loading(ticket));
        }
        // The pool is shutting down: the job never runs, so it is ended here.
        let error = Error::Shutdown { name: name.to_string() };
        let mut inner = self.shared.state.lock();
        inner.abandon_job(name, ticket.number(), Arc::new(Error::Shutdown { name: name.to_string() }));
        drop(inner);
        Err(error)
    }

    /// A request's admission: a host pin ([`HostLease`]) on the generation it holds, put back in
    /// the CPU tier from the weights `adapter` keeps if it left (an eviction, or an unload or
    /// reload that dropped it) — no file is read. A current generation goes in as any load does
    /// (evicting the least recently used unpinned entry when the tier is full); a superseded one,
    /// or a current one while every entry is pinned, is held outside the capacity like a retired
    /// generation, until its last pin is dropped.
    pub fn admit(&self, adapter: &AdapterRef) -> HostLease {
        let generation = adapter.generation();
        let mut guard = self.shared.state.lock();
        let inner = &mut *guard;
        if !inner.cpu.contains(&generation) {
            let weights = Arc::clone(adapter.adapter());
            let current = inner.registry.current(generation.id) == Some(generation);
            let slots = &inner.slots;
            let outside = if current && inner.cpu.has_room(&generation, None, |g| slots.keeps_cpu(g)) {
                match inner.cpu.insert(generation, Arc::clone(&weights), |g| slots.keeps_cpu(g)) {
                    Ok(evicted) => {
                        inner.counters.cpu_evictions += u64::from(evicted.is_some());
                        false
                    }
                    Err(TierFull) => true,
                }
            } else {
                true
            };
            if outside {
                inner.cpu.hold_outside(generation, weights);
            }
        }
        inner.slots.pin(generation, PinKind::Host);
        HostLease::pinned(&self.shared, generation)
    }

    /// Forgets a failure of `name` before its back-off ends, so that the next `resolve` loads
    /// it again at once.
    pub fn retry(&self, name: &str) {
        let mut inner = self.shared.state.lock();
        inner.resolve_failures.pop(name);
        if let Some(id) = inner.registry.id(name)
            && let Some(entry) = inner.registry.get_mut(id)
            && matches!(entry.state, LoadState::Failed(_))
        {
            entry.state = LoadState::Idle;
        }
    }

    /// The background loads completed since the last call (or `wait_completed`), oldest first;
    /// always empty for a store built with [`StoreBuilder::events`], whose events go to the sink.
    pub fn poll_completed(&self) -> Vec<LoadEvent> {
        std::mem::take(&mut self.shared.state.lock().events)
    }

    /// Like [`Store::poll_completed`], but waits up to `timeout` for at least one event.
    pub fn wait_completed(&self, timeout: Duration) -> Vec<LoadEvent> {
        let mut inner = self.shared.state.lock();
        self.shared.events_ready.wait_while_for(&mut inner, |inner| inner.events.is_empty(), timeout);
        std::mem::take(&mut inner.events)
    }

    /// The current generation of `name`, once loaded.
    pub fn generation(&self, name: &str) -> Option<AdapterGen> {
        let inner = self.shared.state.lock();
        inner.registry.id(name).and_then(|id| inner.registry.current(id))
    }

    /// The loaded adapter of `generation` (current or retired), without touching the LRU order.
    pub fn adapter(&self, generation: AdapterGen) -> Option<Arc<LoraAdapter>> {
        self.shared.state.lock().cpu.peek(&generation).cloned()
    }

    /// What the registry knows about `name`.
    pub fn info(&self, name: &str) -> Option<AdapterInfo> {
        self.shared.state.lock().registry.by_name(name).map(|e| e.info.clone())
    }

    /// Every registered adapter, in registration order.
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        self.shared.state.lock().registry.infos()
    }

    /// What the resolvers offer that nobody registered yet, first resolver first for a name that
    /// several offer (the order `resolve` asks them in), with the source each would load: none
    /// unless runtime updates are on, the only time resolvers are asked. Names `resolve` would
    /// refuse are left out. Lists a directory, so it runs off any async thread. The errors of
    /// resolvers whose listing failed come second: every other resolver is still listed.
    pub fn offered(&self) -> (Vec<(String, AdapterSource)>, Vec<Error>) {
        let config = &self.shared.config;
        if !config.allow_runtime_updates {
            return (Vec::new(), Vec::new());
        }
        let (mut out, mut errors) = (Vec::new(), Vec::new());
        for resolver in &self.shared.resolvers {
            match resolver.offered() {
                // An embedder's resolver may list more than the built-in ones would.
                Ok(list) => out.extend(list.into_iter().take(crate::resolver::MAX_OFFERED)),
                Err(e) => errors.push(crate::resolver::resolver_error("(listing)", e)),
            }
        }
        let registered: std::collections::HashSet<String> =
            self.shared.state.lock().registry.infos().into_iter().map(|i| i.name).collect();
        let mut seen = std::collections::HashSet::new();
        out.retain(|(name, _)| {
            validate_name(name, &config.base_model_name).is_ok()
                && !registered.contains(name)
                && seen.insert(name.clone())
        });
        (out, errors)
    }

    /// A running request's pin on `generation`, which must be in host memory or a slot: its slot,
    /// once it has one, is not evicted and its CPU entry stays while the lease lives. Dropping
    /// the last lease of a generation that was superseded or unloaded removes it from both tiers.
    pub fn lease(&self, generation: AdapterGen) -> Result<SlotLease> {
        SlotLease::new(&self.shared, generation)
    }

    /// A preempted request's pin on `generation`, with the same rule as [`Store::lease`]
    /// ([`Error::NotReady`] unless it is in host memory or a slot): while the host lease lives,
    /// the generation's CPU entry is never evicted and a reload or unload retires it rather than
    /// dropping it, but its slot is not pinned (it may be evicted; [`Store::activate`] writes it
    /// again from the CPU entry). Take it before dropping the request's [`SlotLease`], so the
    /// generation is never unheld; dropping the last pin of either kind on a superseded or
    /// unloaded generation removes it from both tiers.
    pub fn host_lease(&self, generation: AdapterGen) -> Result<HostLease> {
        HostLease::new(&self.shared, generation)
    }

    /// The operator's pin (vLLM's `pin_adapter`): `name`'s current generation is never evicted
    /// from the CPU tier, nor from its slot once activated; it moves to the new generation on a
    /// reload. The adapter must be loaded.
    pub fn pin_adapter(&self, name: &str) -> Result<AdapterGen> {
        let mut guard = self.shared.state.lock();
        let inner = &mut *guard;
        let id = inner.registry.id(name).ok_or_else(|| Error::UnknownAdapter { name: name.to_string() })?;
        let generation = inner
            .registry
            .current(id)
            .filter(|g| inner.cpu.contains(g) || inner.slots.slot_of(g).is_some())
            .ok_or_else(|| Error::NotReady { name: name.to_string() })?;
        if let Some(entry) = inner.registry.get_mut(id) {
            entry.info.operator_pinned = true;
        }
        inner.slots.set_operator_pin(generation, true);
        Ok(generation)
    }

    /// Clears the operator's pin on `name`.
    pub fn unpin_adapter(&self, name: &str) -> Result<()> {
        let mut guard = self.shared.state.lock();
        let inner = &mut *guard;
        let id = inner.registry.id(name).ok_or_else(|| Error::UnknownAdapter { name: name.to_string() })?;
        if let Some(generation) = inner.registry.current(id) {
            inner.slots.set_operator_pin(generation, false);
        }
        if let Some(entry) = inner.registry.get_mut(id) {
            entry.info.operator_pinned = false;
        }
        // Its entry may be unpinned now: a load waiting for room may go in.
        let events = inner.admit_waiting();
        self.shared.publish(guard, events);
        Ok(())
    }

    /// Puts `generation` in a device slot and returns the slot: its own if resident (marked most
    /// recently used), else a free slot, else the least recently used slot without pins,
    /// written through `sink`. [`Error::AllSlotsPinned`] when every slot is pinned;
    /// [`Error::NotReady`] when `generation` is not in the CPU tier.
    ///
    /// The lock is held while `sink` copies (a device copy, never file I/O), so a slot's contents
    /// and its entry in the table change together.
    pub fn activate(&self, generation: AdapterGen, sink: &mut dyn SlotSink) -> Result<SlotId> {
        let mut guard = self.shared.state.lock();
        let inner = &mut *guard;
        if let Some(slot) = inner.slots.slot_of(&generation) {
            inner.slots.place(generation, 0).ok();
            inner.cpu.get(&generation);
            inner.counters.device_hits += 1;
            return Ok(SlotId::new(slot));
        }
        let Some(adapter) = inner.cpu.get(&generation) else {
            return Err(Error::NotReady { name: inner.name_of(generation.id) });
        };
        let bytes = adapter
            .nbytes_at_rank(self.shared.config.lora.max_lora_rank(), self.shared.config.lora_dtype.size_in_bytes());
        let placement = inner.slots.place(generation, bytes).map_err(|AllPinned| Error::AllSlotsPinned {
            name: adapter.name().to_string(),
            max_loras: self.shared.config.lora.max_loras(),
        })?;
        let slot = match placement {
            Placement::Resident(slot) | Placement::Free(slot) => slot,
            Placement::Evict { slot, .. } => {
                inner.counters.device_evictions += 1;
                slot
            }
        };
        inner.counters.device_misses += 1;
        if let Err(e) = sink.write_slot(SlotId::new(slot), &adapter) {
            // The slot's old contents are gone and the new ones incomplete: it is free now.
            inner.slots.vacate(slot);
            inner.counters.failure(e.kind());
            return Err(Error::Adapter(e));
        }
        Ok(SlotId::new(slot))
    }

    /// The slot `generation` occupies, if any.
    pub fn slot_of(&self, generation: AdapterGen) -> Option<SlotId> {
        self.shared.state.lock().slots.slot_of(&generation).map(SlotId::new)
    }

    /// `(slot, generation)` of every occupied slot.
    pub fn resident_slots(&self) -> Vec<(SlotId, AdapterGen)> {
        self.shared.state.lock().slots.resident().into_iter().map(|(slot, g)| (SlotId::new(slot), g)).collect()
    }

    /// Loads waiting now for a CPU-tier entry to be unpinned (cheap: one lock, no copies).
    pub fn loads_waiting(&self) -> usize {
        self.shared.state.lock().waiting.len()
    }

    /// A snapshot of occupancy, traffic, load times and failures.
    pub fn metrics(&self) -> StoreMetrics {
        let inner = self.shared.state.lock();
        let c = &inner.counters;
        StoreMetrics {
            registered: inner.registry.len(),
            cpu: TierMetrics {
                entries: inner.cpu.live_len() + inner.cpu.retired_len(),
                capacity: inner.cpu.capacity(),
                bytes: inner.cpu.bytes(),
                hits: c.cpu_hits,
                misses: c.cpu_misses,
                evictions: c.cpu_evictions,
            },
            cpu_retired: inner.cpu.retired_len(),
            device: TierMetrics {
                entries: inner.slots.occupied(),
                capacity: inner.slots.len(),
                bytes: inner.slots.bytes(),
                hits: c.device_hits,
                misses: c.device_misses,
                evictions: c.device_evictions,
            },
            pinned_slots: inner.slots.pinned_slots(),
            host_pinned: inner.slots.host_pinned(),
            loading: inner.loading,
            waiting_for_capacity: inner.waiting.len(),
            pending_loads: inner.pending_loads(),
            capacity_waits: c.capacity_waits,
            events_pending: inner.events.len(),
            loads: c.loads,
            load_time: c.load_time.clone(),
            failures: c.failures.clone(),
        }
    }

    /// Live CPU-tier generations, least recently used first.
    pub fn cpu_lru_order(&self) -> Vec<AdapterGen> {
        self.shared.state.lock().cpu.lru_order()
    }

    /// Resident generations, least recently used first.
    pub fn slot_lru_order(&self) -> Vec<AdapterGen> {
        self.shared.state.lock().slots.lru_order()
    }
}

impl Inner {
    /// A new load on a loader thread: its ticket, its pending record, one CPU miss.
    fn start_job(&mut self) -> u64 {
        let ticket = self.new_ticket();
        self.loading += 1;
        self.counters.cpu_misses += 1;
        ticket
    }

    /// A fresh ticket number with its pending record open.
    pub(crate) fn new_ticket(&mut self) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.open_ticket(ticket);
        ticket
    }

    /// A job that will never run (the pool is shutting down): its load ends with `error`.
    fn abandon_job(&mut self, name: &str, ticket: u64, error: Arc<Error>) {
        self.loading -= 1;
        if self.resolving.get(name) == Some(&ticket) {
            self.resolving.remove(name);
        }
        if let Some(id) = self.registry.id(name)
            && let Some(entry) = self.registry.get_mut(id)
            && matches!(entry.state, LoadState::Loading(t) if t == ticket)
        {
            entry.state = LoadState::Idle;
        }
        self.settle(ticket, Err(error));
    }

    /// A name for messages about `id`, which may have been unloaded.
    pub(crate) fn name_of(&self, id: AdapterId) -> String {
        self.registry.name_of(id).map_or_else(|| format!("#{}", id.0), str::to_string)
    }
}

impl Shared {
    /// Hands `events` to the sink, or queues them and wakes whoever waits for them.
    pub(crate) fn publish(&self, mut inner: parking_lot::MutexGuard<'_, Inner>, events: Vec<LoadEvent>) {
        if events.is_empty() {
            return;
        }
        match &self.sink {
            Some(sink) => {
                drop(inner);
                events.into_iter().for_each(sink);
            }
            None => {
                inner.events.extend(events);
                drop(inner);
                self.events_ready.notify_all();
            }
        }
    }
}
