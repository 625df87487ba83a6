//! `EngineConfig`: the configuration an engine runs with, as the builder resolved it. Below the
//! builder, the handle and the loop, which all read it.

use std::path::PathBuf;

use multilora_models::GenerationConfig;

use multilora_types::{LoraLimits, StepTime};

use crate::knobs::DType;
use crate::request::SamplingParams;
use crate::text::ChatTemplateSource;

/// The resolved configuration an engine runs with.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The model source as given.
    pub model: String,
    /// The model's local directory (the hub cache's snapshot for a hub id; the folder of a GGUF
    /// file): where `generation_config.json` is read from.
    pub model_dir: PathBuf,
    /// The model's chat template (`--tokenizer DIR`'s, the checkpoint's `chat_template.jinja` or
    /// `tokenizer_config.json`, or a GGUF file's `tokenizer.chat_template`); `None` when it has
    /// none.
    pub chat_template: Option<ChatTemplateSource>,
    /// How the base weights are held, e.g. `GGUF Q4_1 ×210, F32 ×61, Q8_0 ×1 (quantized, 93.8 MiB)`
    /// or `safetensors BF16 (256.0 MiB)`.
    pub weights: String,
    /// The name requests use for the base model.
    pub served_model_name: String,
    /// Adapter slots (distinct adapters per step), the rank of every slot and the modules with
    /// slot buffers; [`LoraLimits::off`] when LoRA is off.
    pub lora: LoraLimits,
    /// Adapters held in host memory.
    pub max_cpu_loras: usize,
    /// Dtype of adapters and slots.
    pub lora_dtype: DType,
    /// Dtype of the KV cache.
    pub kv_cache_dtype: DType,
    /// The dtype the model is served in (weights; on the CPU the activations are f32 whatever
    /// it is). A GGUF model kept quantized holds its projections in their GGUF types
    /// ([`EngineConfig::weights`]) and its norms in this dtype.
    pub dtype: DType,
    /// Which kernel each path of a step runs, with the instruction set picked at run time (the
    /// start-up log's `kernels`).
    pub kernels: String,
    /// Context length.
    pub max_model_len: usize,
    /// Most running requests.
    pub max_num_seqs: usize,
    /// Most tokens per step: `max_num_batched_tokens`, on the CPU capped to what the step budget
    /// holds.
    pub max_num_batched_tokens: usize,
    /// What a step of that many tokens takes beside the weights, the KV cache and the slots, at
    /// most (an estimate; logged at start).
    pub step_memory_bytes: u64,
    /// How long a step carrying decode rows may take.
    pub step_time: StepTime,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks allocated.
    pub num_kv_blocks: usize,
    /// Blocks of the sliding layers' own KV pool, for a model whose layers mix a sliding window
    /// with full attention (Gemma 3): each request holds only its window there; `None` for other
    /// models (every layer's KV in the `num_kv_blocks`).
    pub sliding_kv_blocks: Option<usize>,
    /// Bytes of all slot buffers.
    pub lora_slot_bytes: u64,
    /// Prefix caching on.
    pub enable_prefix_caching: bool,
    /// Runtime load / unload / reload allowed.
    pub allow_runtime_lora_updating: bool,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// EOS ids: `config.json`'s, then `generation_config.json`'s.
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's `generation_config.json` (empty when it has none, or when the builder's
    /// `generation_config` is off): what [`EngineConfig::default_params`] starts from.
    pub(crate) generation: GenerationConfig,
}

impl EngineConfig {
    /// The sampling parameters a request starts from: vLLM's defaults, with what the
    /// checkpoint's `generation_config.json` sets in their place (`temperature`, `top_p`,
    /// `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` as `max_tokens`); the
    /// request's own fields then override them, as vLLM does with `--generation-config auto`.
    pub fn default_params(&self) -> SamplingParams {
        let g = &self.generation;
        let mut p = SamplingParams::default();
        p.temperature = g.temperature.unwrap_or(p.temperature);
        p.top_p = g.top_p.unwrap_or(p.top_p);
        p.top_k = g.top_k.unwrap_or(p.top_k);
        p.min_p = g.min_p.unwrap_or(p.min_p);
        p.repetition_penalty = g.repetition_penalty.unwrap_or(p.repetition_penalty);
        p.max_tokens = g.max_new_tokens.or(p.max_tokens);
        p
    }
}
