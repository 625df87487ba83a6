//! Host leases, a preempted request's pin: its generation's CPU entry survives tier pressure,
//! reloads and unloads, while its slot stays free for running requests; the last pin of either
//! kind removes a superseded generation, and lets a waiting load in. Waits are on events.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{CountingSink, cached, next_event, synthetic, tiny_shapes, wait_ready, with_events};
use multilora_store::{LoadEvent, Loaded, Resolution, Store, StoreConfig};
use multilora_types::{AdapterGen, LoraLimits};

fn ready(store: &Store, name: &str) -> AdapterGen {
    match store.resolve(name).unwrap() {
        Resolution::Ready(adapter) => adapter.generation(),
        other => panic!("{name} is not ready: {other:?}"),
    }
}

/// `max_loras` slots, `max_cpu_loras` CPU entries, runtime updates on under `root`.
fn config(root: &Path, max_loras: usize, max_cpu_loras: usize) -> StoreConfig {
    StoreConfig::new("base", tiny_shapes())
        .lora(LoraLimits::slots(max_loras))
        .max_cpu_loras(max_cpu_loras)
        .allow_runtime_updates(true)
        .allowed_root(root)
}

/// Waits until `n` finished loads wait for room; the timeout only keeps a broken test from hanging.
fn until_waiting(store: &Store, n: usize) {
    for _ in 0..6000 {
        let m = store.metrics();
        if m.waiting_for_capacity == n {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("never {n} loads waiting for room: {:?}", store.metrics());
}

#[test]
fn a_host_leased_generation_survives_cpu_pressure_but_not_in_its_slot() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let store = Store::builder(config(root, 1, 2))
        .startup("a", synthetic(root, "a", 1))
        .startup("b", synthetic(root, "b", 2))
        .build()?;
    let a = ready(&store, "a");
    let weights = store.adapter(a).unwrap();
    for (i, name) in ["c", "d", "e"].iter().enumerate() {
        store.register(name, synthetic(root, name, 10 + i as u64))?;
    }
    // A request runs on "a" in the only slot, then is preempted: the host lease is taken before
    // the slot lease goes, so the generation is never unheld.
    let mut sink = CountingSink::default();
    let lease = store.lease(a)?;
    let slot = store.activate(a, &mut sink)?;
    let host = store.host_lease(a)?;
    assert_eq!(host.generation(), a);
    drop(lease);
    let m = store.metrics();
    assert_eq!((m.pinned_slots, m.host_pinned), (0, 1));

    // Three loads through a tier of two: each evicts the least recently used entry but "a",
    // which is the least recently used of all.
    let mut others = Vec::new();
    for name in ["c", "d", "e"] {
        assert!(matches!(store.resolve(name)?, Resolution::Loading(_)));
        others.push(wait_ready(&store, name));
        assert_eq!(store.cpu_lru_order()[0], a, "after {name}");
        assert!(Arc::ptr_eq(&store.adapter(a).unwrap(), &weights), "after {name}");
    }
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu.evictions, m.cpu_retired), (2, 3, 0));

    // The host lease pins no slot: running requests of other adapters take it, in turn.
    let e = others[2];
    let e_lease = store.lease(e)?;
    assert_eq!(store.activate(e, &mut sink)?, slot);
    assert_eq!(store.slot_of(a), None);
    assert_eq!(sink.slots[&slot], e.fingerprint);
    drop(e_lease);

    // Resumed: "a" is still leasable, and its slot is written again from its CPU entry.
    let writes = sink.writes;
    let lease = store.lease(a)?;
    drop(host);
    assert_eq!(store.activate(a, &mut sink)?, slot);
    assert_eq!((sink.writes, sink.slots[&slot]), (writes + 1, a.fingerprint));
    drop(lease);
    let m = store.metrics();
    assert_eq!((m.pinned_slots, m.host_pinned), (0, 0));
    // Unheld now, "a" is evictable like any other entry.
    for name in ["d", "c"] {
        store.resolve(name)?;
        wait_ready(&store, name);
    }
    assert!(store.adapter(a).is_none());
    Ok(())
}

