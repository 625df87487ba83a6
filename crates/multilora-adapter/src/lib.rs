//! PEFT LoRA adapters for multilora, and the vocabulary the other crates share.
//!
//! - [`load_dir`] / [`load`] read PEFT's `adapter_config.json` + `adapter_model.safetensors`,
//!   honour every field that changes the math (`rank_pattern`, `alpha_pattern`, `use_rslora`,
//!   regex `target_modules`, `layers_to_transform`, `exclude_modules`, embedding LoRA) or refuse
//!   the adapter with an [`Error`] naming the adapter, file, tensor and reason;
//! - the scale `alpha/r` (rsLoRA `alpha/√r`) is folded into B, so later code computes `B·A·x`;
//! - [`Fingerprint`] identifies an adapter by content (blake3-256 of the normalized config and
//!   the tensor bytes), for the prefix cache and the scheduler;
//! - [`LoraAdapter`], [`ModuleId`], [`ModelShapes`] and [`SlotSink`] are the shared vocabulary of
//!   the adapter format (the plain identifiers live in `multilora-types`).
//!
//! ```no_run
//! use multilora_adapter::{LoadOptions, ModelShapes, SourceExt};
//! use multilora_types::AdapterSource;
//! # fn main() -> multilora_adapter::Result<()> {
//! let shapes = ModelShapes::llama(4, 128, 352, 512, 4, 2);
//! let source = AdapterSource::parse("tests/fixtures/peft-tiny/adapters/qv_r8")?;
//! let adapter = multilora_adapter::load("sql", &source, &shapes, &LoadOptions::default().max_lora_rank(16))?;
//! println!("{} modules, rank {}, {}", adapter.modules().len(), adapter.max_rank(), adapter.fingerprint());
//! # Ok(()) }
//! ```
//!
//! Decisions worth knowing:
//! - `bias = "all"` or `"lora_only"` with no bias tensors in the file is accepted and changes
//!   nothing: PEFT's own outputs for such an adapter equal plain LoRA. Bias tensors themselves are
//!   refused ([`Error::LoraBias`]).
//! - `fan_in_fan_out` is accepted and changes nothing for the Llama family: PEFT resets it to
//!   false for `nn.Linear` targets, and saves `lora_A: [r, in]`, `lora_B: [out, r]` either way;
//!   the flag only transposes the merged delta of GPT-2-style `Conv1D` weights.
//! - A saved `embed_tokens.base_layer.weight` is accepted only when it equals the base embedding
//!   (checked against [`ModelShapes::embed_digest`]), since PEFT would copy it over the base.
#![forbid(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod adapter;
mod config;
mod error;
pub mod gguf;
mod gguf_lora;
mod load;
mod module;
mod shapes;
mod source;
mod synth;

pub use adapter::{
    LoraAdapter, LoraModule, SlotSink, embedding_digest, embedding_digest_of_rows, with_embedding_digest,
};
pub use config::{AdapterConfig, ModuleSelector};
pub use error::{Error, Result};
pub use gguf_lora::{load_gguf_lora, read_gguf_lora_config, write_gguf_lora};
pub use load::{
    CONFIG_FILE, ConfigSummary, LoadOptions, MAX_CONFIG_FILE_BYTES, ModuleSetting, WEIGHTS_FILE, load_dir, read_config,
};
pub use module::ModuleId;
pub use shapes::ModelShapes;
pub use source::{HubConfig, SourceExt};

use multilora_types::AdapterSource;
pub use synth::SyntheticAdapter;

/// Resolves `source` (a directory, a llama.cpp LoRA GGUF, or a hub repo through the cache) and
/// loads the adapter.
pub fn load(name: &str, source: &AdapterSource, shapes: &ModelShapes, opts: &LoadOptions) -> Result<LoraAdapter> {
    match source {
        AdapterSource::Gguf(path) => load_gguf_lora(name, path, shapes, opts),
        _ => load_dir(name, &source.resolve()?, shapes, opts),
    }
}

/// Reads and checks `source`'s config alone, no tensor (ranks, targets): PEFT's
/// `adapter_config.json`, or a GGUF LoRA's header.
pub fn read_source_config(
    name: &str,
    source: &AdapterSource,
    shapes: &ModelShapes,
    opts: &LoadOptions,
) -> Result<ConfigSummary> {
    match source {
        AdapterSource::Gguf(path) => read_gguf_lora_config(name, path, shapes, opts),
        _ => read_config(name, &source.resolve()?, shapes, opts),
    }
}
