//! `EngineBuilder`: vLLM's knobs, this engine's defaults (and why they differ), and the start-up
//! sequence, one named step each: model config → LoRA limits from the startup adapters' configs
//! (rank, targets) → model with slot buffers → tokenizer → store → KV cache from what the slots
//! left of the budget → scheduler → the loop thread.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::Sender;

use multilora_adapter::HubConfig;
use multilora_adapter::{LoadOptions, SourceExt};
use multilora_models::{Checkpoint, GenerationConfig, KvCacheConfig, Model, ModelConfig, ModelOptions, ModelSource};
use multilora_scheduler::{KvConfig, Scheduler, SchedulerConfig, SlidingKv};
use multilora_store::{Store, StoreBuilder, StoreConfig};
use multilora_types::{AdapterSource, DEFAULT_MAX_LORA_RANK, Resolver};
use multilora_types::{DEFAULT_STEP_FACTOR, LoraLimits, ModuleKind, StepTime};

use crate::command::{Command, EventCount};
use crate::config::EngineConfig;
use crate::error::BuildError;
use crate::handle::Engine;
use crate::knobs::{DType, Device};

/// What the start-up steps return.
type Result<T> = std::result::Result<T, BuildError>;

/// Default KV budget on the CPU: 256 MiB. A CPU host has no device memory to measure, so the
/// default is a fixed budget; on a GPU the budget comes from [`DEFAULT_GPU_MEMORY_UTILIZATION`].
pub const DEFAULT_KV_CACHE_BYTES: u64 = 256 << 20;

/// The most the CPU's default KV budget grows to hold one sequence of the model's full length:
/// 4 GiB, vLLM's CPU default (`VLLM_CPU_KVCACHE_SPACE`). Beyond it, the context length is capped
/// to what the budget holds unless `max_model_len` is given.
pub const MAX_DEFAULT_KV_CACHE_BYTES: u64 = 4 << 30;

/// The most host memory the CPU's KV pool takes for cached prefixes by default
/// ([`EngineBuilder::cache_ram_bytes`]: an eighth of the machine's memory up to this; llama.cpp's
/// `--cache-ram` default).
pub const MAX_DEFAULT_CACHE_RAM_BYTES: u64 = 8 << 30;

/// The CPU's default step budget ([`EngineBuilder::step_memory_bytes`]): about what a step of
/// 2,048 tokens of a 7–8B model takes (Qwen2.5-7B's is capped a little below); smaller models'
/// steps take a fraction of it.
pub const DEFAULT_STEP_MEMORY_BYTES: u64 = 1 << 30;

/// vLLM's `gpu_memory_utilization` default: the share of the GPU's memory the engine may use for
/// weights, slots, activations and KV together.
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

impl Engine {
    /// A builder for an engine serving `model` (a directory or a hub id `org/name[@rev]`).
    pub fn builder(model: impl Into<String>) -> EngineBuilder {
        EngineBuilder::new(model.into())
    }
}

/// Builds an [`Engine`]: `Engine::builder("path/to/model").max_loras(8).lora("sql", "path").build()?`.
///
/// | knob | default here | vLLM's | why |
/// | --- | --- | --- | --- |
/// | `max_loras` | 4 | 1 | serving several tenants at once is the point of this engine |
/// | `max_lora_rank` | largest startup rank, else 16 | 16 | slots sized to what is served, not wasted |
/// | `max_cpu_loras` | max(`max_loras`, 32) | `max_loras` | host memory is cheap, reloads from disk are not |
/// | `lora_target_modules` | 7 projections ∪ startup targets | all supported | slots for what adapters use |
/// | `kv_cache_bytes` | CPU: 256 MiB, slots counted against it; GPU: from `gpu_memory_utilization` | 0.9 of device memory | no device memory to measure on CPU |
/// | `gpu_memory_utilization` | 0.9 | 0.9 | |
/// | `dtype` | `auto`: the checkpoint's `torch_dtype` (f32 when it names none) | `auto` | a bf16 checkpoint is served in its own bytes; the CPU kernels read bf16 / f16 and accumulate in f32 |
/// | `lora_dtype`, `kv_cache_dtype` | the model dtype; f16 for a GGUF model kept quantized on the CPU | the model dtype | llama.cpp's defaults for GGUF (an f16 KV cache, f16 LoRA files): half the bytes a step reads and the cache holds |
/// | `max_num_seqs` | 256 | 256 | |
/// | `max_num_batched_tokens` | CPU 2048, GPU 8192 | 2048–8192 | a hard cap; the step-time budget bounds steps that carry decodes |
/// | `cache_ram_bytes` | CPU: an eighth of the machine's memory, at most 8 GiB | — | llama.cpp's `--cache-ram`: resent conversations find their prefix cached |
/// | `step_memory_bytes` | CPU: 1 GiB | — | no legal request takes the process past weights + KV + slots + this: a step's tokens are capped to what its activations take within it |
/// | `step_time` | auto: 2.5× the step's decode rows alone | a token budget only | streams never stall behind arriving prompts |
/// | `block_size` | 16 | 16 | |
/// | `enable_prefix_caching` | on | on | |
/// | `allow_runtime_lora_updating` | off | off | loading files named by clients is a privilege |
#[derive(Debug)]
pub struct EngineBuilder {
    model: String,
    served_model_name: Option<String>,
    loras: Vec<(String, String)>,
    max_loras: usize,
    max_cpu_loras: Option<usize>,
    max_lora_rank: Option<usize>,
    lora_target_modules: Option<Vec<ModuleKind>>,
    lora_dtype: Option<DType>,
    kv_cache_dtype: Option<DType>,
    dtype: Option<DType>,
    device: Device,
    max_model_len: Option<usize>,
    max_num_seqs: usize,
    max_num_batched_tokens: Option<usize>,
    step_memory_bytes: u64,
    step_time: StepTime,
    block_size: usize,
    kv_cache_bytes: Option<u64>,
    cache_ram_bytes: Option<u64>,
    gpu_memory_utilization: f64,
    enable_prefix_caching: bool,
    generation_config: bool,
    allow_runtime_lora_updating: bool,
    allowed_lora_roots: Vec<PathBuf>,
    allowed_lora_hub_repos: Vec<String>,
    resolvers: Resolvers,
    tokenizer: Option<PathBuf>,
    gguf_file: Option<String>,
}

