//! The real model of the tests, shared by the crates' integration tests (`#[path]`-included):
//! SmolLM2-135M-Instruct in Q4_1 GGUF, found through `MULTILORA_SMOLLM2_GGUF` (`.ci/run` fetches
//! it with `scripts/fetch-smollm2.sh`), and its fixtures in `tests/fixtures/smollm2` (README there).
//!
//! Without the file a test says it was skipped; with `MULTILORA_REQUIRE_SMOLLM2=1` (CI) it fails.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The GGUF file, or `None` after printing why `test` is skipped (a failure when required).
pub fn gguf(test: &str) -> Option<PathBuf> {
    let why = match std::env::var_os("MULTILORA_SMOLLM2_GGUF") {
        Some(p) if Path::new(&p).is_file() => return Some(PathBuf::from(p)),
        Some(p) => format!("MULTILORA_SMOLLM2_GGUF={} is not a file", Path::new(&p).display()),
        None => "MULTILORA_SMOLLM2_GGUF is not set".to_string(),
    };
    assert!(std::env::var("MULTILORA_REQUIRE_SMOLLM2").as_deref() != Ok("1"), "{test}: {why}");
    println!("SKIPPED {test}: {why} (export MULTILORA_SMOLLM2_GGUF=\"$(scripts/fetch-smollm2.sh)\")");
    None
}

/// `tests/fixtures/smollm2` (from a crate's folder, `crates/<name>`).
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2")
}

/// `expected/<name>.json`'s cases.
pub fn cases(name: &str) -> Vec<Value> {
    let path = fixtures().join("expected").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    v["cases"].as_array().unwrap_or_else(|| panic!("{}: no cases", path.display())).clone()
}

/// A JSON list of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect()).unwrap_or_default()
}
