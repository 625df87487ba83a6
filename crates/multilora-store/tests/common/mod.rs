//! Shared test helpers: fixture paths, synthetic adapters, a counting `SlotSink`, counting and
//! blocking loaders, and waiting for load events without timing assumptions.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use multilora_adapter::{LoadOptions, LoraAdapter, ModelShapes, SlotSink, SyntheticAdapter};
use multilora_store::{AdapterLoader, FsLoader, LoadEvent, Loaded, Store};
use multilora_types::AdapterSource;
use multilora_types::{AdapterGen, Fingerprint, ModuleKind, SlotId};
use parking_lot::Mutex;

/// The PEFT fixtures of the repository.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny")
}

/// A fixture adapter directory, e.g. `adapters/qv_r8`.
pub fn fixture(rel: &str) -> AdapterSource {
    AdapterSource::Local(fixtures().join(rel))
}

/// The fixtures' base model shapes.
pub fn fixture_shapes() -> ModelShapes {
    // The fixture's config.json: 4 layers, hidden 128, intermediate 352, vocab 512, 4 heads, 2 kv heads.
    ModelShapes::llama(4, 128, 352, 512, 4, 2)
}

/// Small shapes for synthetic adapters.
pub fn tiny_shapes() -> ModelShapes {
    ModelShapes::llama(2, 64, 128, 256, 4, 2)
}

/// Writes a rank-4 q/v synthetic adapter with `seed` under `root/name` and returns its source.
pub fn synthetic(root: &Path, name: &str, seed: u64) -> AdapterSource {
    let dir = root.join(name);
    SyntheticAdapter::new(4, &[ModuleKind::QProj, ModuleKind::VProj], seed).write(&dir, &tiny_shapes()).unwrap();
    AdapterSource::Local(dir)
}

/// A sink that records which adapter (by fingerprint) each slot holds, and counts writes.
#[derive(Debug, Default)]
pub struct CountingSink {
    pub writes: usize,
    pub clears: usize,
    pub slots: HashMap<SlotId, Fingerprint>,
}

impl SlotSink for CountingSink {
    fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> multilora_adapter::Result<()> {
        self.writes += 1;
        self.slots.insert(slot, adapter.fingerprint());
        Ok(())
    }

    fn clear_slot(&mut self, slot: SlotId) -> multilora_adapter::Result<()> {
        self.clears += 1;
        self.slots.remove(&slot);
        Ok(())
    }
}

/// The real loader, counting calls per adapter name.
#[derive(Debug, Clone, Default)]
pub struct CountingLoader {
    pub calls: Arc<Mutex<HashMap<String, usize>>>,
}

impl CountingLoader {
    pub fn calls(&self, name: &str) -> usize {
        self.calls.lock().get(name).copied().unwrap_or(0)
    }
}

impl AdapterLoader for CountingLoader {
    fn load(
        &self,
        name: &str,
        source: &AdapterSource,
        shapes: &ModelShapes,
        opts: &LoadOptions,
    ) -> multilora_adapter::Result<LoraAdapter> {
        *self.calls.lock().entry(name.to_string()).or_insert(0) += 1;
        FsLoader.load(name, source, shapes, opts)
    }
}

/// The real loader, except that loading `blocked` first says so on `started`, then waits on
/// `release` until the test sends.
#[derive(Debug)]
pub struct BlockingLoader {
    pub blocked: String,
    pub started: mpsc::SyncSender<()>,
    pub release: Mutex<mpsc::Receiver<()>>,
}

impl AdapterLoader for BlockingLoader {
    fn load(
        &self,
        name: &str,
        source: &AdapterSource,
        shapes: &ModelShapes,
        opts: &LoadOptions,
    ) -> multilora_adapter::Result<LoraAdapter> {
        if name == self.blocked {
            self.started.send(()).unwrap();
            self.release.lock().recv().unwrap();
        }
        FsLoader.load(name, source, shapes, opts)
    }
}

/// Waits for the load event of `name`, draining others. The timeout only keeps a broken test
/// from hanging; no assertion depends on it.
pub fn wait_for(store: &Store, name: &str) -> LoadEvent {
    for _ in 0..600 {
        if let Some(event) = store.wait_completed(Duration::from_millis(100)).into_iter().find(|e| e.name() == name) {
            return event;
        }
    }
    panic!("no load event for {name:?}");
}

/// Waits until `name` is ready and returns its generation.
pub fn wait_ready(store: &Store, name: &str) -> AdapterGen {
    match wait_for(store, name) {
        LoadEvent::Ready { generation, .. } => generation,
        other => panic!("{name:?} failed to load: {other:?}"),
    }
}

/// A store whose load events arrive on the returned channel, as the engine's do.
pub fn with_events(builder: multilora_store::StoreBuilder) -> anyhow::Result<(Store, mpsc::Receiver<LoadEvent>)> {
    let (tx, rx) = mpsc::channel();
    let store = builder.events(move |event| drop(tx.send(event))).build()?;
    Ok((store, rx))
}

/// The next event on `rx`; the timeout only keeps a broken test from hanging.
pub fn next_event(rx: &mpsc::Receiver<LoadEvent>) -> LoadEvent {
    rx.recv_timeout(Duration::from_secs(60)).expect("no load event")
}

/// The generation of a runtime load or reload that went into the CPU tier at once; one that had
/// to wait for room fails the test.
pub fn cached(loaded: Loaded) -> AdapterGen {
    match loaded {
        Loaded::Cached(generation) => generation,
        other => panic!("expected a load cached at once: {other:?}"),
    }
}
