//! The two tiers through the public API: LRU order, pins, slot exhaustion, validation before
//! eviction, and memory accounting.

mod common;

use std::sync::OnceLock;

use common::{CountingLoader, CountingSink, fixture, fixture_shapes, synthetic, tiny_shapes, wait_ready};
use multilora_store::{Resolution, Store, StoreConfig};
use multilora_types::AdapterSource;
use multilora_types::{AdapterGen, LoraLimits, SlotId};
use proptest::prelude::*;

fn ready(store: &Store, name: &str) -> AdapterGen {
    match store.resolve(name).unwrap() {
        Resolution::Ready(adapter) => adapter.generation(),
        other => panic!("{name} is not ready: {other:?}"),
    }
}

#[test]
fn the_store_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Store>();
    assert_send_sync::<multilora_store::Error>();
    assert_send_sync::<multilora_store::LoadEvent>();
}

#[test]
fn startup_adapters_are_ready_without_a_load_at_request_time() -> anyhow::Result<()> {
    let loader = CountingLoader::default();
    let config = StoreConfig::new("base", fixture_shapes()).lora(LoraLimits::slots(2)).max_cpu_loras(4);
    let store = Store::builder(config)
        .loader(loader.clone())
        .startup("qv", fixture("adapters/qv_r8"))
        .startup("rs", fixture("adapters/rslora_r4"))
        .build()?;
    assert_eq!((loader.calls("qv"), loader.calls("rs")), (1, 1));
    let qv = ready(&store, "qv");
    assert_eq!(store.info("qv").unwrap().rank, Some(8));
    assert_eq!(store.adapter(qv).unwrap().fingerprint(), qv.fingerprint);
    assert_eq!(loader.calls("qv"), 1);
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu.hits, m.cpu.misses, m.loads, m.load_time.count), (2, 1, 0, 2, 2));
    Ok(())
}

#[test]
fn a_bad_startup_adapter_fails_the_build() {
    let config = StoreConfig::new("base", fixture_shapes());
    let err = Store::new(config, vec![("big".into(), fixture("adapters/rank32"))]).unwrap_err();
    assert_eq!(err.kind(), "rank_too_large");
    assert!(matches!(&err, multilora_store::Error::Startup { name, .. } if name == "big"), "{err:?}");
    assert!(err.to_string().contains("\"big\"") && err.to_string().contains("exceeds max_lora_rank 16"), "{err}");
    let config = StoreConfig::new("base", fixture_shapes()).lora(LoraLimits::slots(4)).max_cpu_loras(2);
    assert_eq!(Store::new(config, vec![]).unwrap_err().kind(), "config");
}

#[test]
fn cpu_tier_is_lru_and_never_exceeds_its_capacity() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let config = StoreConfig::new("base", tiny_shapes()).lora(LoraLimits::slots(1)).max_cpu_loras(3);
    let store = Store::builder(config).build()?;
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        store.register(name, synthetic(tmp.path(), name, i as u64))?;
    }
    let mut gens = std::collections::HashMap::new();
    for name in ["a", "b", "c"] {
        assert!(matches!(store.resolve(name)?, Resolution::Loading(_)));
        gens.insert(name, wait_ready(&store, name));
        assert!(store.metrics().cpu.entries <= 3);
    }
    assert_eq!(store.cpu_lru_order(), [gens["a"], gens["b"], gens["c"]]);
    // A hit on "a" makes "b" the least recently used: loading "d" evicts "b".
    ready(&store, "a");
    store.resolve("d")?;
    gens.insert("d", wait_ready(&store, "d"));
    assert_eq!(store.cpu_lru_order(), [gens["c"], gens["a"], gens["d"]]);
    assert!(store.adapter(gens["b"]).is_none());
    let m = store.metrics();
    assert_eq!((m.cpu.entries, m.cpu.capacity, m.cpu.evictions, m.cpu.misses), (3, 3, 1, 4));
    // "b" loads again on request, and its content, hence its generation, is the same.
    store.resolve("b")?;
    assert_eq!(wait_ready(&store, "b"), gens["b"]);
    assert_eq!(store.metrics().cpu.entries, 3);
    Ok(())
}