/// Resolvers to hand to the store, kept as closures because the store takes them by value.
#[derive(Default)]
struct Resolvers(Vec<Box<dyn FnOnce(StoreBuilder) -> StoreBuilder + Send>>);

impl std::fmt::Debug for Resolvers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} resolvers", self.0.len())
    }
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty => $field:ident = $val:expr) => {
        $(#[$doc])*
        pub fn $name(mut self, $name: $ty) -> EngineBuilder {
            self.$field = $val($name);
            self
        }
    };
}

impl EngineBuilder {
    pub(crate) fn new(model: String) -> EngineBuilder {
        EngineBuilder {
            model,
            served_model_name: None,
            loras: Vec::new(),
            max_loras: 4,
            max_cpu_loras: None,
            max_lora_rank: None,
            lora_target_modules: None,
            lora_dtype: None,
            kv_cache_dtype: None,
            dtype: None,
            device: Device::Cpu,
            max_model_len: None,
            max_num_seqs: 256,
            max_num_batched_tokens: None,
            step_memory_bytes: DEFAULT_STEP_MEMORY_BYTES,
            step_time: StepTime::Auto { factor: DEFAULT_STEP_FACTOR },
            block_size: 16,
            kv_cache_bytes: None,
            cache_ram_bytes: None,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            enable_prefix_caching: true,
            generation_config: true,
            allow_runtime_lora_updating: false,
            allowed_lora_roots: Vec::new(),
            allowed_lora_hub_repos: Vec::new(),
            resolvers: Resolvers::default(),
            tokenizer: None,
            gguf_file: None,
        }
    }

    /// An adapter served from the start (vLLM's `--lora-modules name=source`): a directory or
    /// a hub id `org/name[@revision]`; loaded into the CPU tier by [`EngineBuilder::build`].
    pub fn lora(mut self, name: impl Into<String>, source: impl Into<String>) -> EngineBuilder {
        self.loras.push((name.into(), source.into()));
        self
    }

