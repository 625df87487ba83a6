//! Faults that must neither stick nor swap in (the hostile-input issue): a failed reload leaves
//! the old generation serving, an adapter without slot buffers is refused before it is
//! registered, a load that finds every CPU entry pinned waits instead of failing, a failed load
//! is retried after a back-off, and a leased generation outlives reloads and tier pressure.
//! Waits are on events and channels; sleeps only ever outlast a back-off of a few milliseconds.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{
    CountingLoader, CountingSink, cached, next_event, synthetic, tiny_shapes, wait_for, wait_ready, with_events,
};
use multilora_adapter::SyntheticAdapter;
use multilora_store::{DirectoryResolver, Error, LoadEvent, Resolution, Store, StoreConfig};
use multilora_types::AdapterSource;
use multilora_types::{AdapterGen, LoraLimits, ModuleKind};

/// Long enough that no test outlives it: within it, a failure is answered from memory.
const FOREVER: Duration = Duration::from_secs(3600);

fn ready(store: &Store, name: &str) -> AdapterGen {
    match store.resolve(name).unwrap() {
        Resolution::Ready(adapter) => adapter.generation(),
        other => panic!("{name} is not ready: {other:?}"),
    }
}

/// Writes a synthetic adapter of `rank` on `targets` under `root/name`.
fn synth(root: &Path, name: &str, rank: usize, targets: &[ModuleKind], seed: u64) -> AdapterSource {
    let dir = root.join(name);
    SyntheticAdapter::new(rank, targets, seed).write(&dir, &tiny_shapes()).unwrap();
    AdapterSource::Local(dir)
}

/// Runtime updates on under `root`, `max_loras` 2 on q_proj and v_proj only.
fn qv_config(root: &Path, max_cpu_loras: usize) -> StoreConfig {
    let limits = LoraLimits::new(2, 16, &[ModuleKind::QProj, ModuleKind::VProj]).unwrap();
    StoreConfig::new("base", tiny_shapes())
        .lora(limits)
        .max_cpu_loras(max_cpu_loras)
        .allow_runtime_updates(true)
        .allowed_root(root)
}

