//! Helpers shared by the adapter crate's integration tests: fixture paths and base shapes.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use multilora_adapter::ModelShapes;

/// `tests/fixtures/peft-tiny` at the workspace root.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny")
}

/// The fixture base model's shapes, with the digest of its real embedding.
pub fn base_shapes() -> ModelShapes {
    // The fixture's config.json: 4 layers, hidden 128, intermediate 352, vocab 512, 4 heads, 2 kv heads.
    let shapes = ModelShapes::llama(4, 128, 352, 512, 4, 2);
    let weights = candle_core::safetensors::load(fixtures().join("base/model.safetensors"), &Device::Cpu).unwrap();
    let embed: &Tensor = &weights["model.embed_tokens.weight"];
    multilora_adapter::with_embedding_digest(shapes, embed).unwrap()
}

/// `cases.json`.
pub fn cases() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap()).unwrap()
}