#[test]
fn reload_and_unload_retire_a_host_leased_generation() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let store = Store::builder(config(root, 1, 2)).build()?;
    let old = cached(store.load("a", synthetic(root, "a-v1", 1))?);
    let weights = store.adapter(old).unwrap();
    let mut sink = CountingSink::default();
    let lease = store.lease(old)?;
    let slot = store.activate(old, &mut sink)?;
    let host = store.host_lease(old)?;
    drop(lease);

    // Reloaded while preempted: the old generation is retired, not dropped.
    let new = cached(store.reload_in_place("a", synthetic(root, "a-v2", 2))?);
    assert_ne!(new, old);
    assert_eq!(ready(&store, "a"), new);
    assert!(Arc::ptr_eq(&store.adapter(old).unwrap(), &weights));
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu_retired, m.host_pinned), (2, 1, 1));
    // New requests take the slot from the retired generation; resumed, it is written back.
    let new_lease = store.lease(new)?;
    assert_eq!(store.activate(new, &mut sink)?, slot);
    assert_eq!(store.slot_of(old), None);
    drop(new_lease);
    let lease = store.lease(old)?;
    assert_eq!(store.activate(old, &mut sink)?, slot);
    assert_eq!(sink.slots[&slot], old.fingerprint);
    // Preempted again (the slot lease goes first this time): the host lease still holds it.
    drop(lease);
    assert!(store.adapter(old).is_some());
    assert_eq!(store.slot_of(old), Some(slot));
    // The last pin of any kind removes the retired generation from both tiers.
    drop(host);
    assert!(store.adapter(old).is_none());
    assert_eq!(store.slot_of(old), None);
    assert_eq!(store.lease(old).unwrap_err().kind(), "not_ready");
    assert_eq!(store.host_lease(old).unwrap_err().kind(), "not_ready");
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu_retired, m.device.entries, m.host_pinned), (1, 0, 0, 0));

    // Unloaded while preempted, and never in a slot: retired, leasable, gone with its last pin.
    let b = cached(store.load("b", synthetic(root, "b", 3))?);
    let host = store.host_lease(b)?;
    let unloaded = store.unload("b")?;
    assert_eq!((unloaded.generation, unloaded.draining), (Some(b), true));
    assert_eq!(store.resolve("b").unwrap_err().kind(), "unknown_adapter");
    assert!(store.adapter(b).is_some());
    let lease = store.lease(b)?;
    let b_slot = store.activate(b, &mut sink)?;
    assert_eq!(store.metrics().cpu_retired, 1);
    // The slot lease goes while the host lease holds it: nothing leaves.
    let second = store.host_lease(b)?;
    drop(lease);
    drop(host);
    assert!(store.adapter(b).is_some());
    assert_eq!(store.slot_of(b), Some(b_slot));
    drop(second);
    assert!(store.adapter(b).is_none());
    assert_eq!(store.slot_of(b), None);
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu_retired, m.device.entries), (1, 0, 0));
    Ok(())
}

#[test]
fn dropping_the_last_host_lease_admits_a_waiting_load() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let builder =
        Store::builder(config(root, 2, 2)).startup("a", synthetic(root, "a", 1)).startup("b", synthetic(root, "b", 2));
    let (store, events) = with_events(builder)?;
    let (a, b) = (ready(&store, "a"), ready(&store, "b"));
    store.register("c", synthetic(root, "c", 3))?;
    store.register("d", synthetic(root, "d", 4))?;

    // Both entries held by preempted requests only: "c" loads, then waits for room.
    let host_a = store.host_lease(a)?;
    let host_b = store.host_lease(b)?;
    assert!(matches!(store.resolve("c")?, Resolution::Loading(_)));
    until_waiting(&store, 1);
    assert!(matches!(store.resolve("c")?, Resolution::Loading(_)));
    assert!(events.try_recv().is_err(), "no event while it waits");
    // A runtime load finds no room either: it is registered and waits too, evicting nothing
    // (unloaded here, it leaves the queue).
    assert!(matches!(store.load("z", synthetic(root, "z", 9))?, Loaded::WaitingForRoom(_)));
    assert_eq!(store.cpu_lru_order(), [a, b]);
    assert_eq!(store.metrics().waiting_for_capacity, 2);
    store.unload("z")?;
    assert_eq!(store.metrics().waiting_for_capacity, 1);
    // The last host lease on "a" is dropped: "c" takes its entry, and its Ready event is sent.
    drop(host_a);
    let LoadEvent::Ready { name, generation: c } = next_event(&events) else { panic!("c failed") };
    assert_eq!((name.as_str(), ready(&store, "c")), ("c", c));
    assert!(store.adapter(a).is_none());
    assert_eq!(store.cpu_lru_order(), [b, c]);

    // "b" held by a host lease and a slot lease, "c" by a running request: "d" waits until the
    // last of b's pins, of either kind, is gone.
    let lease_b = store.lease(b)?;
    let lease_c = store.lease(c)?;
    assert!(matches!(store.resolve("d")?, Resolution::Loading(_)));
    until_waiting(&store, 1);
    drop(host_b);
    assert!(events.try_recv().is_err(), "b's slot lease still holds it");
    assert_eq!(store.metrics().waiting_for_capacity, 1);
    drop(lease_b);
    let LoadEvent::Ready { name, generation: d } = next_event(&events) else { panic!("d failed") };
    assert_eq!((name.as_str(), ready(&store, "d")), ("d", d));
    assert!(store.adapter(b).is_none());
    drop(lease_c);
    let m = store.metrics();
    assert_eq!((m.capacity_waits, m.waiting_for_capacity, m.host_pinned, m.pending_loads), (3, 0, 0, 0));
    // Waiting for room is no failure, a runtime load's included.
    assert!(m.failures.is_empty(), "{:?}", m.failures);
    Ok(())
}
