//! What a request holds from the moment it is resolved: a ticket on a load ends with the
//! generation that load read even when the adapter is unloaded or reloaded meanwhile (or with its
//! error), a reference to a generation brings it back into host memory after an unload or an
//! eviction, and an operator's load or reload finds room or waits for it, never failing for want
//! of it. Every pin and record is returned: the tests end on the store's counters. Waits are on
//! channels and events.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{CountingSink, cached, next_event, synthetic, tiny_shapes, with_events};
use multilora_adapter::{LoadOptions, LoraAdapter, ModelShapes};
use multilora_store::{
    AdapterLoader, AdapterRef, FsLoader, LoadEvent, LoadTicket, Loaded, Resolution, Store, StoreBuilder, StoreConfig,
};
use multilora_types::AdapterSource;
use multilora_types::LoraLimits;
use parking_lot::{Condvar, Mutex};

/// `max_loras` 2 and a CPU tier of `max_cpu_loras`, runtime updates on under `root`, two loader
/// threads.
fn config(root: &Path, max_cpu_loras: usize) -> StoreConfig {
    StoreConfig::new("base", tiny_shapes())
        .lora(LoraLimits::slots(2))
        .max_cpu_loras(max_cpu_loras)
        .allow_runtime_updates(true)
        .allowed_root(root)
        .loader_threads(2)
}

/// The real loader, except that a load from a directory named `held…` waits until the gate is
/// open; the test sees how many wait, so it knows a load is in flight without a clock.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<(bool, usize)>, Condvar)>);

impl Gate {
    fn open(&self, open: bool) {
        self.0.0.lock().0 = open;
        self.0.1.notify_all();
    }

    /// Blocks until `n` loads wait at the gate.
    fn until_waiting(&self, n: usize) {
        let mut state = self.0.0.lock();
        self.0.1.wait_while(&mut state, |(_, waiting)| *waiting < n);
    }
}

impl AdapterLoader for Gate {
    fn load(
        &self,
        name: &str,
        source: &AdapterSource,
        shapes: &ModelShapes,
        opts: &LoadOptions,
    ) -> multilora_adapter::Result<LoraAdapter> {
        let held = matches!(source, AdapterSource::Local(dir)
            if dir.file_name().is_some_and(|f| f.to_string_lossy().starts_with("held")));
        if held {
            let mut state = self.0.0.lock();
            state.1 += 1;
            self.0.1.notify_all();
            self.0.1.wait_while(&mut state, |(open, _)| !*open);
            state.1 -= 1;
        }
        FsLoader.load(name, source, shapes, opts)
    }
}

/// `builder` with a [`Gate`] as its loader, closed.
fn gated(builder: StoreBuilder) -> (StoreBuilder, Gate) {
    let gate = Gate::default();
    (builder.loader(gate.clone()), gate)
}

fn ticket(resolution: Resolution) -> LoadTicket {
    match resolution {
        Resolution::Loading(ticket) => ticket,
        other => panic!("expected a load in flight: {other:?}"),
    }
}

fn reference(resolution: Resolution) -> AdapterRef {
    match resolution {
        Resolution::Ready(adapter) => adapter,
        other => panic!("expected an adapter in host memory: {other:?}"),
    }
}

/// Runs a request on `adapter` from admission to its end: it waits, runs in a slot, finishes.
fn serve(store: &Store, adapter: &AdapterRef, sink: &mut CountingSink) -> anyhow::Result<()> {
    let lease = store.admit(adapter).run();
    let slot = store.activate(adapter.generation(), sink)?;
    assert_eq!(sink.slots[&slot], adapter.generation().fingerprint, "written with the weights it holds");
    drop(lease);
    Ok(())
}