/// Waits until `n` finished loads wait for room; the timeout only keeps a broken test from hanging.
fn until_waiting(store: &Store, n: usize) {
    for _ in 0..6000 {
        let m = store.metrics();
        assert!(m.failures.is_empty(), "a load failed instead of waiting: {:?}", m.failures);
        if m.waiting_for_capacity == n {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("never {n} loads waiting for room: {:?}", store.metrics());
}

#[test]
fn a_failed_reload_keeps_the_old_generation_serving() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = Store::builder(qv_config(tmp.path(), 2)).build()?;
    let qv = [ModuleKind::QProj, ModuleKind::VProj];
    let old = cached(store.load("a", synth(tmp.path(), "a-v1", 4, &qv, 1))?);
    let weights = store.adapter(old).unwrap();
    let lease = store.lease(old)?;
    let mut sink = CountingSink::default();
    let slot = store.activate(old, &mut sink)?;

    // A new version that targets k_proj, which has no slot buffers; one whose rank exceeds the
    // slots'; one that is not an adapter at all.
    let k = synth(tmp.path(), "a-k", 4, &[ModuleKind::QProj, ModuleKind::KProj], 2);
    let big = synth(tmp.path(), "a-big", 32, &qv, 3);
    std::fs::create_dir_all(tmp.path().join("empty"))?;
    let empty = AdapterSource::Local(tmp.path().join("empty"));
    for (source, kind) in [(k, "not_a_target"), (big, "rank_too_large"), (empty, "config_missing")] {
        let err = store.reload_in_place("a", source).unwrap_err();
        assert_eq!(err.kind(), kind, "{err}");
        assert_eq!(store.generation("a"), Some(old), "{err}");
        assert_eq!(ready(&store, "a"), old, "{err}");
        assert!(Arc::ptr_eq(&store.adapter(old).unwrap(), &weights));
        assert_eq!(store.info("a").unwrap().target_modules, qv);
    }
    let err = store.reload_in_place("a", synth(tmp.path(), "a-k2", 4, &[ModuleKind::KProj], 4)).unwrap_err();
    assert!(
        matches!(&err, Error::UntargetedModules { name, modules } if name == "a" && modules == &[ModuleKind::KProj])
    );
    assert!(err.to_string().contains("\"a\"") && err.to_string().contains("k_proj"), "{err}");
    // The old generation keeps its slot and serves new requests; nothing was retired.
    assert_eq!(store.activate(old, &mut sink)?, slot);
    assert_eq!((sink.writes, store.metrics().cpu_retired), (1, 0));
    drop(lease);
    assert_eq!(ready(&store, "a"), old);
    assert!(store.adapter(old).is_some());
    assert_eq!(store.metrics().failures.get("not_a_target"), Some(&2));
    // A good new version still swaps in.
    assert_ne!(cached(store.reload_in_place("a", synth(tmp.path(), "a-v2", 4, &qv, 5))?), old);
    Ok(())
}

#[test]
fn an_adapter_without_slot_buffers_is_refused_before_it_is_registered() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let qk = [ModuleKind::QProj, ModuleKind::KProj];
    let resolved = root.join("resolved");
    synth(&resolved, "found", 4, &qk, 1);
    let store = Store::builder(qv_config(root, 2)).resolver(DirectoryResolver::new(&resolved)).build()?;

    // A runtime load: refused, and nothing registered or cached.
    let err = store.load("x", synth(root, "x", 4, &qk, 2)).unwrap_err();
    assert_eq!(err.kind(), "not_a_target");
    assert!(err.to_string().contains("\"x\"") && err.to_string().contains("k_proj"), "{err}");
    assert!(store.info("x").is_none());
    // A registered adapter's background load fails with it.
    store.register("lazy", synth(root, "lazy", 4, &qk, 3))?;
    assert!(matches!(store.resolve("lazy")?, Resolution::Loading(_)));
    let LoadEvent::Failed { error, .. } = wait_for(&store, "lazy") else { panic!("lazy loaded") };
    assert_eq!(error.kind(), "not_a_target");
    assert!(matches!(store.resolve("lazy")?, Resolution::Failed(_)));
    // A resolver's answer is refused too, and the name stays unregistered.
    assert!(matches!(store.resolve("found")?, Resolution::Loading(_)));
    let LoadEvent::Failed { error, .. } = wait_for(&store, "found") else { panic!("found loaded") };
    assert_eq!(error.kind(), "not_a_target");
    assert!(store.info("found").is_none());
    let m = store.metrics();
    assert_eq!((m.registered, m.cpu.entries, m.loads), (1, 0, 0));
    assert_eq!(m.failures.get("not_a_target"), Some(&3));
    // An adapter on the slotted modules only is served.
    cached(store.load("ok", synth(root, "ok", 4, &[ModuleKind::VProj], 4))?);

    // A start-up adapter is refused alike, naming itself.
    let err = Store::builder(qv_config(root, 2)).startup("s", synth(root, "s", 4, &qk, 5)).build().unwrap_err();
    assert_eq!(err.kind(), "not_a_target");
    assert!(err.to_string().contains("\"s\""), "{err}");
    Ok(())
}

