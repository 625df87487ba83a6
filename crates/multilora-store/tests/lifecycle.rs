//! Loading off the engine's thread, failures, runtime load / unload / reload, resolvers and
//! confinement. No assertion depends on timing: tests wait on channels, barriers and events.

mod common;

use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use common::{BlockingLoader, CountingLoader, CountingSink, fixture, fixture_shapes, synthetic, tiny_shapes, wait_for};
use common::{cached, wait_ready};
use multilora_adapter::SourceExt;
use multilora_store::{DirectoryResolver, HubResolver, LoadEvent, Resolution, Store, StoreConfig};
use multilora_types::AdapterSource;
use multilora_types::{AdapterGen, LoraLimits, SlotId};
use parking_lot::Mutex;

fn ready(store: &Store, name: &str) -> AdapterGen {
    match store.resolve(name).unwrap() {
        Resolution::Ready(adapter) => adapter.generation(),
        other => panic!("{name} is not ready: {other:?}"),
    }
}

#[test]
fn loading_never_blocks_stepping() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let (started_tx, started_rx) = mpsc::sync_channel(1);
    let (release_tx, release_rx) = mpsc::channel();
    let loader = BlockingLoader { blocked: "slow".into(), started: started_tx, release: Mutex::new(release_rx) };
    let others = ["a", "b", "c", "d"];
    let config = StoreConfig::new("base", tiny_shapes()).lora(LoraLimits::slots(2)).max_cpu_loras(8);
    let store = others
        .iter()
        .enumerate()
        .fold(Store::builder(config).loader(loader), |b, (i, n)| b.startup(*n, synthetic(tmp.path(), n, i as u64)))
        .build()?;
    store.register("slow", synthetic(tmp.path(), "slow", 99))?;
    let gens: Vec<AdapterGen> = others.iter().map(|n| ready(&store, n)).collect();

    assert!(matches!(store.resolve("slow")?, Resolution::Loading(_)));
    // The loader thread is now inside the load of "slow" and stays there until released.
    started_rx.recv()?;
    let mut sink = CountingSink::default();
    for step in 0..100 {
        // A fake engine step: two requests on other adapters run, and "slow" keeps waiting.
        let running = [gens[step % 4], gens[(step + 1) % 4]];
        let mut leases = Vec::new();
        for g in running {
            assert!(matches!(store.resolve(others[gens.iter().position(|x| *x == g).unwrap()])?, Resolution::Ready(_)));
            leases.push(store.lease(g)?);
        }
        for g in running {
            store.activate(g, &mut sink)?;
        }
        drop(leases);
        assert!(matches!(store.resolve("slow")?, Resolution::Loading(_)));
        assert!(store.poll_completed().is_empty());
    }
    assert_eq!(store.metrics().loading, 1);
    release_tx.send(())?;
    let slow = wait_ready(&store, "slow");
    assert_eq!(ready(&store, "slow"), slow);
    assert_eq!(store.metrics().loading, 0);
    Ok(())
}

#[test]
fn concurrent_requests_load_once() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let loader = CountingLoader::default();
    let config = StoreConfig::new("base", tiny_shapes()).lora(LoraLimits::slots(1)).max_cpu_loras(2).loader_threads(4);
    let store = Arc::new(Store::builder(config).loader(loader.clone()).build()?);
    store.register("a", synthetic(tmp.path(), "a", 0))?;
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                store.resolve("a").unwrap()
            })
        })
        .collect();
    for t in threads {
        let status = t.join().unwrap();
        assert!(matches!(status, Resolution::Loading(_) | Resolution::Ready(_)), "{status:?}");
    }
    let generation = wait_ready(&store, "a");
    assert_eq!(ready(&store, "a"), generation);
    assert_eq!(loader.calls("a"), 1);
    assert_eq!(store.metrics().cpu.misses, 1);
    Ok(())
}