#[test]
fn slots_are_lru_and_pins_keep_them() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let names = ["a", "b", "c", "d"];
    let config = StoreConfig::new("base", tiny_shapes()).lora(LoraLimits::slots(2)).max_cpu_loras(4);
    let store = names
        .iter()
        .enumerate()
        .fold(Store::builder(config), |b, (i, n)| b.startup(*n, synthetic(tmp.path(), n, i as u64)))
        .build()?;
    let g: Vec<AdapterGen> = names.iter().map(|n| ready(&store, n)).collect();
    let mut sink = CountingSink::default();
    assert_eq!(store.activate(g[0], &mut sink)?, SlotId::new(0));
    assert_eq!(store.activate(g[1], &mut sink)?, SlotId::new(1));
    assert_eq!(store.activate(g[0], &mut sink)?, SlotId::new(0)); // hit: no write, "b" is now the LRU
    assert_eq!(sink.writes, 2);
    assert_eq!(store.slot_lru_order(), [g[1], g[0]]);
    assert_eq!(store.activate(g[2], &mut sink)?, SlotId::new(1));
    assert_eq!(store.slot_of(g[1]), None);
    assert_eq!(sink.slots[&SlotId::new(1)], g[2].fingerprint);

    // Pinned by a running request, "a" stays even though it is the LRU.
    let lease_a = store.lease(g[0])?;
    assert_eq!(store.activate(g[3], &mut sink)?, SlotId::new(1));
    assert_eq!(store.slot_of(g[0]), Some(SlotId::new(0)));
    // With both slots pinned, activation is a typed error and changes nothing.
    let lease_d = store.lease(g[3])?;
    let err = store.activate(g[1], &mut sink).unwrap_err();
    assert_eq!(err.kind(), "all_slots_pinned");
    assert!(err.to_string().contains("\"b\"") && err.to_string().contains("all 2 slots are pinned"), "{err}");
    assert_eq!(store.resident_slots(), [(SlotId::new(0), g[0]), (SlotId::new(1), g[3])]);
    drop(lease_d);
    assert_eq!(store.activate(g[1], &mut sink)?, SlotId::new(1));

    // The operator's pin keeps "b" resident after its requests are gone.
    drop(lease_a);
    assert_eq!(store.pin_adapter("b")?, g[1]);
    assert!(store.info("b").unwrap().operator_pinned);
    assert_eq!(store.activate(g[2], &mut sink)?, SlotId::new(0));
    assert_eq!(store.activate(g[3], &mut sink)?, SlotId::new(0));
    assert_eq!(store.slot_of(g[1]), Some(SlotId::new(1)));
    store.unpin_adapter("b")?;
    assert_eq!(store.activate(g[0], &mut sink)?, SlotId::new(1));
    let m = store.metrics();
    assert_eq!((m.device.entries, m.device.capacity, m.pinned_slots), (2, 2, 0));
    assert_eq!((m.device.hits, m.device.misses, m.device.evictions), (1, 8, 6));
    assert_eq!(m.failures.get("all_slots_pinned"), None, "activation refusals are not load failures");
    Ok(())
}

#[test]
fn activation_needs_the_cpu_tier() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let config = StoreConfig::new("base", tiny_shapes()).lora(LoraLimits::slots(1)).max_cpu_loras(1);
    let store = Store::builder(config).startup("a", synthetic(tmp.path(), "a", 0)).build()?;
    store.register("b", synthetic(tmp.path(), "b", 1))?;
    let a = ready(&store, "a");
    store.resolve("b")?;
    let b = wait_ready(&store, "b");
    // "a" was evicted from the CPU tier to make room for "b", and was never in a slot.
    let err = store.activate(a, &mut CountingSink::default()).unwrap_err();
    assert_eq!(err.kind(), "not_ready");
    assert_eq!(store.lease(a).unwrap_err().kind(), "not_ready");
    assert_eq!(store.activate(b, &mut CountingSink::default())?, SlotId::new(0));
    Ok(())
}

#[test]
fn a_failing_validation_evicts_nothing() -> anyhow::Result<()> {
    let root = common::fixtures();
    let config = StoreConfig::new("base", fixture_shapes())
        .lora(LoraLimits::slots(1))
        .max_cpu_loras(2)
        .allow_runtime_updates(true)
        .allowed_root(&root);
    let store = Store::builder(config)
        .startup("qv", fixture("adapters/qv_r8"))
        .startup("rs", fixture("adapters/rslora_r4"))
        .build()?;
    let before = store.cpu_lru_order();
    let bytes = store.metrics().cpu.bytes;
    for (rel, kind) in [
        ("invalid_adapters/shape_mismatch", "shape_mismatch"),
        ("adapters/rank32", "rank_too_large"),
        ("invalid_adapters/truncated", "truncated"),
        ("invalid_adapters/dora", "dora"),
    ] {
        let err = store.load("bad", fixture(rel)).unwrap_err();
        assert_eq!(err.kind(), kind, "{rel}: {err}");
        assert_eq!(store.cpu_lru_order(), before, "{rel}");
        assert!(store.info("bad").is_none());
    }
    // The same through a background load of a registered adapter.
    store.register("lazy-bad", fixture("invalid_adapters/shape_mismatch"))?;
    store.resolve("lazy-bad")?;
    assert!(matches!(common::wait_for(&store, "lazy-bad"), multilora_store::LoadEvent::Failed { .. }));
    assert_eq!(store.cpu_lru_order(), before);
    let m = store.metrics();
    assert_eq!((m.cpu.evictions, m.cpu.entries, m.cpu.bytes), (0, 2, bytes));
    assert_eq!(m.failures.get("shape_mismatch"), Some(&2));
    assert_eq!(m.failures.get("rank_too_large"), Some(&1));
    // A valid adapter then evicts the LRU one, as usual.
    store.load("ok", fixture("adapters/all_r16"))?;
    assert_eq!(store.metrics().cpu.evictions, 1);
    Ok(())
}

