//! Llama-family decoders (Llama 2/3, Mistral, Qwen2) on candle, with LoRA sites from
//! multilora-layers and a paged KV cache, run as one forward over a flat varlen batch.
//!
//! - [`ModelConfig`] reads Hugging Face `config.json` (the one reader of it, for the model, the
//!   adapter shapes, the engine and the planner), [`GenerationConfig`] `generation_config.json`;
//!   [`Model::load`] reads safetensors (one file or sharded) from a directory or a hub repo
//!   through the `hf-hub` cache (offline works);
//! - every projection, the embedding and (optionally) `lm_head` hold LoRA slots named as PEFT
//!   names them; [`Model`] implements `SlotSink`, and builds each step's per-token and per-logit-row
//!   `LoraMapping`s from the slot of each sequence;
//! - [`KvCache`]: per layer K and V of `[num_blocks, block_size, kv_heads, head_dim]`, addressed by
//!   the block tables the prefix cache hands out;
//! - [`Model::forward`] takes a [`Batch`] of sequences (a prefill chunk or one decode token each,
//!   at any start position, with its block table and slot) and returns logits for the rows asked.
//!
//! ```no_run
//! use multilora_models::{Batch, KvCacheConfig, Model, ModelOptions, ModelSource, SeqInput};
//! # fn main() -> multilora_models::Result<()> {
//! let model = Model::load(&ModelSource::parse("tests/fixtures/peft-tiny/base")?, &ModelOptions::default())?;
//! let mut cache = model.new_kv_cache(KvCacheConfig::new(64, 16))?;
//! let batch = Batch::new(vec![SeqInput::new(vec![1, 294, 488], 0, vec![0], None)]); // no adapter
//! let logits = model.forward(&batch, &mut cache)?; // [1, vocab]
//! # let _ = logits; Ok(()) }
//! ```
//!
//! Decisions worth knowing:
//! - Mistral's sliding window is applied in attention: a position sees the last `sliding_window`
//!   positions (itself included), as transformers masks them; contexts beyond the window are
//!   served up to `max_position_embeddings` (their blocks are kept, not recycled).
//! - On the CPU the activations are f32 whatever the model dtype: bf16 / f16 weights, slots and
//!   KV cache are read in place and widened as they are read, with f32 accumulation. On CUDA the
//!   activations are in the model dtype.
//! - Logits come back in f32 whatever the model dtype; attention softmax runs in f32.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod attention;
mod batch;
mod config;
mod error;
mod gguf;
mod kv_cache;
mod llama;
mod reader;
mod rope;
mod weights;

pub use batch::{Batch, MAX_DECODE_CHUNK, SeqInput};
pub use config::{Architecture, ConfigError, GenerationConfig, HiddenAct, MAX_CONFIG_BYTES, ModelConfig, RopeScaling};
pub use error::{Error, Result};
pub use gguf::{GgufFile, write_gguf_as_checkpoint};
pub use kv_cache::{
    DeviceMemory, KvCache, KvCacheConfig, device_memory, kv_bytes_per_token, num_blocks_for_budget,
    step_activation_bytes,
};
pub use llama::{Model, ModelOptions};
pub use multilora_layers::GreedyPick;
pub use weights::{Checkpoint, CheckpointFiles, ModelSource, write_checkpoint_copy};