    setter!(/// Adapter slots: distinct adapters per step (default 4); 0 turns LoRA off.
        max_loras: usize => max_loras = |v| v);
    setter!(/// Adapters kept in host memory (default max(`max_loras`, 32)).
        max_cpu_loras: usize => max_cpu_loras = Some);
    setter!(/// Rank of every slot (default: the largest startup adapter rank, else 16).
        max_lora_rank: usize => max_lora_rank = Some);
    setter!(/// Dtype of adapters and slots (default: the model dtype; f16 for a GGUF model kept
        /// quantized on the CPU).
        lora_dtype: DType => lora_dtype = Some);
    setter!(/// Dtype of the KV cache (default: the model dtype; f16 for a GGUF model kept quantized
        /// on the CPU). On the CPU f32, bf16 or f16; on CUDA the model dtype.
        kv_cache_dtype: DType => kv_cache_dtype = Some);
    setter!(/// Model dtype: weights and KV cache (default `auto`: the checkpoint's own `torch_dtype`,
        /// f32 when it names none). On the CPU the activations are f32 whatever it is.
        dtype: DType => dtype = Some);
    setter!(/// Where the model runs (default CPU).
        device: Device => device = |v| v);
    setter!(/// Context length (default: the model's).
        max_model_len: usize => max_model_len = Some);
    setter!(/// Most running requests (default 256).
        max_num_seqs: usize => max_num_seqs = |v| v);
    setter!(/// Most tokens per step (default 2,048 on the CPU, 8,192 on a GPU).
        max_num_batched_tokens: usize => max_num_batched_tokens = Some);
    setter!(/// What one step's activations may take on the CPU beside the weights, the KV cache and
        /// the slots (default 1 GiB): the tokens a step carries are capped to what fits
        /// ([`multilora_models::step_activation_bytes`], logged at start), so no legal request
        /// takes the process past weights + KV budget + slots + this. Not applied on a GPU,
        /// whose KV budget leaves room for a full step.
        step_memory_bytes: u64 => step_memory_bytes = |v| v);
    setter!(/// How long a step that carries decode rows may take, so running streams never stall
        /// behind arriving prompts (default `Auto { factor: 2.5 }`: 2.5 times the step's decode
        /// rows alone, by the engine's own measured costs; `Max` for a fixed time; `Unbounded`
        /// for vLLM's token budget only). `max_num_batched_tokens` stays a hard cap.
        step_time: StepTime => step_time = |v| v);
    setter!(/// Tokens per KV block (default 16).
        block_size: usize => block_size = |v| v);
    setter!(/// Bytes for KV and LoRA slots together (default: 256 MiB on the CPU; on a GPU what
        /// `gpu_memory_utilization` leaves after weights, slots and activations).
        kv_cache_bytes: u64 => kv_cache_bytes = Some);
    setter!(/// Host memory for cached prefixes on the CPU, beside the running sequences' KV (llama.cpp's
        /// `--cache-ram`; default an eighth of the machine's memory, at most 8 GiB; 0 for none):
        /// the CPU KV pool is this much larger, so prompts resent after others (multi-turn chat,
        /// agents) find their prefix cached instead of recomputing it. Evictable: cached blocks
        /// are the first taken when running sequences need room. Ignored when `kv_cache_bytes`
        /// is given, on a GPU, and without prefix caching.
        cache_ram_bytes: u64 => cache_ram_bytes = Some);
    setter!(/// vLLM's `gpu_memory_utilization` (default 0.9): the share of the GPU's memory the engine
        /// sizes its KV cache to fill, after weights, slots and one step's activations. Ignored on
        /// the CPU and when `kv_cache_bytes` is given.
        gpu_memory_utilization: f64 => gpu_memory_utilization = |v| v);
    setter!(/// Prefix caching (default on).
        enable_prefix_caching: bool => enable_prefix_caching = |v| v);
    setter!(/// Read the checkpoint's `generation_config.json` (default on, vLLM's `--generation-config
        /// auto`): its EOS ids stop generation beside `config.json`'s, and its `temperature`,
        /// `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` are the defaults of
        /// [`EngineConfig::default_params`] (what the server and `generate` start a request from).
        /// Off is vLLM's `--generation-config vllm`: vLLM's defaults, `config.json`'s EOS only.
        generation_config: bool => generation_config = |v| v);
    setter!(/// Runtime load / unload / reload (default off).
        allow_runtime_lora_updating: bool => allow_runtime_lora_updating = |v| v);

    /// The name requests use for the base model (default: the model source as given).
    pub fn served_model_name(mut self, name: impl Into<String>) -> EngineBuilder {
        self.served_model_name = Some(name.into());
        self
    }

    /// Modules that get slot buffers (default: the seven projections plus whatever the startup
    /// adapters target). A runtime adapter targeting anything else is refused.
    pub fn lora_target_modules(mut self, modules: &[ModuleKind]) -> EngineBuilder {
        self.lora_target_modules = Some(modules.to_vec());
        self
    }

    /// The tokenizer (and chat template) to serve instead of the model's own (vLLM's
    /// `--tokenizer`): a folder with `tokenizer.json` and `tokenizer_config.json` /
    /// `chat_template.jinja`. A GGUF model otherwise uses the tokenizer its metadata describes.
    pub fn tokenizer(mut self, dir: impl Into<PathBuf>) -> EngineBuilder {
        self.tokenizer = Some(dir.into());
        self
    }

    /// The GGUF file of a hub repo to serve (a repo usually holds one per quantization), e.g.
    /// `Engine::builder("org/name-GGUF").gguf_file("name.Q4_K_M.gguf")`.
    pub fn gguf_file(mut self, name: impl Into<String>) -> EngineBuilder {
        self.gguf_file = Some(name.into());
        self
    }

    /// A directory runtime adapter sources must lie in.
    pub fn allowed_lora_root(mut self, root: impl Into<PathBuf>) -> EngineBuilder {
        self.allowed_lora_roots.push(root.into());
        self
    }

    /// A hub repository (`org/name`, any revision) runtime adapters may come from: a
    /// [`crate::HubResolver`]'s allow-list. Hub sources are otherwise refused at run time.
    pub fn allowed_lora_hub_repo(mut self, repo: impl Into<String>) -> EngineBuilder {
        self.allowed_lora_hub_repos.push(repo.into());
        self
    }

