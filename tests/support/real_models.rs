//! The real GGUF models of the tests, shared by the crates' integration tests (`#[path]`-included),
//! each found through an environment variable that `.ci/run` sets after fetching the file, with
//! its fixtures under `tests/fixtures/<name>` (README there). Without the file a test says it was
//! skipped; with the model's `MULTILORA_REQUIRE_…=1` (CI) it fails.
//!
//! - [`smollm2`]: SmolLM2-135M-Instruct in Q4_1 (`MULTILORA_SMOLLM2_GGUF`,
//!   `scripts/fetch-smollm2.sh`, `tests/fixtures/smollm2`);
//! - [`gemma3`]: Gemma 3 270M in Q4_K_M (`MULTILORA_GEMMA3_GGUF`, `scripts/fetch-gemma3.sh`,
//!   `tests/fixtures/gemma3`).
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// One real model: where its file and fixtures are found.
pub struct RealModel {
    /// The fixture folder's name under `tests/fixtures`.
    pub fixture: &'static str,
    /// The variable that names the GGUF file.
    pub var: &'static str,
    /// The variable that turns a missing file into a failure.
    pub require: &'static str,
    /// The script that fetches the file.
    pub script: &'static str,
}

impl RealModel {
    /// The GGUF file, or `None` after printing why `test` is skipped (a failure when required).
    pub fn gguf(&self, test: &str) -> Option<PathBuf> {
        let why = match std::env::var_os(self.var) {
            Some(p) if Path::new(&p).is_file() => return Some(PathBuf::from(p)),
            Some(p) => format!("{}={} is not a file", self.var, Path::new(&p).display()),
            None => format!("{} is not set", self.var),
        };
        assert!(std::env::var(self.require).as_deref() != Ok("1"), "{test}: {why}");
        println!("SKIPPED {test}: {why} (export {}=\"$({})\")", self.var, self.script);
        None
    }

    /// `tests/fixtures/<fixture>` (from a crate's folder, `crates/<name>`).
    pub fn fixtures(&self) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(self.fixture)
    }

    /// `expected/<name>.json`'s cases.
    pub fn cases(&self, name: &str) -> Vec<Value> {
        let path = self.fixtures().join("expected").join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        v["cases"].as_array().unwrap_or_else(|| panic!("{}: no cases", path.display())).clone()
    }
}

/// A JSON list of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect()).unwrap_or_default()
}

/// Generates a model's module: `gguf`, `fixtures` and `cases` of its [`RealModel`].
macro_rules! real_model {
    ($(#[$doc:meta])* $name:ident, $model:expr) => {
        $(#[$doc])*
        pub mod $name {
            use std::path::PathBuf;

            use serde_json::Value;

            #[allow(unused_imports)]
            pub use super::ids;

            const MODEL: super::RealModel = $model;

            /// The GGUF file, or `None` after printing why `test` is skipped (a failure when
            /// required).
            pub fn gguf(test: &str) -> Option<PathBuf> {
                MODEL.gguf(test)
            }

            /// The model's fixture folder (from a crate's folder, `crates/<name>`).
            pub fn fixtures() -> PathBuf {
                MODEL.fixtures()
            }

            /// `expected/<name>.json`'s cases.
            pub fn cases(name: &str) -> Vec<Value> {
                MODEL.cases(name)
            }
        }
    };
}

real_model!(
    /// SmolLM2-135M-Instruct in Q4_1 GGUF (98 MB).
    smollm2,
    super::RealModel {
        fixture: "smollm2",
        var: "MULTILORA_SMOLLM2_GGUF",
        require: "MULTILORA_REQUIRE_SMOLLM2",
        script: "scripts/fetch-smollm2.sh",
    }
);

real_model!(
    /// Gemma 3 270M in Q4_K_M GGUF (247 MB).
    gemma3,
    super::RealModel {
        fixture: "gemma3",
        var: "MULTILORA_GEMMA3_GGUF",
        require: "MULTILORA_REQUIRE_GEMMA3",
        script: "scripts/fetch-gemma3.sh",
    }
);
