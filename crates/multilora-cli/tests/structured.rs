//! Structured outputs and tools through the official `openai` Python client against
//! `multilora serve` of SmolLM2's GGUF file with its three PEFT adapters
//! (`tests/structured_client.py`): 200 JSON-schema replies over the base model and the adapters
//! in mixed batches validated by `jsonschema`, `json_object`, `guided_choice` and `guided_regex`
//! replies, `required` and named tool calls whose arguments validate, and unconstrained rows that
//! give the same text beside constrained ones.
//!
//! Needs `python3` with `openai` and `jsonschema` (`.ci/run` installs them and sets
//! `MULTILORA_REQUIRE_OPENAI=1`, so in CI their absence fails the test; elsewhere it is skipped
//! with a message) and SmolLM2's file (`MULTILORA_SMOLLM2_GGUF`).

#[path = "../../../tests/support/real_models.rs"]
mod real_models;
use real_models::smollm2;

mod common;

use std::path::Path;
use std::process::Command;

use common::{python_has, serve_model};

#[test]
fn structured_outputs_hold_for_the_openai_client() {
    let Some(gguf) = smollm2::gguf("structured_outputs_hold_for_the_openai_client") else { return };
    if !python_has("openai, jsonschema") {
        return;
    }
    let adapters = ["french", "pirate", "shout"];
    let mut args: Vec<String> = vec!["--served-model-name".into(), "base".into(), "--lora-modules".into()];
    for a in adapters {
        args.push(format!("{a}={}", smollm2::fixtures().join("adapters").join(a).display()));
    }
    let server = serve_model(&gguf, &args, &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/structured_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&server.url)
        .args(["test-key", "base", "french", "pirate", "shout"])
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "structured client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("OK"), "{stdout}");
    eprintln!("{stdout}");
    assert_eq!(server.terminate().code(), Some(0));
}