#[test]
fn a_ticket_ends_with_what_its_load_read_after_an_unload_or_a_reload() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let (builder, gate) = gated(Store::builder(config(root, 2)));
    let (store, events) = with_events(builder)?;
    let mut sink = CountingSink::default();

    // Unloaded while its load runs: the name is gone for new requests, and the held ticket ends
    // with the generation the load read, which serves it and then leaves.
    store.register("a", synthetic(root, "held-a", 1))?;
    let held = ticket(store.resolve("a")?);
    gate.until_waiting(1);
    assert!(held.poll().is_none(), "still loading");
    store.unload("a")?;
    assert_eq!(store.resolve("a").unwrap_err().kind(), "unknown_adapter");
    gate.open(true);
    let LoadEvent::Superseded { name, generation } = next_event(&events) else { panic!("a was not superseded") };
    assert_eq!(name, "a");
    let adapter = held.poll().expect("ended")?;
    assert_eq!(adapter.generation(), generation);
    assert_eq!(store.metrics().cpu.entries, 0, "a superseded load is cached for no one");
    drop(held);
    serve(&store, &adapter, &mut sink)?;
    drop(adapter);
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu_retired, m.device.entries, m.pending_loads), (0, 0, 0, 0), "{m:?}");

    // Reloaded while its load runs: new requests get the new version at once, the held ticket
    // the one its load read.
    gate.open(false);
    store.register("a", synthetic(root, "held-a1", 2))?;
    let held = ticket(store.resolve("a")?);
    gate.until_waiting(1);
    let new = cached(store.reload_in_place("a", synthetic(root, "a2", 3))?);
    let LoadEvent::Ready { generation, .. } = next_event(&events) else { panic!("the reload failed") };
    assert_eq!(generation, new);
    assert_eq!(reference(store.resolve("a")?).generation(), new);
    gate.open(true);
    let LoadEvent::Superseded { generation: old, .. } = next_event(&events) else { panic!("a1 was not superseded") };
    assert_ne!(old, new);
    let adapter = held.poll().expect("ended")?;
    assert_eq!(adapter.generation(), old);
    drop(held);
    serve(&store, &adapter, &mut sink)?;
    assert_eq!(reference(store.resolve("a")?).generation(), new, "the old generation never became current");
    drop(adapter);
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu_retired, m.pending_loads), (1, 0, 0), "{m:?}");

    // A superseded load that fails ends its tickets with the failure; one nobody holds leaves
    // nothing behind and says nothing.
    gate.open(false);
    store.register("broken", AdapterSource::Local(root.join("held-missing")))?;
    store.register("unheld", synthetic(root, "held-unheld", 4))?;
    let held = ticket(store.resolve("broken")?);
    drop(ticket(store.resolve("unheld")?));
    gate.until_waiting(2);
    store.unload("broken")?;
    store.unload("unheld")?;
    gate.open(true);
    let LoadEvent::Failed { name, error } = next_event(&events) else { panic!("broken did not fail") };
    assert_eq!((name.as_str(), error.kind()), ("broken", "config_missing"));
    let failed = held.poll().expect("ended").unwrap_err();
    assert!(Arc::ptr_eq(&failed, &error));
    drop(held);
    let unheld_done = || store.metrics().loading == 0;
    while !unheld_done() {
        std::thread::yield_now();
    }
    let m = store.metrics();
    assert_eq!((m.pending_loads, m.loading, m.cpu.entries), (0, 0, 1), "{m:?}");
    assert!(events.try_recv().is_err(), "no event for a load nobody held");
    Ok(())
}

#[test]
fn a_resolution_a_runtime_load_overtakes_still_ends_its_tickets() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let resolved = root.join("resolved");
    synthetic(&resolved, "held-found", 1);
    let builder = Store::builder(config(root, 2)).resolver(multilora_store::DirectoryResolver::new(&resolved));
    let (builder, gate) = gated(builder);
    let (store, events) = with_events(builder)?;
    let held = ticket(store.resolve("held-found")?);
    gate.until_waiting(1);
    // The operator loads other weights under the name while the resolver's load runs.
    let loaded = cached(store.load("held-found", synthetic(root, "other", 2))?);
    let LoadEvent::Ready { generation, .. } = next_event(&events) else { panic!("the load failed") };
    assert_eq!(generation, loaded);
    gate.open(true);
    let LoadEvent::Superseded { generation, .. } = next_event(&events) else { panic!("not superseded") };
    let adapter = held.poll().expect("ended")?;
    assert_eq!(adapter.generation(), generation);
    assert_ne!(generation.fingerprint, loaded.fingerprint, "what the resolver's load read");
    assert_ne!(generation.id, loaded.id, "an id of its own, not the name's");
    drop(held);
    serve(&store, &adapter, &mut CountingSink::default())?;
    drop(adapter);
    let m = store.metrics();
    assert_eq!((m.registered, m.cpu.entries, m.cpu_retired, m.pending_loads), (1, 1, 0, 0), "{m:?}");
    Ok(())
}