    /// Adds a resolver for adapter names nobody registered (vLLM's `LoRAResolver`), asked in the
    /// order added; used only with `allow_runtime_lora_updating`. A request for such a name waits
    /// in the engine (deferred) while the resolved adapter loads. See
    /// [`crate::DirectoryResolver`] for the built-in one.
    pub fn lora_resolver(mut self, resolver: impl Resolver + 'static) -> EngineBuilder {
        self.resolvers.0.push(Box::new(move |b: StoreBuilder| b.resolver(resolver)));
        self
    }

    /// The context length: `max_model_len` if given, which may not exceed what the model's
    /// config allows (`max_position_embeddings`, or a smaller sliding window), as vLLM refuses
    /// it; else the model's own. Checked before anything is loaded.
    fn context_length(&self, cfg: &ModelConfig) -> Result<usize> {
        let limit = cfg.max_model_len();
        match self.max_model_len {
            Some(0) => Err(BuildError::MaxModelLen { requested: 0, limit }),
            Some(n) if n > limit => Err(BuildError::MaxModelLen { requested: n, limit }),
            Some(n) => Ok(n),
            None => Ok(limit),
        }
    }

    /// Loads the model, tokenizer and startup adapters, sizes the KV cache, and starts the loop:
    /// read config → LoRA limits from the startup adapters' shapes → model → tokenizer → store →
    /// KV budget → scheduler → loop. A failure is a [`BuildError`] (start-up), never a
    /// request's `EngineError`.
    pub fn build(mut self) -> std::result::Result<Engine, BuildError> {
        self.check()?;
        let mut source = ModelSource::parse(&self.model).map_err(BuildError::model)?;
        if let Some(file) = &self.gguf_file {
            source = source.with_gguf_file(file).map_err(BuildError::model)?;
        }
        let hub = HubConfig::from_env();
        let checkpoint = self.open(&source, &hub)?;
        let cfg = checkpoint.config().map_err(BuildError::model)?;
        let model_limit = self.context_length(&cfg)?;
        // A GGUF file carries no generation defaults; a Hugging Face folder may.
        let generation = match &checkpoint {
            Checkpoint::Safetensors(files) if self.generation_config => {
                GenerationConfig::from_file(&files.dir.join("generation_config.json"))
                    .map_err(|e| BuildError::model(e.into()))?
            }
            _ => GenerationConfig::default(),
        };
        let mut eos_token_ids = cfg.eos_token_ids.clone();
        for id in &generation.eos_token_ids {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }
        let lora = self.lora_limits(&cfg)?;
        let (dtype, quantized) = self.resolve_dtype(&cfg, &checkpoint);
        let device = self.device.open().map_err(|e| BuildError::Device { device: self.device, source: Arc::new(e) })?;
        let mut opts =
            ModelOptions::default().dtype(dtype.to_candle()).device(device).lora(lora.clone()).hub(hub.clone());
        // Unset, the model picks them (f16 for a GGUF file kept quantized on the CPU).
        opts.quantized = quantized;
        opts.lora_dtype = self.lora_dtype.map(DType::to_candle);
        opts.kv_dtype = self.kv_cache_dtype.map(DType::to_candle);
        let model = Model::load_checkpoint(&checkpoint, &opts).map_err(BuildError::model)?;
        let (lora_dtype, kv_cache_dtype) = (model.lora_dtype(), model.kv_dtype());
        let weights = weights_description(&checkpoint, &model, quantized);
        let text = crate::text::load(&checkpoint, self.tokenizer.as_deref())?;
        let served = self.served_model_name.clone().unwrap_or_else(|| self.model.clone());
        let max_cpu_loras = self.max_cpu_loras.unwrap_or(lora.max_loras().max(32));
        let (tx, rx) = std::sync::mpsc::channel();
        let events = EventCount::default();
        let store_cfg = StoreConfig::new(served.clone(), model.shapes().clone())
            .lora(lora.clone())
            .max_cpu_loras(max_cpu_loras)
            .lora_dtype(lora_dtype);
        let store = self.build_store(store_cfg, &tx, &events)?;

        let slot_bytes = model.lora_slot_bytes();
        let (kv_budget, budget_from, max_model_len) = self.kv_budget(&model, slot_bytes, model_limit)?;
        let step = self.step_tokens(&model, max_model_len)?;
        let kv_cfg = self.kv_cache_config(model.config(), kv_cache_dtype, kv_budget, max_model_len, step.tokens);
        let scheduler =
            self.build_scheduler(&lora, max_model_len, kv_cfg, model.config(), step.tokens).map_err(|e| {
                BuildError::Scheduler { kv_bytes: kv_budget, budget_from: budget_from.clone(), source: Arc::new(e) }
            })?;
        let kv = model.new_kv_cache(kv_cfg).map_err(BuildError::model)?;
        tracing::info!(
            model = %self.model,
            device = %self.device,
            dtype = ?dtype,
            checkpoint_dtype = cfg.torch_dtype.as_deref().unwrap_or("unknown"),
            weights = %weights,
            tokenizer = %text.from,
            max_model_len,
            decode_attention = model.decode_attention(),
            kernels = %model.kernels(),
            kv_budget = %budget_from,
            step_tokens = step.tokens,
            step_bytes = step.bytes,
            step_budget = %step.from,
            max_loras = lora.max_loras(),
            max_lora_rank = lora.max_lora_rank(),
            lora_slot_bytes = slot_bytes,
            kv_bytes = kv.nbytes(),
            kv_blocks = kv_cfg.num_blocks,
            kv_tokens = kv_cfg.num_blocks * self.block_size,
            sliding_kv_blocks = kv_cfg.sliding_blocks,
            "multilora engine ready"
        );
        let config = EngineConfig {
            model: self.model,
            model_dir: checkpoint.dir(),
            chat_template: text.chat_template,
            weights,
            served_model_name: served,
            lora,
            max_cpu_loras,
            lora_dtype: served_dtype(lora_dtype)?,
            kv_cache_dtype: served_dtype(kv_cache_dtype)?,
            dtype,
            kernels: model.kernels(),
            max_model_len,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: step.tokens,
            step_memory_bytes: step.bytes,
            step_time: self.step_time,
            block_size: self.block_size,
            num_kv_blocks: kv_cfg.num_blocks,
            sliding_kv_blocks: kv_cfg.sliding_blocks,
            lora_slot_bytes: slot_bytes,
            enable_prefix_caching: self.enable_prefix_caching,
            allow_runtime_lora_updating: self.allow_runtime_lora_updating,
            vocab_size: cfg.vocab_size,
            eos_token_ids,
            generation,
        };
        Engine::start(config, model, kv, scheduler, store, text.tokenizer, (tx, rx, events))
    }