#[test]
fn memory_accounting_follows_the_tiers() -> anyhow::Result<()> {
    let config = StoreConfig::new("base", fixture_shapes()).lora(LoraLimits::slots(2)).max_cpu_loras(3);
    let store = Store::builder(config)
        .startup("qv", fixture("adapters/qv_r8"))
        .startup("rs", fixture("adapters/rslora_r4"))
        .startup("all", fixture("adapters/all_r16"))
        .build()?;
    let gens: Vec<AdapterGen> = ["qv", "rs", "all"].iter().map(|n| ready(&store, n)).collect();
    let adapters: Vec<_> = gens.iter().map(|g| store.adapter(*g).unwrap()).collect();
    let m = store.metrics();
    assert_eq!(m.cpu.bytes, adapters.iter().map(|a| a.nbytes()).sum::<u64>());
    assert_eq!(m.device.bytes, 0);
    let mut sink = CountingSink::default();
    store.activate(gens[0], &mut sink)?;
    store.activate(gens[1], &mut sink)?;
    let slot_bytes = |i: usize| adapters[i].nbytes_at_rank(16, 4);
    assert_eq!(store.metrics().device.bytes, slot_bytes(0) + slot_bytes(1));
    store.activate(gens[2], &mut sink)?;
    assert_eq!(store.metrics().device.bytes, slot_bytes(1) + slot_bytes(2));
    assert!(slot_bytes(0) > adapters[0].nbytes(), "a rank-8 adapter in a rank-16 slot pays for padding");
    Ok(())
}

/// Adapters for the property test, written once.
fn prop_sources() -> &'static (tempfile::TempDir, Vec<AdapterSource>) {
    static SOURCES: OnceLock<(tempfile::TempDir, Vec<AdapterSource>)> = OnceLock::new();
    SOURCES.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let sources = (0..5).map(|i| synthetic(tmp.path(), &format!("p{i}"), i)).collect();
        (tmp, sources)
    })
}

#[derive(Clone, Debug)]
enum Op {
    Activate(usize),
    Pin(usize),
    Release(usize),
    PinAdapter(usize),
    UnpinAdapter(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..5usize).prop_map(Op::Activate),
        2 => (0..5usize).prop_map(Op::Pin),
        2 => (0..5usize).prop_map(Op::Release),
        1 => (0..5usize).prop_map(Op::PinAdapter),
        1 => (0..5usize).prop_map(Op::UnpinAdapter),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Through the store: a generation pinned by a request or the operator never loses its slot,
    /// and `activate` fails only when every slot is pinned.
    #[test]
    fn pinned_slots_are_never_evicted(max_loras in 1..4usize, ops in proptest::collection::vec(op(), 1..80)) {
        let (_, sources) = prop_sources();
        let config = StoreConfig::new("base", tiny_shapes()).lora(LoraLimits::slots(max_loras)).max_cpu_loras(5);
        let builder = sources.iter().enumerate().fold(Store::builder(config), |b, (i, s)| b.startup(format!("p{i}"), s.clone()));
        let store = builder.build().unwrap();
        let gens: Vec<AdapterGen> = (0..5).map(|i| ready(&store, &format!("p{i}"))).collect();
        let mut leases: Vec<Vec<multilora_store::SlotLease>> = (0..5).map(|_| Vec::new()).collect();
        let mut operator = [false; 5];
        let mut sink = CountingSink::default();
        for op in ops {
            let before = store.resident_slots();
            match op {
                Op::Activate(i) => match store.activate(gens[i], &mut sink) {
                    Ok(slot) => {
                        prop_assert_eq!(store.slot_of(gens[i]), Some(slot));
                        prop_assert_eq!(sink.slots[&slot], gens[i].fingerprint);
                    }
                    Err(e) => {
                        prop_assert_eq!(e.kind(), "all_slots_pinned");
                        prop_assert_eq!(before.len(), max_loras);
                        let all_pinned = before.iter().all(|(_, g)| {
                            let j = gens.iter().position(|x| x == g).unwrap();
                            !leases[j].is_empty() || operator[j]
                        });
                        prop_assert!(all_pinned);
                    }
                },
                Op::Pin(i) => leases[i].push(store.lease(gens[i]).unwrap()),
                Op::Release(i) => drop(leases[i].pop()),
                Op::PinAdapter(i) => { store.pin_adapter(&format!("p{i}")).unwrap(); operator[i] = true; }
                Op::UnpinAdapter(i) => { store.unpin_adapter(&format!("p{i}")).unwrap(); operator[i] = false; }
            }
            for (slot, g) in &before {
                let j = gens.iter().position(|x| x == g).unwrap();
                if !leases[j].is_empty() || operator[j] {
                    prop_assert_eq!(store.slot_of(*g), Some(*slot));
                }
            }
            prop_assert!(store.metrics().cpu.entries <= 5);
        }
    }
}
