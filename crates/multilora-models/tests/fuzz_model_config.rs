//! Fuzz target (bolero) for the base model's `config.json`, which this crate reads from files it
//! is pointed at: the fixture's file mutated with the fuzzer's input must give a typed error that
//! names the file, or a config whose derived sizes compute without a panic.
//!
//! Under `cargo test` it runs bolero's random engine for 1 s;
//! `BOLERO_RANDOM_TEST_TIME_MS=30000 cargo test -p multilora-models --test fuzz_model_config --
//! --nocapture --test-threads 1` runs it for 30 s (CI) and prints how many inputs it ran;
//! `cargo bolero test` drives it with a coverage-guided engine.

#[path = "../../../tests/support/mutate.rs"]
mod mutate;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use multilora_models::ModelConfig;
use mutate::mutate;

#[test]
fn fuzz_model_config_json() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny/base/config.json");
    let seed = std::fs::read(&path).unwrap();
    let runs = AtomicUsize::new(0);
    bolero::check!().with_max_len(256).for_each(|ops: &[u8]| {
        runs.fetch_add(1, Ordering::Relaxed);
        let text = mutate(&seed, ops);
        match ModelConfig::parse(&String::from_utf8_lossy(&text), &path) {
            // What the engine computes from an accepted config must not panic either.
            Ok(cfg) => {
                let _ = (cfg.shapes(), cfg.max_model_len(), cfg.auto_dtype(), cfg.q_size(), cfg.kv_size());
            }
            Err(e) => assert!(e.to_string().contains("config.json"), "the error names the file: {e}"),
        }
    });
    println!("fuzz config.json: {} inputs, no panic", runs.load(Ordering::Relaxed));
}