    /// The checks that need no file: startup adapters with LoRA off, a utilization outside (0, 1].
    fn check(&self) -> Result<()> {
        if self.max_loras == 0 && !self.loras.is_empty() {
            return Err(BuildError::LoraOff { adapters: self.loras.len() });
        }
        let value = self.gpu_memory_utilization;
        if !(value > 0.0 && value <= 1.0) {
            return Err(BuildError::GpuMemoryUtilization { value });
        }
        Ok(())
    }

    /// The checkpoint, opened (fetched for a hub id, with the tokenizer files of a Hugging Face
    /// repo).
    fn open(&self, source: &ModelSource, hub: &HubConfig) -> Result<Checkpoint> {
        let checkpoint = source.open(hub).map_err(BuildError::model)?;
        if let (ModelSource::Hub { repo, revision, .. }, Checkpoint::Safetensors(_)) = (source, &checkpoint) {
            // The tokenizer files and the generation defaults sit next to config.json in the
            // snapshot; fetch them too (a repo without one of them is not an error).
            for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"] {
                if let Err(e) = hub.file(repo, revision, f) {
                    tracing::debug!(repo = %repo, file = f, error = %e, "tokenizer file not fetched");
                }
            }
        }
        Ok(checkpoint)
    }

    /// The LoRA limits, built once: `max_loras`; `max_lora_rank` (default: the largest startup
    /// rank, else 16); the target modules (default: the seven projections plus whatever the
    /// startup adapters target). `max_loras` 0 is [`LoraLimits::off`]: from here on, "LoRA off" is
    /// that value, not a zero checked again.
    fn lora_limits(&self, cfg: &ModelConfig) -> Result<LoraLimits> {
        if self.max_loras == 0 {
            return Ok(LoraLimits::off());
        }
        let (startup_rank, startup_targets) = self.scan_startup(cfg)?;
        let max_lora_rank =
            self.max_lora_rank.unwrap_or(if startup_rank > 0 { startup_rank } else { DEFAULT_MAX_LORA_RANK });
        let targets = self.lora_target_modules.clone().unwrap_or_else(|| {
            let mut t = ModuleKind::PROJECTIONS.to_vec();
            t.extend(startup_targets.iter().copied().filter(|k| !ModuleKind::PROJECTIONS.contains(k)));
            t
        });
        Ok(LoraLimits::new(self.max_loras, max_lora_rank, &targets)?)
    }

    /// The adapter store over `store_cfg` (sized by the limits and the model), with the runtime
    /// update settings, resolvers and startup adapters (loaded here; the first that fails names
    /// itself), its load events sent down the loop's command channel.
    fn build_store(&mut self, store_cfg: StoreConfig, tx: &Sender<Command>, counter: &EventCount) -> Result<Store> {
        let mut store_cfg = store_cfg.allow_runtime_updates(self.allow_runtime_lora_updating);
        for root in &self.allowed_lora_roots {
            store_cfg = store_cfg.allowed_root(root.clone());
        }
        for repo in &self.allowed_lora_hub_repos {
            store_cfg = store_cfg.allowed_hub_repo(repo.clone());
        }
        let (events, count) = (tx.clone(), counter.clone());
        let mut store = Store::builder(store_cfg).events(move |ev| {
            count.sent();
            // The loop is gone only at shutdown, when no one waits for the event.
            if events.send(Command::Adapter(ev)).is_err() {
                count.taken();
            }
        });
        for add in std::mem::take(&mut self.resolvers.0) {
            store = add(store);
        }
        for (name, src) in &self.loras {
            let parsed = AdapterSource::parse(src).map_err(|e| BuildError::adapter_format(name, e))?;
            store = store.startup(name.clone(), parsed);
        }
        store.build().map_err(|e| match e {
            multilora_store::Error::Startup { name, source } => BuildError::adapter(&name, *source),
            other => BuildError::Store { source: Arc::new(other) },
        })
    }

    /// The KV cache's pools for `budget` bytes: one for every layer, or for a model whose layers
    /// mix a sliding window with full attention (Gemma 3), the sliding layers' own, as large as
    /// `max_num_seqs` requests each holding its window (and the two blocks it only partly fills)
    /// plus one step's tokens need, the full layers taking the rest
    /// ([`KvCacheConfig::for_budget_sliding`]: neither pool below one pool's blocks).
    fn kv_cache_config(
        &self,
        cfg: &ModelConfig,
        dtype: candle_core::DType,
        budget: u64,
        max_model_len: usize,
        step_tokens: usize,
    ) -> KvCacheConfig {
        let bs = self.block_size;
        match cfg.sliding_window.filter(|_| cfg.mixed_windows()) {
            Some(window) => {
                let chunk = step_tokens.min(max_model_len);
                let cap = SlidingKv::pool_blocks(window, bs, chunk, max_model_len, self.max_num_seqs);
                KvCacheConfig::for_budget_sliding(cfg, dtype, bs, budget, cap)
            }
            None => KvCacheConfig::for_budget(cfg, dtype, bs, budget),
        }
    }

    /// The scheduler over the blocks of `kv` (and its sliding layers' pool).
    fn build_scheduler(
        &self,
        lora: &LoraLimits,
        max_model_len: usize,
        kv: KvCacheConfig,
        cfg: &ModelConfig,
        step_tokens: usize,
    ) -> std::result::Result<Scheduler, multilora_scheduler::Error> {
        let sliding =
            kv.sliding_blocks.zip(cfg.sliding_window).map(|(num_blocks, window)| SlidingKv { window, num_blocks });
        let cfg = SchedulerConfig::default()
            .max_num_seqs(self.max_num_seqs)
            .max_num_batched_tokens(step_tokens)
            .step_time(self.step_time)
            .max_model_len(max_model_len)
            .max_loras(lora.max_loras())
            .max_prompt_logprob_rows(prompt_logprob_rows(cfg.vocab_size))
            .kv(KvConfig {
                num_blocks: kv.num_blocks,
                sliding,
                block_size: self.block_size,
                enable_prefix_caching: self.enable_prefix_caching,
                ..KvConfig::default()
            });
        Scheduler::new(cfg)
    }

    /// The served dtype, and whether GGUF weights stay quantized. `auto` (no dtype given) is the
    /// checkpoint's own: `torch_dtype` (f32 when `config.json` names none), or for a GGUF file
    /// its quantized tensors as they are (norms in f32; see `build` for its KV cache and slots). A
    /// dtype given for a GGUF file dequantizes every weight to it (`f32` is the reference path).
    fn resolve_dtype(&self, cfg: &ModelConfig, checkpoint: &Checkpoint) -> (DType, bool) {
        // `auto_dtype` is the checkpoint's `torch_dtype`, one of the three, else f32.
        let auto = || DType::from_candle(cfg.auto_dtype()).unwrap_or(DType::F32);
        match (self.dtype, checkpoint.gguf()) {
            (Some(dt), Some(_)) => (dt, false),
            (None, Some(_)) => (DType::F32, true),
            (dt, None) => (dt.unwrap_or_else(auto), false),
        }
    }

    /// The given `max_num_batched_tokens`, else the default: 2,048 on the CPU (llama.cpp's
    /// batch: a longer prompt in steps of 2,048 is faster than in fewer, larger ones, whose
    /// activations leave the caches — measured 15.4 s against 18.8 s for a 6,950-token SmolLM2
    /// prompt in steps of 2,048 and of 8,192), 8,192 on a GPU.
    fn batched_tokens(&self, cpu: bool) -> usize {
        self.max_num_batched_tokens.unwrap_or(if cpu { 2048 } else { 8192 })
    }

    /// The rows of a step that may give logits: every running sequence's, and the prompt rows of
    /// `prompt_logprobs`.
    fn logit_rows(&self, cfg: &ModelConfig) -> usize {
        self.max_num_seqs + prompt_logprob_rows(cfg.vocab_size)
    }

    /// The tokens a step carries (`max_num_batched_tokens`, on the CPU capped so that its
    /// activations stay within `step_memory_bytes`), what they take, and why.
    fn step_tokens(&self, model: &Model, max_model_len: usize) -> Result<StepBudget> {
        let (cfg, rows) = (model.config(), self.logit_rows(model.config()));
        let threads = model.device().is_cpu().then(rayon::current_num_threads);
        let bytes =
            |t: usize| multilora_models::step_activation_bytes(cfg, model.dtype(), t, rows, max_model_len, threads);
        let most = self.batched_tokens(model.device().is_cpu());
        if threads.is_none() || bytes(most) <= self.step_memory_bytes {
            let from = format!("max_num_batched_tokens {most}");
            return Ok(StepBudget { tokens: most, bytes: bytes(most), from });
        }
        if bytes(1) > self.step_memory_bytes {
            return Err(BuildError::StepMemory { budget: self.step_memory_bytes, one_token: bytes(1) });
        }
        // The largest count within the budget (the bytes grow with the tokens).
        let (mut lo, mut hi) = (1, most);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if bytes(mid) <= self.step_memory_bytes { lo = mid } else { hi = mid - 1 }
        }
        let from = format!("step_memory_bytes {} caps max_num_batched_tokens {most}", self.step_memory_bytes);
        Ok(StepBudget { tokens: lo, bytes: bytes(lo), from })
    }

    /// Bytes for the KV cache, where the figure came from (for the log and errors), and the
    /// context length served. The budget is the given `kv_cache_bytes` minus the slots; on a GPU
    /// without one, `gpu_memory_utilization` of the device minus what the weights and slots
    /// already hold and one step's activations; on the CPU without one, enough for one sequence
    /// of the model's full length, at least [`DEFAULT_KV_CACHE_BYTES`] and at most
    /// [`MAX_DEFAULT_KV_CACHE_BYTES`] (vLLM's CPU default), or exactly what an explicit
    /// `max_model_len` needs, plus the room for cached prefixes ([`EngineBuilder::cache_ram`]).
    /// When the budget (without that room) cannot hold one full-length sequence and no
    /// `max_model_len` was given, the context length is capped to what it holds and the cap is
    /// logged; an explicit `max_model_len` the budget cannot hold stays an error (the scheduler's).
    fn kv_budget(&self, model: &Model, slot_bytes: u64, limit: usize) -> Result<(u64, String, usize)> {
        const GIB: f64 = (1u64 << 30) as f64;
        let per_token = model.kv_bytes_per_token().max(1);
        let full = (limit.div_ceil(self.block_size) * self.block_size) as u64 * per_token;
        let (budget, from) = if let Some(bytes) = self.kv_cache_bytes {
            (bytes.saturating_sub(slot_bytes), format!("kv_cache_bytes {bytes} minus {slot_bytes} of lora slots"))
        } else if let Some(mem) = multilora_models::device_memory(model.device()).map_err(BuildError::model)? {
            let used = mem.total - mem.free;
            let activations = multilora_models::step_activation_bytes(
                model.config(),
                model.dtype(),
                self.batched_tokens(false),
                self.logit_rows(model.config()),
                limit,
                None,
            );
            let allowed = (mem.total as f64 * self.gpu_memory_utilization) as u64;
            let budget = allowed.saturating_sub(used).saturating_sub(activations);
            let from = format!(
                "gpu_memory_utilization {} of {:.1} GiB = {:.1} GiB, minus {:.1} GiB in use after weights and {:.2} \
                 GiB of slots, minus {:.1} GiB for a step of {} tokens",
                self.gpu_memory_utilization,
                mem.total as f64 / GIB,
                allowed as f64 / GIB,
                used as f64 / GIB,
                slot_bytes as f64 / GIB,
                activations as f64 / GIB,
                self.batched_tokens(false),
            );
            (budget, from)
        } else {
            let floor = DEFAULT_KV_CACHE_BYTES.saturating_sub(slot_bytes);
            let wanted = if self.max_model_len.is_some() { full } else { full.min(MAX_DEFAULT_KV_CACHE_BYTES) };
            let budget = floor.max(wanted);
            let from = if budget == floor {
                format!("the default {DEFAULT_KV_CACHE_BYTES} bytes minus {slot_bytes} of lora slots")
            } else {
                format!("one sequence of {limit} tokens at {per_token} bytes a token")
            };
            (budget, from)
        };
        // On the CPU without a pool given, the room for cached prefixes on top; `max_model_len`
        // stays what the running budget holds.
        let (tier, tier_from) = match self.kv_cache_bytes.is_none() && model.device().is_cpu() {
            true => self.cache_ram(),
            false => (0, String::new()),
        };
        let from = match tier {
            0 => from,
            _ => format!("{from}, plus cache_ram {tier} for cached prefixes ({tier_from})"),
        };
        let holds = (budget / per_token) as usize / self.block_size * self.block_size;
        let budget = budget + tier;
        if holds >= limit || self.max_model_len.is_some() || holds == 0 {
            return Ok((budget, from, limit));
        }
        tracing::warn!(
            model_limit = limit,
            max_model_len = holds,
            kv_budget = %from,
            "the kv cache holds {holds} tokens for running sequences, fewer than the model's {limit}: \
             max_model_len is capped to {holds} (give --max-model-len or --kv-cache-bytes to choose)"
        );
        Ok((budget, format!("{from}; max_model_len capped to the {holds} tokens it holds"), holds))
    }

    /// The CPU KV pool's room for cached prefixes, and where the figure came from: the given
    /// `cache_ram_bytes`, else an eighth of the machine's memory up to
    /// [`MAX_DEFAULT_CACHE_RAM_BYTES`]; none without prefix caching.
    fn cache_ram(&self) -> (u64, String) {
        if !self.enable_prefix_caching {
            return (0, "prefix caching off".into());
        }
        if let Some(bytes) = self.cache_ram_bytes {
            return (bytes, "given".into());
        }
        match multilora_cpu::host_memory::physical_bytes() {
            Some(total) => {
                let bytes = (total / 8).min(MAX_DEFAULT_CACHE_RAM_BYTES);
                (bytes, format!("an eighth of the machine's {total} bytes, at most {MAX_DEFAULT_CACHE_RAM_BYTES}"))
            }
            None => (0, "the machine's memory unknown".into()),
        }
    }

    /// Reads each startup adapter's config (no tensors): the largest rank and the modules
    /// targeted, so slots are sized before the model allocates them.
    fn scan_startup(&self, cfg: &ModelConfig) -> Result<(usize, Vec<ModuleKind>)> {
        let shapes = cfg.shapes();
        let opts = LoadOptions::new(candle_core::DType::F32);
        let (mut rank, mut kinds) = (0, Vec::new());
        for (name, src) in &self.loras {
            let summary = AdapterSource::parse(src)
                .and_then(|source| multilora_adapter::read_source_config(name, &source, &shapes, &opts))
                .map_err(|e| BuildError::adapter_format(name, e))?;
            rank = rank.max(summary.max_rank());
            for id in summary.modules.keys() {
                if !kinds.contains(&id.kind) {
                    kinds.push(id.kind);
                }
            }
        }
        Ok((rank, kinds))
    }
}

