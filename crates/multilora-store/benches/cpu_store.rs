//! The store's bookkeeping per engine step: resolve 8 adapters, admit and pin them, activate them
//! against a `SlotSink` that only counts, release them. 10,000 registered adapters (registration reads no
//! file), 64 loaded in the CPU tier, 8 slots.
//!
//! `resident`: the same 8 adapters every step (slot hits). `rotating`: each step takes the next 8
//! of the 64, so every activation evicts a slot and calls the sink (the worst case).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use multilora_adapter::{LoraAdapter, ModelShapes, SlotSink, SyntheticAdapter};
use multilora_store::{LoadEvent, Resolution, Store, StoreConfig};
use multilora_types::{LoraLimits, ModuleKind, SlotId};

const REGISTERED: usize = 10_000;
const CACHED: usize = 64;
const SLOTS: usize = 8;

#[derive(Debug, Default)]
struct CountingSink {
    writes: u64,
}

impl SlotSink for CountingSink {
    fn write_slot(&mut self, _slot: SlotId, _adapter: &LoraAdapter) -> multilora_adapter::Result<()> {
        self.writes += 1;
        Ok(())
    }

    fn clear_slot(&mut self, _slot: SlotId) -> multilora_adapter::Result<()> {
        Ok(())
    }
}

fn setup() -> anyhow::Result<(tempfile::TempDir, Store, Vec<String>)> {
    let shapes = ModelShapes::llama(2, 64, 128, 256, 4, 2);
    let tmp = tempfile::tempdir()?;
    // A few adapter directories shared by all names: the store keys on names and ids, not paths.
    let dirs: Vec<_> = (0..8)
        .map(|i| {
            let dir = tmp.path().join(format!("a{i}"));
            SyntheticAdapter::new(8, &[ModuleKind::QProj, ModuleKind::VProj], i).write(&dir, &shapes).map(|()| dir)
        })
        .collect::<Result<_, _>>()?;
    let config = StoreConfig::new("base", shapes).lora(LoraLimits::slots(SLOTS)).max_cpu_loras(CACHED);
    let store = Store::builder(config).build()?;
    let names: Vec<String> = (0..REGISTERED).map(|i| format!("lora-{i:05}")).collect();
    for (i, name) in names.iter().enumerate() {
        store.register(name, multilora_types::AdapterSource::Local(dirs[i % dirs.len()].clone()))?;
    }
    // Resolving a name starts its load; the loads finish (and are cached) without their tickets.
    for name in &names[..CACHED] {
        drop(store.resolve(name)?);
    }
    let mut ready = 0;
    while ready < CACHED {
        for event in store.wait_completed(Duration::from_secs(30)) {
            match event {
                LoadEvent::Ready { .. } => ready += 1,
                other => anyhow::bail!("load failed: {other:?}"),
            }
        }
    }
    let m = store.metrics();
    assert_eq!((m.registered, m.cpu.entries, m.loads), (REGISTERED, CACHED, CACHED as u64));
    Ok((tmp, store, names))
}

fn step(store: &Store, names: &[String], sink: &mut CountingSink) {
    let mut held = Vec::with_capacity(SLOTS);
    for name in names {
        if let Ok(Resolution::Ready(adapter)) = store.resolve(name) {
            held.push(adapter);
        }
    }
    // Admitted (host pin), then running (slot pin), as the engine takes a request through.
    let leases: Vec<_> = held.iter().map(|adapter| store.admit(adapter).run()).collect();
    for adapter in &held {
        black_box(store.activate(adapter.generation(), sink).ok());
    }
    drop(leases);
}

fn bench(c: &mut Criterion) {
    let (_tmp, store, names) = setup().expect("setup");
    let mut sink = CountingSink::default();
    let mut group = c.benchmark_group("store_step");
    group.bench_function("resident_8_of_64_cached_10000_registered", |b| {
        b.iter(|| step(&store, &names[..SLOTS], &mut sink));
    });
    let mut k = 0;
    group.bench_function("rotating_8_of_64_cached_10000_registered", |b| {
        b.iter(|| {
            let start = (k * SLOTS) % CACHED;
            k += 1;
            step(&store, &names[start..start + SLOTS], &mut sink);
        });
    });
    group.finish();
    black_box(sink.writes);
}

criterion_group!(benches, bench);
criterion_main!(benches);
