//! Fuzz targets (bolero) for what this crate reads from untrusted files: `adapter_config.json`
//! and the safetensors header of `adapter_model.safetensors` (the base model's `config.json` has
//! its own target, in `multilora-models`' `tests/fuzz_model_config.rs`).
//! Each mutates a valid fixture file with the fuzzer's input and asserts a typed error or a
//! value, never a panic, an abort or a hang.
//!
//! Under `cargo test` they run bolero's random engine for 1 s each;
//! `BOLERO_RANDOM_TEST_TIME_MS=30000 cargo test -p multilora-adapter --test fuzz_targets --
//! --nocapture --test-threads 1` runs each for 30 s (CI) and prints how many inputs it ran;
//! `cargo bolero test` drives the same targets with a coverage-guided engine.

mod common;
#[path = "../../../tests/support/mutate.rs"]
mod mutate;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::{base_shapes, fixtures};
use multilora_adapter::{AdapterConfig, LoadOptions, load_dir, read_config};
use mutate::mutate;

fn report(target: &str, runs: &AtomicUsize) {
    println!("fuzz {target}: {} inputs, no panic", runs.load(Ordering::Relaxed));
}

#[test]
fn fuzz_adapter_config_json() {
    let seed = std::fs::read(fixtures().join("adapters/pattern_r8/adapter_config.json")).unwrap();
    let shapes = base_shapes();
    let tmp = tempfile::tempdir().unwrap();
    let runs = AtomicUsize::new(0);
    bolero::check!().with_max_len(256).for_each(|ops: &[u8]| {
        runs.fetch_add(1, Ordering::Relaxed);
        let text = mutate(&seed, ops);
        let _ = AdapterConfig::parse(&String::from_utf8_lossy(&text));
        // The whole reading path too: file checks, parse, rank and target checks.
        std::fs::write(tmp.path().join("adapter_config.json"), &text).unwrap();
        if let Err(e) = read_config("fuzz", tmp.path(), &shapes, &LoadOptions::default()) {
            assert!(e.to_string().contains("fuzz"), "the error names the adapter: {e}");
        }
    });
    report("adapter_config.json", &runs);
}

#[test]
fn fuzz_safetensors_header() {
    let src = fixtures().join("adapters/qv_r8");
    let weights = std::fs::read(src.join("adapter_model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let (head, body) = weights.split_at(8 + header_len);
    let shapes = base_shapes();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("adapter_config.json"), tmp.path().join("adapter_config.json")).unwrap();
    let runs = AtomicUsize::new(0);
    bolero::check!().with_max_len(256).for_each(|ops: &[u8]| {
        runs.fetch_add(1, Ordering::Relaxed);
        // The 8-byte length is mutated as part of the header: it may now lie.
        let mut file = mutate(head, ops);
        file.extend_from_slice(body);
        std::fs::write(tmp.path().join("adapter_model.safetensors"), &file).unwrap();
        if let Err(e) = load_dir("fuzz", tmp.path(), &shapes, &LoadOptions::default()) {
            assert!(e.to_string().contains("fuzz"), "the error names the adapter: {e}");
        }
    });
    report("safetensors header", &runs);
}