/// How the base weights are held, for the log and `/v1/models`: the file's tensor types and
/// whether they were kept quantized, and the bytes they take.
fn weights_description(checkpoint: &Checkpoint, model: &Model, quantized: bool) -> String {
    let mib = model.weight_bytes() as f64 / (1u64 << 20) as f64;
    match checkpoint.gguf() {
        Some(g) => {
            let types: Vec<String> = g.tensor_types().iter().map(|(t, n)| format!("{t} x{n}")).collect();
            let how =
                if quantized { "kept quantized".to_string() } else { format!("dequantized to {:?}", model.dtype()) };
            format!("GGUF {} ({how}, {mib:.1} MiB)", types.join(", "))
        }
        None => format!("safetensors, {:?} ({mib:.1} MiB)", model.dtype()),
    }
}

/// Bytes the logits of one request's prompt-logprob chunk may take: f32 rows over the
/// vocabulary, their copy on the host and their log-softmax.
const PROMPT_LOGITS_BYTES: usize = 256 << 20;

/// Prompt tokens a step computes of a request that wants prompt logprobs, so that its logit rows
/// stay within [`PROMPT_LOGITS_BYTES`] (85 rows for Gemma 3's 262,144-entry vocabulary, 455 for
/// SmolLM2's 49,152), at least one.
/// A step's tokens and the bytes its activations take ([`EngineBuilder::step_tokens`]).
struct StepBudget {
    tokens: usize,
    bytes: u64,
    from: String,
}

fn prompt_logprob_rows(vocab_size: usize) -> usize {
    (PROMPT_LOGITS_BYTES / (12 * vocab_size.max(1))).max(1)
}

/// The engine's spelling of a dtype the model chose (slots, KV cache): always one the engine
/// serves in; anything else is the model's error, not a silent substitute.
fn served_dtype(dtype: candle_core::DType) -> Result<DType> {
    DType::from_candle(dtype).ok_or_else(|| {
        let e: Box<dyn std::error::Error + Send + Sync> = format!("the model chose dtype {dtype:?}").into();
        BuildError::Model(Arc::from(e))
    })
}
