//! The adapters of the PEFT fixture `tests/fixtures/peft-tiny`, `#[path]`-included by the
//! integration tests of the models, the engine and (through the engine's) the server, so the
//! table is written once.

/// The seven adapters of `adapters/` first, then the two of `invalid_adapters/` that load all the
/// same (an `embed_tokens` target; `bias = "all"` without bias tensors), each with its directory
/// under the fixture.
#[allow(dead_code)]
pub const ADAPTERS: [(&str, &str); 9] = [
    ("qv_r8", "adapters/qv_r8"),
    ("all_r16", "adapters/all_r16"),
    ("rslora_r4", "adapters/rslora_r4"),
    ("pattern_r8", "adapters/pattern_r8"),
    ("regex_layers", "adapters/regex_layers"),
    ("layers_subset", "adapters/layers_subset"),
    ("rank32", "adapters/rank32"),
    ("embed_target", "invalid_adapters/embed_target"),
    ("bias_all", "invalid_adapters/bias_all"),
];