#[test]
fn a_load_waits_for_a_pinned_cpu_tier_instead_of_failing() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let resolved = root.join("resolved");
    synthetic(&resolved, "found", 9);
    let builder = Store::builder(qv_config(root, 2))
        .resolver(DirectoryResolver::new(&resolved))
        .startup("a", synthetic(root, "a", 1))
        .startup("b", synthetic(root, "b", 2));
    let (store, events) = with_events(builder)?;
    let (a, b) = (ready(&store, "a"), ready(&store, "b"));
    store.register("c", synthetic(root, "c", 3))?;
    store.register("d", synthetic(root, "d", 4))?;

    // Both entries pinned by running requests: "c" loads, then waits for room, still loading.
    let lease_a = store.lease(a)?;
    let lease_b = store.lease(b)?;
    assert!(matches!(store.resolve("c")?, Resolution::Loading(_)));
    until_waiting(&store, 1);
    for _ in 0..10 {
        assert!(matches!(store.resolve("c")?, Resolution::Loading(_)));
    }
    assert!(events.try_recv().is_err(), "no event while it waits");
    // The last lease on "a" is dropped: "c" takes its entry, and its Ready event is sent.
    drop(lease_a);
    let LoadEvent::Ready { name, generation: c } = next_event(&events) else { panic!("c failed") };
    assert_eq!(name, "c");
    assert_eq!(ready(&store, "c"), c);
    assert!(store.adapter(a).is_none());
    assert_eq!(store.cpu_lru_order(), [b, c]);

    // Pinned full again: "d" waits, and unloading a pinned adapter makes room (it is retired).
    let lease_c = store.lease(c)?;
    assert!(matches!(store.resolve("d")?, Resolution::Loading(_)));
    until_waiting(&store, 1);
    assert!(store.unload("b")?.draining);
    let LoadEvent::Ready { name, generation: d } = next_event(&events) else { panic!("d failed") };
    assert_eq!((name.as_str(), ready(&store, "d")), ("d", d));
    drop(lease_b);

    // An unknown name that a resolver maps waits the same way, registered and loading.
    let lease_d = store.lease(d)?;
    assert!(matches!(store.resolve("found")?, Resolution::Loading(_)));
    until_waiting(&store, 1);
    assert!(matches!(store.resolve("found")?, Resolution::Loading(_)));
    drop(lease_d);
    let LoadEvent::Ready { name, generation: found } = next_event(&events) else { panic!("found failed") };
    assert_eq!((name.as_str(), ready(&store, "found")), ("found", found));

    // A waiting load whose adapter is unloaded meanwhile is dropped, not admitted later.
    store.register("e", synthetic(root, "e", 5))?;
    let lease_found = store.lease(found)?;
    assert!(matches!(store.resolve("e")?, Resolution::Loading(_)));
    until_waiting(&store, 1);
    store.unload("e")?;
    assert_eq!(store.metrics().waiting_for_capacity, 0);
    drop((lease_c, lease_found));
    assert!(store.info("e").is_none());
    assert!(events.try_recv().is_err());

    let m = store.metrics();
    assert_eq!((m.capacity_waits, m.waiting_for_capacity), (4, 0));
    assert!(m.failures.is_empty(), "waiting for room is not a failure: {:?}", m.failures);
    assert!(m.cpu.entries - m.cpu_retired <= 2);
    Ok(())
}