#[test]
fn a_failure_reaches_every_waiter_and_others_are_served() -> anyhow::Result<()> {
    let loader = CountingLoader::default();
    // A back-off no test outlives: every later request is answered from memory.
    let config = StoreConfig::new("base", fixture_shapes())
        .lora(LoraLimits::slots(1))
        .max_cpu_loras(2)
        .load_retry_backoff(Duration::from_secs(3600));
    let store = Store::builder(config).loader(loader.clone()).startup("good", fixture("adapters/qv_r8")).build()?;
    store.register("bad", fixture("invalid_adapters/shape_mismatch"))?;
    // Three requests wait on "bad" before its load finishes (or find it failed already).
    let first: Vec<Resolution> = (0..3).map(|_| store.resolve("bad").unwrap()).collect();
    let event = wait_for(&store, "bad");
    let LoadEvent::Failed { error, .. } = event else { panic!("{event:?}") };
    assert_eq!(error.kind(), "shape_mismatch");
    assert!(error.to_string().contains("\"bad\""), "{error}");
    for status in first {
        assert!(matches!(status, Resolution::Loading(_) | Resolution::Failed(_)));
    }
    // Every later waiter within the back-off sees the same error, without another load.
    for _ in 0..3 {
        match store.resolve("bad")? {
            Resolution::Failed(e) => assert!(Arc::ptr_eq(&e, &error)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(loader.calls("bad"), 1);
    // The store keeps serving the others.
    let good = ready(&store, "good");
    let lease = store.lease(good)?;
    assert_eq!(store.activate(good, &mut CountingSink::default())?, SlotId::new(0));
    drop(lease);
    // An explicit retry loads again.
    store.retry("bad");
    assert!(matches!(store.resolve("bad")?, Resolution::Loading(_)));
    assert!(matches!(wait_for(&store, "bad"), LoadEvent::Failed { .. }));
    assert_eq!(loader.calls("bad"), 2);
    assert_eq!(store.metrics().failures.get("shape_mismatch"), Some(&2));
    Ok(())
}

fn runtime_store(root: &std::path::Path, max_cpu_loras: usize) -> anyhow::Result<Store> {
    let config = StoreConfig::new("base", tiny_shapes())
        .lora(LoraLimits::slots(2))
        .max_cpu_loras(max_cpu_loras)
        .allow_runtime_updates(true)
        .allowed_root(root);
    Ok(Store::builder(config).build()?)
}

#[test]
fn reload_in_place_keeps_running_requests_on_their_weights() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = runtime_store(tmp.path(), 2)?;
    let old = cached(store.load("a", synthetic(tmp.path(), "a-v1", 1))?);
    let other = cached(store.load("b", synthetic(tmp.path(), "b", 2))?);
    let mut sink = CountingSink::default();
    let old_lease = store.lease(old)?;
    let old_slot = store.activate(old, &mut sink)?;
    let old_weights = store.adapter(old).unwrap();

    let new = cached(store.reload_in_place("a", synthetic(tmp.path(), "a-v2", 3))?);
    assert_eq!(new.id, old.id);
    assert_ne!(new.fingerprint, old.fingerprint);
    // New requests get the new generation; the running one keeps its weights and its slot.
    assert_eq!(ready(&store, "a"), new);
    let still = store.adapter(old).unwrap();
    assert!(Arc::ptr_eq(&still, &old_weights));
    assert_eq!(store.slot_of(old), Some(old_slot));
    // Old and new generation each hold a slot at once.
    let _new_lease = store.lease(new)?;
    let new_slot = store.activate(new, &mut sink)?;
    assert_ne!(new_slot, old_slot);
    assert_eq!(sink.slots[&old_slot], old.fingerprint);
    assert_eq!(sink.slots[&new_slot], new.fingerprint);
    // The retired generation sits outside the capacity, and the metrics say so.
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu.capacity, m.cpu_retired), (3, 2, 1));
    assert!(store.adapter(other).is_some());
    // The last release of the old generation frees its CPU entry and its slot.
    drop(old_lease);
    assert!(store.adapter(old).is_none());
    assert_eq!(store.slot_of(old), None);
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu_retired, m.device.entries), (2, 0, 1));
    Ok(())
}

#[test]
fn unload_lets_running_requests_finish() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = runtime_store(tmp.path(), 2)?;
    let a = cached(store.load("a", synthetic(tmp.path(), "a", 1))?);
    let mut sink = CountingSink::default();
    let lease = store.lease(a)?;
    let slot = store.activate(a, &mut sink)?;
    let weights = store.adapter(a).unwrap();

    let unloaded = store.unload("a")?;
    assert_eq!((unloaded.generation, unloaded.draining), (Some(a), true));
    // New and waiting requests get model_not_found; the running one keeps weights and slot.
    assert_eq!(store.resolve("a").unwrap_err().kind(), "unknown_adapter");
    assert!(Arc::ptr_eq(&store.adapter(a).unwrap(), &weights));
    assert_eq!(store.activate(a, &mut sink)?, slot);
    assert_eq!(store.metrics().cpu_retired, 1);
    drop(lease);
    assert!(store.adapter(a).is_none());
    assert_eq!(store.slot_of(a), None);
    assert_eq!(store.metrics().cpu.entries, 0);
    // Without running requests it leaves at once, and the name can be loaded again.
    let b = cached(store.load("b", synthetic(tmp.path(), "b", 2))?);
    assert!(!store.unload("b")?.draining);
    assert!(store.adapter(b).is_none());
    assert_eq!(store.unload("b").unwrap_err().kind(), "unknown_adapter");
    store.load("b", synthetic(tmp.path(), "b", 2))?;
    Ok(())
}