#[test]
fn a_reference_brings_its_generation_back_after_an_unload_or_an_eviction() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let store = Store::builder(config(root, 2)).startup("a", synthetic(root, "a", 1)).build()?;
    let mut sink = CountingSink::default();

    // Unloaded after it was resolved: the weights live on in the reference, and come back (held
    // outside the capacity, as the generation is not current) for as long as the request runs.
    let adapter = reference(store.resolve("a")?);
    store.unload("a")?;
    assert!(store.adapter(adapter.generation()).is_none());
    let host = store.admit(&adapter);
    assert!(Arc::ptr_eq(&store.adapter(adapter.generation()).unwrap(), adapter.adapter()));
    assert_eq!(store.metrics().cpu_retired, 1);
    let lease = host.run();
    store.activate(adapter.generation(), &mut sink)?;
    let host = lease.preempt();
    assert_eq!((store.metrics().pinned_slots, store.metrics().host_pinned), (0, 1));
    drop(host);
    assert!(store.adapter(adapter.generation()).is_none());
    assert_eq!(store.slot_of(adapter.generation()), None);

    // Evicted after it was resolved: a current generation goes back like a load, into a free or
    // unpinned live entry.
    let b = cached(store.load("b", synthetic(root, "b", 2))?);
    let b_ref = reference(store.resolve("b")?);
    let c = cached(store.load("c", synthetic(root, "c", 3))?);
    let d = cached(store.load("d", synthetic(root, "d", 4))?);
    assert!(store.adapter(b).is_none(), "b was the least recently used");
    serve(&store, &b_ref, &mut sink)?;
    assert_eq!(store.cpu_lru_order(), [d, b], "b is live again, c went");
    assert!(store.adapter(c).is_none());

    // With every live entry pinned it is held outside the capacity while its request runs, and
    // leaves the CPU tier with it.
    let d_ref = reference(store.resolve("d")?);
    let (e, f) = (cached(store.load("e", synthetic(root, "e", 5))?), cached(store.load("f", synthetic(root, "f", 6))?));
    let pins = [store.lease(e)?, store.lease(f)?];
    let host = store.admit(&d_ref);
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu.capacity, m.cpu_retired), (3, 2, 1), "{m:?}");
    drop(host);
    assert!(store.adapter(d).is_none());
    drop(pins);
    let m = store.metrics();
    assert_eq!(
        (m.cpu.entries, m.cpu_retired, m.pinned_slots, m.host_pinned, m.pending_loads),
        (2, 0, 0, 0, 0),
        "{m:?}"
    );
    Ok(())
}

#[test]
fn an_operators_load_and_reload_wait_for_room_instead_of_failing() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let builder =
        Store::builder(config(root, 2)).startup("a", synthetic(root, "a", 1)).startup("b", synthetic(root, "b", 2));
    let (store, events) = with_events(builder)?;
    let (a, b) = (reference(store.resolve("a")?).generation(), reference(store.resolve("b")?).generation());
    let lease_a = store.lease(a)?;
    let lease_b = store.lease(b)?;
    // The reload of a pinned, cached adapter retires the old generation: room at once.
    let a2 = cached(store.reload_in_place("a", synthetic(root, "a2", 5))?);
    let LoadEvent::Ready { generation, .. } = next_event(&events) else { panic!("a2 failed") };
    assert_eq!(generation, a2);
    let lease_a2 = store.lease(a2)?;

    // Every live entry pinned: the load is validated and registered, and waits for room.
    let Loaded::WaitingForRoom(c1) = store.load("c", synthetic(root, "c1", 3))? else { panic!("cached") };
    assert_eq!(store.info("c").map(|i| i.id), Some(c1.id));
    let first = ticket(store.resolve("c")?);
    // Reloaded while it waits: the new version waits in its place, for new requests; the request
    // that resolved the first one keeps it.
    let Loaded::WaitingForRoom(c2) = store.reload_in_place("c", synthetic(root, "c2", 4))? else { panic!("cached") };
    assert_ne!(c1, c2);
    let LoadEvent::Superseded { generation, .. } = next_event(&events) else { panic!("c1 not superseded") };
    assert_eq!(generation, c1);
    assert_eq!(first.poll().expect("ended")?.generation(), c1);
    let second = ticket(store.resolve("c")?);
    assert!(second.poll().is_none());
    assert_eq!(store.metrics().waiting_for_capacity, 1);
    // A bad version is still refused, and changes nothing.
    let err = store.reload_in_place("c", AdapterSource::Local(root.join("nope"))).unwrap_err();
    assert_eq!(err.kind(), "io");
    assert!(second.poll().is_none());

    // Room frees: the waiting version goes in, current, and ends the ticket that waited on it.
    drop(lease_b);
    let LoadEvent::Ready { name, generation } = next_event(&events) else { panic!("c2 failed") };
    assert_eq!((name.as_str(), generation), ("c", c2));
    assert_eq!(second.poll().expect("ended")?.generation(), c2);
    assert_eq!(reference(store.resolve("c")?).generation(), c2);
    drop((first, second, lease_a, lease_a2));
    let m = store.metrics();
    assert_eq!((m.waiting_for_capacity, m.pending_loads, m.capacity_waits, m.cpu_retired), (0, 0, 2, 0), "{m:?}");
    assert_eq!(m.failures.into_iter().collect::<Vec<_>>(), [("io", 1)], "no load failed for want of room");
    assert!(events.try_recv().is_err(), "every event was expected");
    Ok(())
}
