//! `EngineConfig`: the configuration an engine runs with, as the builder resolved it. Below the
//! builder, the handle and the loop, which all read it.

use std::path::PathBuf;

use candle_core::DType;
use multilora_scheduler::StepTime;
use multilora_types::LoraLimits;

/// The resolved configuration an engine runs with.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The model source as given.
    pub model: String,
    /// The model's local directory (the hub cache's snapshot for a hub id): `tokenizer.json`,
    /// `tokenizer_config.json` (chat template, special tokens) and `generation_config.json`.
    pub model_dir: PathBuf,
    /// The name requests use for the base model.
    pub served_model_name: String,
    /// Adapter slots (distinct adapters per step), the rank of every slot and the modules with
    /// slot buffers; [`LoraLimits::off`] when LoRA is off.
    pub lora: LoraLimits,
    /// Adapters held in host memory.
    pub max_cpu_loras: usize,
    /// Dtype of adapters and slots.
    pub lora_dtype: DType,
    /// Model dtype.
    pub dtype: DType,
    /// Context length.
    pub max_model_len: usize,
    /// Most running requests.
    pub max_num_seqs: usize,
    /// Most tokens per step.
    pub max_num_batched_tokens: usize,
    /// How long a step carrying decode rows may take.
    pub step_time: StepTime,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks allocated.
    pub num_kv_blocks: usize,
    /// Bytes of all slot buffers.
    pub lora_slot_bytes: u64,
    /// Prefix caching on.
    pub enable_prefix_caching: bool,
    /// Runtime load / unload / reload allowed.
    pub allow_runtime_lora_updating: bool,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// EOS ids from the model config.
    pub eos_token_ids: Vec<u32>,
}