#[test]
fn runtime_updates_are_off_unless_enabled() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let source = synthetic(tmp.path(), "a", 0);
    let config = StoreConfig::new("base", tiny_shapes()).allowed_root(tmp.path());
    let store =
        Store::builder(config).resolver(DirectoryResolver::new(tmp.path())).startup("s", source.clone()).build()?;
    assert_eq!(store.load("x", source.clone()).unwrap_err().kind(), "runtime_updates_disabled");
    assert_eq!(store.reload_in_place("s", source).unwrap_err().kind(), "runtime_updates_disabled");
    assert_eq!(store.unload("s").unwrap_err().kind(), "runtime_updates_disabled");
    // Resolvers are not asked either: an unknown name is model_not_found.
    assert_eq!(store.resolve("a").unwrap_err().kind(), "unknown_adapter");
    assert_eq!(store.metrics().failures.get("runtime_updates_disabled"), Some(&3));
    Ok(())
}

#[test]
fn runtime_sources_are_confined() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("loras");
    std::fs::create_dir_all(&root)?;
    synthetic(tmp.path(), "outside", 0);
    let store = runtime_store(&root, 2)?;
    let escape = AdapterSource::Local(root.join("../outside"));
    let err = store.load("x", escape).unwrap_err();
    assert_eq!(err.kind(), "path_outside_roots");
    assert!(err.to_string().contains("\"x\""), "{err}");
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(tmp.path().join("outside"), root.join("link"))?;
        let err = store.load("x", AdapterSource::Local(root.join("link"))).unwrap_err();
        assert_eq!(err.kind(), "path_outside_roots");
    }
    let hub = AdapterSource::parse("org/sql-lora")?;
    assert_eq!(store.load("x", hub).unwrap_err().kind(), "hub_disabled");
    for (name, kind) in [("base", "invalid_name"), ("a/b", "invalid_name"), ("", "invalid_name")] {
        assert_eq!(store.load(name, synthetic(&root, "ok", 1)).unwrap_err().kind(), kind, "{name:?}");
    }
    let inside = cached(store.load("ok", synthetic(&root, "ok", 1))?);
    assert_eq!(store.load("ok", synthetic(&root, "ok", 1)).unwrap_err().kind(), "already_registered");
    assert_eq!(ready(&store, "ok"), inside);
    assert_eq!(store.metrics().registered, 1);
    Ok(())
}

#[test]
fn resolvers_provide_unknown_names_in_order() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("loras");
    synthetic(&root, "found", 0);
    let config = StoreConfig::new("base", tiny_shapes())
        .lora(LoraLimits::slots(1))
        .max_cpu_loras(2)
        .allow_runtime_updates(true)
        .allowed_root(&root)
        .load_retry_backoff(Duration::from_secs(3600));
    // The load of "found" is held until the test releases it, so both requests find it running.
    let (started_tx, started) = mpsc::sync_channel(1);
    let (release, release_rx) = mpsc::channel();
    let loader = BlockingLoader { blocked: "found".into(), started: started_tx, release: Mutex::new(release_rx) };
    let store = Store::builder(config)
        .loader(loader)
        .resolver(DirectoryResolver::new(&root))
        .resolver(HubResolver::new(["acme/elsewhere"])?)
        .build()?;
    // Both resolvers offer their names before anything is loaded.
    let (offered, errors) = store.offered();
    let names: Vec<&str> = offered.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!((names, errors.len()), (vec!["found", "elsewhere"], 0));
    assert!(matches!(store.resolve("found")?, Resolution::Loading(_)));
    started.recv()?;
    assert!(matches!(store.resolve("found")?, Resolution::Loading(_)));
    release.send(())?;
    let generation = wait_ready(&store, "found");
    assert_eq!(ready(&store, "found"), generation);
    assert!(started.try_recv().is_err(), "loaded once");
    let info = store.info("found").unwrap();
    assert_eq!(info.source, AdapterSource::Local(root.join("found").canonicalize()?));
    // Registered now: offered no more.
    let names: Vec<String> = store.offered().0.into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["elsewhere"]);

    // Not in the directory: the hub resolver maps it, and its repo is not on the store's
    // allow-list (nor is the hub on at run time).
    store.resolve("elsewhere")?;
    let LoadEvent::Failed { error, .. } = wait_for(&store, "elsewhere") else { panic!() };
    assert_eq!(error.kind(), "hub_disabled");
    assert!(matches!(store.resolve("elsewhere")?, Resolution::Failed(_)));
    // No resolver maps it at all.
    store.resolve("no such adapter")?;
    let LoadEvent::Failed { error, .. } = wait_for(&store, "no such adapter") else { panic!() };
    assert_eq!(error.kind(), "unknown_adapter");
    assert_eq!(store.resolve("../escape").unwrap_err().kind(), "invalid_name");
    assert_eq!(store.metrics().registered, 1);
    Ok(())
}