#[test]
fn a_failed_load_is_answered_from_memory_within_its_backoff() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let loader = CountingLoader::default();
    let config = StoreConfig::new("base", tiny_shapes()).load_retry_backoff(FOREVER);
    let store = Store::builder(config).loader(loader.clone()).build()?;
    store.register("bad", AdapterSource::Local(tmp.path().join("missing")))?;
    store.resolve("bad")?;
    let LoadEvent::Failed { error, .. } = wait_for(&store, "bad") else { panic!("bad loaded") };
    for _ in 0..100 {
        match store.resolve("bad")? {
            Resolution::Failed(e) => assert!(Arc::ptr_eq(&e, &error)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(loader.calls("bad"), 1);
    // An explicit retry skips the back-off.
    store.retry("bad");
    assert!(matches!(store.resolve("bad")?, Resolution::Loading(_)));
    assert!(matches!(wait_for(&store, "bad"), LoadEvent::Failed { .. }));
    assert_eq!(loader.calls("bad"), 2);
    Ok(())
}

#[test]
fn a_failed_load_is_retried_after_its_backoff() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let loader = CountingLoader::default();
    let base = Duration::from_millis(2);
    let config = StoreConfig::new("base", tiny_shapes()).load_retry_backoff(base);
    let store = Store::builder(config).loader(loader.clone()).build()?;
    store.register("late", AdapterSource::Local(tmp.path().join("late")))?;
    for attempt in 1..=3 {
        assert!(matches!(store.resolve("late")?, Resolution::Loading(_)), "attempt {attempt}");
        assert!(matches!(wait_for(&store, "late"), LoadEvent::Failed { .. }));
        assert_eq!(loader.calls("late"), attempt);
        // Longer than the back-off after this many failures in a row (2, 4, 8 ms).
        std::thread::sleep(base * 8);
    }
    // The files arrive; after the back-off the next request loads them.
    synthetic(tmp.path(), "late", 1);
    assert!(matches!(store.resolve("late")?, Resolution::Loading(_)));
    let generation = wait_ready(&store, "late");
    assert_eq!(ready(&store, "late"), generation);
    assert_eq!(loader.calls("late"), 4);
    Ok(())
}

#[test]
fn an_unknown_name_is_resolved_again_after_its_backoff() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("loras");
    std::fs::create_dir_all(&root)?;
    let base = Duration::from_millis(2);
    let config = qv_config(&root, 2).load_retry_backoff(base);
    let store = Store::builder(config).resolver(DirectoryResolver::new(&root)).build()?;
    assert!(matches!(store.resolve("soon")?, Resolution::Loading(_)));
    let LoadEvent::Failed { error, .. } = wait_for(&store, "soon") else { panic!("soon resolved") };
    assert_eq!(error.kind(), "unknown_adapter");
    std::thread::sleep(base * 4);
    synthetic(&root, "soon", 1);
    assert!(matches!(store.resolve("soon")?, Resolution::Loading(_)));
    let generation = wait_ready(&store, "soon");
    assert_eq!(ready(&store, "soon"), generation);

    // Within the back-off the failure is answered from memory, and the resolvers are not asked.
    let config = qv_config(&root, 2).load_retry_backoff(FOREVER);
    let store = Store::builder(config).resolver(DirectoryResolver::new(&root)).build()?;
    store.resolve("never")?;
    let LoadEvent::Failed { error, .. } = wait_for(&store, "never") else { panic!("never resolved") };
    synthetic(&root, "never", 2);
    for _ in 0..10 {
        match store.resolve("never")? {
            Resolution::Failed(e) => assert!(Arc::ptr_eq(&e, &error)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(store.metrics().failures.get("unknown_adapter"), Some(&1));
    Ok(())
}

#[test]
fn a_leased_generation_outlives_reloads_and_tier_pressure() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    let store = Store::builder(qv_config(root, 2)).build()?;
    let v1 = synthetic(root, "a-v1", 1);
    let old = cached(store.load("a", v1.clone())?);
    let weights = store.adapter(old).unwrap();
    // A request runs on the old generation, not yet in a slot.
    let lease = store.lease(old)?;
    let new = cached(store.reload_in_place("a", synthetic(root, "a-v2", 2))?);
    assert_ne!(new, old);
    // Pressure on the CPU tier: two more adapters through capacity 2 evict the unpinned ones.
    cached(store.load("b", synthetic(root, "b", 3))?);
    cached(store.load("c", synthetic(root, "c", 4))?);
    assert!(store.adapter(new).is_none(), "the unpinned new generation was evicted");
    assert!(Arc::ptr_eq(&store.adapter(old).unwrap(), &weights));
    // The request still gets its own weights into a slot.
    let mut sink = CountingSink::default();
    let slot = store.activate(old, &mut sink)?;
    assert_eq!(sink.slots[&slot], old.fingerprint);
    drop(lease);
    assert!(store.adapter(old).is_none());
    assert_eq!(store.slot_of(old), None);
    assert_eq!(store.metrics().cpu_retired, 0);

    // Reloaded back to the content a running request still holds: that generation is current
    // again, counted once as live, and stays when the request ends.
    let old = cached(store.reload_in_place("a", v1.clone())?);
    let lease = store.lease(old)?;
    let newer = cached(store.reload_in_place("a", synthetic(root, "a-v3", 5))?);
    assert_eq!(store.metrics().cpu_retired, 1);
    assert_eq!(cached(store.reload_in_place("a", v1)?), old);
    assert_ne!(newer, old);
    let m = store.metrics();
    assert_eq!((m.cpu_retired, m.cpu.entries), (0, 2));
    drop(lease);
    assert_eq!(ready(&store, "a"), old);
    assert!(store.adapter(old).is_some());
    Ok(())
}
