//! The Llama-family decoder: embeddings, `num_layers` × (RMSNorm → attention → RMSNorm → SiLU MLP),
//! final norm and `lm_head`, every projection a `LoraLinear` so each token gets its own adapter;
//! Qwen3 adds an RMSNorm over each query and key head before RoPE; Phi-3's checkpoints store the
//! fused weights already (`qkv_proj`, `gate_up_proj`), cut into the same parts when loaded.
//!
//! q/k/v are fused into one `[q + 2·kv, hidden]` weight and gate/up into one `[2·inter, hidden]`
//! weight: one GEMM each per step for the whole flat batch. The fused layers keep one slot buffer
//! per PEFT module (`q_proj`, `k_proj`, …), so adapters find their slots by PEFT name.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{LoraAdapter, ModelShapes, ModuleId};
use multilora_adapter::{embedding_digest_of_rows, with_embedding_digest};
use multilora_layers::{GreedyPick, LinearWeight, LoraEmbedding, LoraLinear, ReadAhead, SlotConfig};
use multilora_types::{LoraLimits, ModuleKind, SlotId};

use crate::batch::{Batch, Limits, StepPlan};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvCacheConfig, kv_bytes_per_token};
use crate::rope::Rope;
use crate::weights::{Checkpoint, CheckpointFiles, ModelSource, Weights};
use multilora_adapter::HubConfig;
use row_group::RowGroup;

mod row_group;

/// How to load a model.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ModelOptions {
    /// The dtype the model is served in (f32 by default; bf16/f16 allowed): its weights and its
    /// KV cache. On CUDA the activations are in it too; on the CPU they are f32 (the kernels
    /// widen half-precision weights as they read them and accumulate in f32).
    pub dtype: DType,
    /// Where the model runs.
    pub device: Device,
    /// Adapter slots (distinct adapters per step), the rank they hold, and the modules that get
    /// slot buffers (adapters targeting anything else are refused at `write_slot`);
    /// [`LoraLimits::off`] builds no LoRA buffers at all.
    pub lora: LoraLimits,
    /// Dtype of the slot buffers; when `None`, the model dtype, or f16 for a GGUF file kept
    /// quantized on the CPU (llama.cpp's LoRA files are f16).
    pub lora_dtype: Option<DType>,
    /// Dtype of the KV cache; when `None`, the model dtype, or f16 for a GGUF file kept quantized
    /// on the CPU (llama.cpp's default cache). On the CPU any of f32, bf16 and f16 (keys and
    /// values are rounded to it as they are written, widened as they are read); on CUDA only the
    /// model dtype.
    pub kv_dtype: Option<DType>,
    /// The hub cache used for repo ids.
    pub hub: HubConfig,
    /// GGUF weights stored quantized stay quantized (the default: resident ≈ the file, products
    /// on the quantized kernels); `false` dequantizes them to `dtype` when loading (the
    /// reference path). Checkpoints of other formats are unaffected.
    pub quantized: bool,
}

impl Default for ModelOptions {
    fn default() -> ModelOptions {
        ModelOptions {
            dtype: DType::F32,
            device: Device::Cpu,
            lora: LoraLimits::default(),
            lora_dtype: None,
            kv_dtype: None,
            hub: HubConfig::from_env(),
            quantized: true,
        }
    }
}

impl ModelOptions {
    /// Sets the dtype.
    pub fn dtype(mut self, dtype: DType) -> ModelOptions {
        self.dtype = dtype;
        self
    }

    /// Sets the device.
    pub fn device(mut self, device: Device) -> ModelOptions {
        self.device = device;
        self
    }

    /// Sets the LoRA limits (`max_loras`, `max_lora_rank`, `lora_target_modules`).
    pub fn lora(mut self, limits: LoraLimits) -> ModelOptions {
        self.lora = limits;
        self
    }

    /// Sets `lora_dtype`.
    pub fn lora_dtype(mut self, dtype: DType) -> ModelOptions {
        self.lora_dtype = Some(dtype);
        self
    }

    /// Sets `kv_dtype`.
    pub fn kv_dtype(mut self, dtype: DType) -> ModelOptions {
        self.kv_dtype = Some(dtype);
        self
    }

    /// Sets the hub cache.
    pub fn hub(mut self, hub: HubConfig) -> ModelOptions {
        self.hub = hub;
        self
    }

    /// Keeps GGUF weights quantized (`true`, the default) or dequantizes them to `dtype`.
    pub fn quantized(mut self, quantized: bool) -> ModelOptions {
        self.quantized = quantized;
        self
    }
}

#[derive(Debug)]
struct Layer {
    qkv: LoraLinear,
    o: LoraLinear,
    gate_up: LoraLinear,
    down: LoraLinear,
    input_norm: Tensor,
    post_norm: Tensor,
    /// Qwen3's RMSNorm weights over each query and each key head (`[head_dim]`), applied before
    /// RoPE.
    qk_norm: Option<(Tensor, Tensor)>,
    /// Gemma's norms of the attention's and the MLP's outputs (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`), before each residual add.
    sandwich: Option<(Tensor, Tensor)>,
}

/// A loaded Llama-family model with LoRA slots.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    dtype: DType,
    /// Activations: `dtype` on CUDA, f32 on the CPU.
    act_dtype: DType,
    lora_dtype: DType,
    kv_dtype: DType,
    device: Device,
    lora: LoraLimits,
    embed: LoraEmbedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: LoraLinear,
    rope: Rope,
    /// The sliding layers' tables when their base differs (Gemma 3).
    rope_local: Option<Rope>,
    /// Gemma's embedding factor √hidden as a one-value tensor of the activations' dtype (rounded
    /// to it first, as transformers makes it a tensor of that dtype).
    embed_scale: Option<Tensor>,
    shapes: ModelShapes,
    /// The logits' way back to the host (a kept page-locked buffer on CUDA).
    readback: multilora_layers::RowsToHost,
    /// Each step's small integer tables to the device, in one copy (page-locked on CUDA).
    upload: multilora_layers::MetaToDevice,
}

impl Model {
    /// Loads from a directory, a GGUF file or a hub id (`org/name[@rev]`).
    pub fn load(source: &ModelSource, opts: &ModelOptions) -> Result<Model> {
        Model::load_checkpoint(&source.open(&opts.hub)?, opts)
    }

    /// Loads an opened checkpoint (see [`ModelSource::open`]).
    pub fn load_checkpoint(checkpoint: &Checkpoint, opts: &ModelOptions) -> Result<Model> {
        match checkpoint {
            Checkpoint::Safetensors(files) => Model::load_files(files, opts),
            Checkpoint::Gguf(g) => {
                let cfg = g.config()?;
                let w = Weights::gguf(g.clone(), &cfg, activation_dtype(opts), &opts.device);
                Model::build(cfg, &w, opts)
            }
        }
    }

    /// Loads from a local directory holding `config.json` and safetensors.
    pub fn load_dir(dir: &std::path::Path, opts: &ModelOptions) -> Result<Model> {
        Model::load_files(&CheckpointFiles::from_dir(dir)?, opts)
    }

    /// Loads from resolved checkpoint files.
    pub fn load_files(files: &CheckpointFiles, opts: &ModelOptions) -> Result<Model> {
        let cfg = ModelConfig::from_file(&files.config)?;
        let w = Weights::open(files, activation_dtype(opts), &opts.device)?;
        Model::build(cfg, &w, opts)
    }

    /// Builds a model from tensors already in memory, named as in a Hugging Face checkpoint
    /// (benches and tests use it for random models without writing a file).
    pub fn from_tensors(cfg: ModelConfig, tensors: HashMap<String, Tensor>, opts: &ModelOptions) -> Result<Model> {
        let w = Weights::in_memory(tensors, activation_dtype(opts), &opts.device);
        Model::build(cfg, &w, opts)
    }

    fn build(cfg: ModelConfig, w: &Weights, opts: &ModelOptions) -> Result<Model> {
        // One stream does all of the model's work on a GPU: cudarc's cross-stream event tracking
        // only adds driver calls to every allocation and kernel operand (weights made from here
        // on), and freed memory stays in the pool for the next step.
        #[cfg(feature = "cuda")]
        multilora_layers::prepare_cuda_device(&opts.device)?;
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (wdt, act) = (opts.dtype, activation_dtype(opts));
        // llama.cpp's defaults for a GGUF file kept quantized on the CPU: an f16 cache and f16
        // LoRA weights (half the bytes a step reads and the cache holds).
        let half = if w.is_gguf() && opts.quantized && opts.device.is_cpu() { DType::F16 } else { wdt };
        let (kv_dtype, lora_dtype) = (opts.kv_dtype.unwrap_or(half), opts.lora_dtype.unwrap_or(half));
        let cpu_kv = matches!(kv_dtype, DType::F32 | DType::BF16 | DType::F16);
        if (opts.device.is_cpu() && !cpu_kv) || (!opts.device.is_cpu() && kv_dtype != wdt) {
            return Err(Error::KvCache {
                reason: format!(
                    "a {kv_dtype:?} cache for a {wdt:?} model on {:?}: the CPU holds it in f32, bf16 or f16, CUDA \
                     in the model dtype",
                    opts.device.location()
                ),
            });
        }
        // The projections' weights in the served dtype, or quantized blocks (norms and biases in
        // the activations' dtype).
        let mat = |name: &str, shape: &[usize]| w.linear(name, shape, wdt, opts.quantized);
        // An RMSNorm weight as the forward multiplies by it: Gemma's `(1 + w)` made once here.
        let norm_w = |name: &str, n: usize| -> Result<Tensor> {
            let t = w.get(name, &[n])?;
            Ok(if cfg.norm_offset != 0.0 { (t + cfg.norm_offset as f64)? } else { t })
        };
        let (qs, kvs) = (cfg.q_size(), cfg.kv_size());
        let lora = &opts.lora;
        let slot_cfg = SlotConfig::new(lora.max_loras(), lora.max_lora_rank(), lora_dtype, &opts.device);
        let lora_for = |kinds: &[ModuleKind]| kinds.iter().any(|&k| lora.targets(k)).then_some(&slot_cfg);
        let (embed_w, shapes) = embedding(&cfg, w, opts)?;
        let embed =
            LoraEmbedding::from_weight(embed_w.clone(), lora_for(&[ModuleKind::EmbedTokens]))?.output_dtype(act);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let id = |k| ModuleId::layer(l, k);
            // Phi-3 stores q/k/v (and gate/up) fused: cut into the parts the layers keep.
            let qkv_w = match cfg.fused_projections {
                true => {
                    w.linear_parts(&format!("{p}.self_attn.qkv_proj.weight"), &[qs, kvs, kvs], h, wdt, opts.quantized)?
                }
                false => vec![
                    mat(&format!("{p}.self_attn.q_proj.weight"), &[qs, h])?,
                    mat(&format!("{p}.self_attn.k_proj.weight"), &[kvs, h])?,
                    mat(&format!("{p}.self_attn.v_proj.weight"), &[kvs, h])?,
                ],
            };
            let qkv_b = if cfg.attention_bias {
                Some(Tensor::cat(
                    &[
                        w.get(&format!("{p}.self_attn.q_proj.bias"), &[qs])?,
                        w.get(&format!("{p}.self_attn.k_proj.bias"), &[kvs])?,
                        w.get(&format!("{p}.self_attn.v_proj.bias"), &[kvs])?,
                    ],
                    0,
                )?)
            } else {
                None
            };
            let qkv_kinds = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj];
            let qkv = LoraLinear::from_parts(
                qkv_w,
                qkv_b,
                vec![(id(ModuleKind::QProj), qs), (id(ModuleKind::KProj), kvs), (id(ModuleKind::VProj), kvs)],
                lora_for(&qkv_kinds),
            )?;
            let o_b = if cfg.attention_bias && w.contains(&format!("{p}.self_attn.o_proj.bias")) {
                Some(w.get(&format!("{p}.self_attn.o_proj.bias"), &[h])?)
            } else {
                None
            };
            let o = LoraLinear::from_weight(
                mat(&format!("{p}.self_attn.o_proj.weight"), &[h, qs])?,
                o_b,
                vec![(id(ModuleKind::OProj), h)],
                lora_for(&[ModuleKind::OProj]),
            )?;
            let gate_up_w = match cfg.fused_projections {
                true => w.linear_parts(&format!("{p}.mlp.gate_up_proj.weight"), &[i, i], h, wdt, opts.quantized)?,
                false => vec![
                    mat(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                    mat(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
                ],
            };
            let gate_up = LoraLinear::from_parts(
                gate_up_w,
                None,
                vec![(id(ModuleKind::GateProj), i), (id(ModuleKind::UpProj), i)],
                lora_for(&[ModuleKind::GateProj, ModuleKind::UpProj]),
            )?;
            let down = LoraLinear::from_weight(
                mat(&format!("{p}.mlp.down_proj.weight"), &[h, i])?,
                None,
                vec![(id(ModuleKind::DownProj), h)],
                lora_for(&[ModuleKind::DownProj]),
            )?;
            layers.push(Layer {
                qkv,
                o,
                gate_up,
                down,
                input_norm: norm_w(&format!("{p}.input_layernorm.weight"), h)?,
                // Gemma's MLP input norm is `pre_feedforward_layernorm`; its
                // `post_attention_layernorm` norms the attention's output.
                post_norm: match cfg.sandwich_norms {
                    true => norm_w(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
                    false => norm_w(&format!("{p}.post_attention_layernorm.weight"), h)?,
                },
                qk_norm: match cfg.qk_norm {
                    true => Some((
                        norm_w(&format!("{p}.self_attn.q_norm.weight"), cfg.head_dim)?,
                        norm_w(&format!("{p}.self_attn.k_norm.weight"), cfg.head_dim)?,
                    )),
                    false => None,
                },
                sandwich: match cfg.sandwich_norms {
                    true => Some((
                        norm_w(&format!("{p}.post_attention_layernorm.weight"), h)?,
                        norm_w(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
                    )),
                    false => None,
                },
            });
        }
        let norm = norm_w("model.norm.weight", h)?;
        // A tied head shares the embedding's storage; a checkpoint that also stores `lm_head`
        // for a tied model is read from the embedding all the same, as transformers does.
        let head_slices = vec![(ModuleId::lm_head(), v)];
        let head_lora = lora_for(&[ModuleKind::LmHead]);
        let lm_head = match (cfg.tie_word_embeddings, embed_w) {
            // A dense tied head reads the embedding's tensor in place; quantized blocks are
            // shared by reference either way.
            (true, LinearWeight::Dense(t)) => LoraLinear::new_shared(t, None, head_slices, head_lora)?,
            (true, shared) => LoraLinear::from_weight(shared, None, head_slices, head_lora)?,
            (false, _) => LoraLinear::from_weight(mat("lm_head.weight", &[v, h])?, None, head_slices, head_lora)?,
        };
        let rope = Rope::new(&cfg, false, act, &opts.device)?;
        let embed_scale = cfg.embed_scale.map(|s| Tensor::new(&[s], &opts.device)?.to_dtype(act)).transpose()?;
        let rope_local = match cfg.rope_local_theta {
            Some(t) if t != cfg.rope_theta => Some(Rope::new(&cfg, true, act, &opts.device)?),
            _ => None,
        };
        Ok(Model {
            cfg,
            dtype: wdt,
            act_dtype: act,
            lora_dtype,
            kv_dtype,
            device: opts.device.clone(),
            lora: opts.lora.clone(),
            embed,
            layers,
            norm,
            lm_head,
            rope,
            rope_local,
            embed_scale,
            shapes,
            readback: multilora_layers::RowsToHost::new(),
            upload: multilora_layers::MetaToDevice::new(),
        })
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// What adapters are validated against, with the digest of the base embedding.
    pub fn shapes(&self) -> &ModelShapes {
        &self.shapes
    }

    /// The dtype the model is served in: its weights and KV cache.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype of the activations: [`Model::dtype`] on CUDA, f32 on the CPU.
    pub fn activation_dtype(&self) -> DType {
        self.act_dtype
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Number of adapter slots.
    pub fn max_loras(&self) -> usize {
        self.lora.max_loras()
    }

    /// The modules that hold slot buffers.
    pub fn lora_target_modules(&self) -> &[ModuleKind] {
        self.lora.target_modules()
    }

    /// The dtype of the slot buffers.
    pub fn lora_dtype(&self) -> DType {
        self.lora_dtype
    }

    /// The dtype of the KV cache.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Bytes of K and V per token over all layers, in the KV cache's dtype.
    pub fn kv_bytes_per_token(&self) -> u64 {
        kv_bytes_per_token(&self.cfg, self.kv_dtype)
    }

    /// Bytes held by all LoRA slot buffers (every slot, at `max_lora_rank`).
    pub fn lora_slot_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let mut total: u64 = self.embed.lora_slots().map(|s| bytes(s.a()) + bytes(s.b())).unwrap_or(0);
        let linears = self.layers.iter().flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]).chain([&self.lm_head]);
        for lin in linears {
            total += lin.lora_slots().unwrap_or(&[]).iter().map(|s| bytes(s.a()) + bytes(s.b())).sum::<u64>();
        }
        total
    }

    /// Whether decode rows attend with the paged CUDA kernel (on CUDA, for the head sizes and
    /// dtypes it is built for); otherwise the CPU reads the cache in place (any dtype) or the
    /// contexts are gathered with tensor ops.
    pub fn paged_decode(&self) -> bool {
        let dims = multilora_layers::PagedDecodeDims {
            heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            block_size: 1,
        };
        // The CUDA kernel reads whole contexts: a sliding window lists its rows instead.
        self.device.is_cuda() && dims.kernel_supported(self.dtype) && self.cfg.sliding_window.is_none_or(|w| w == 0)
    }

    /// How decode attention runs, in words (for the start-up log).
    pub fn decode_attention(&self) -> &'static str {
        match (self.paged_decode(), self.device.is_cpu()) {
            (true, _) => "paged CUDA kernel (block tables read on the device)",
            (false, true) => "CPU, reading the paged cache in place",
            _ => "contexts gathered with tensor ops",
        }
    }

    /// Which kernel each path of a step runs, in words (for the start-up log and benches): on
    /// the CPU the instruction set picked at run time for the base products and the LoRA
    /// products, with the dtypes they read.
    pub fn kernels(&self) -> String {
        if !self.device.is_cpu() {
            return format!("{:?} weights, {:?} slots on {:?}", self.dtype, self.lora_dtype, self.device.location());
        }
        let isa = multilora_cpu::Isa::best();
        let mut bases: Vec<String> = Vec::new();
        for lin in self.layers.iter().flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]).chain([&self.lm_head]) {
            let k = lin.base_kernel();
            if !bases.contains(&k) {
                bases.push(k);
            }
        }
        format!(
            "base products {isa:?} over {}, LoRA products {isa:?} over {:?} slots, \
             f32 activations and accumulation, decode attention in place over a {:?} KV cache",
            bases.join("; "),
            self.lora_dtype,
            self.kv_dtype
        )
    }

    /// Bytes the weights hold in memory (quantized blocks as they are, tensors at their dtype;
    /// a tied `lm_head` counted once).
    pub fn weight_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let mut total = match self.embed.table() {
            LinearWeight::Dense(t) => bytes(t),
            LinearWeight::Quant(q) => q.storage_bytes() as u64,
            LinearWeight::Device(q) => q.storage_size_in_bytes() as u64,
        };
        for l in &self.layers {
            total += [&l.qkv, &l.o, &l.gate_up, &l.down].iter().map(|lin| lin.base_bytes() as u64).sum::<u64>();
            total += bytes(&l.input_norm) + bytes(&l.post_norm);
            total += l.qk_norm.as_ref().map_or(0, |(q, k)| bytes(q) + bytes(k));
            total += l.sandwich.as_ref().map_or(0, |(a, m)| bytes(a) + bytes(m));
        }
        if !self.cfg.tie_word_embeddings {
            total += self.lm_head.base_bytes() as u64;
        }
        total + bytes(&self.norm)
    }

    /// A zeroed KV cache for this model.
    pub fn new_kv_cache(&self, config: KvCacheConfig) -> Result<KvCache> {
        KvCache::new(&self.cfg, config, self.kv_dtype, &self.device)
    }

    /// Runs one step: writes the new tokens' K/V into their blocks and returns f32 logits
    /// `[batch.num_logit_rows(), vocab]`, rows in sequence order.
    pub fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Tensor> {
        // On the CPU the pool's other threads wait for the step's parallel regions awake (on the
        // global pool when called from outside any).
        if self.device.is_cpu() {
            return multilora_cpu::pool::with_hot_pool(|| self.step(batch, cache));
        }
        self.step(batch, &*cache)
    }

    /// [`Model::forward`]'s body: the layers as one row group, or a decode step's rows as the
    /// groups the pool cuts it into side by side (`row_group`), then `lm_head` over the rows that
    /// give logits.
    fn step(&self, batch: &Batch, cache: &KvCache) -> Result<Tensor> {
        cache.check(&self.cfg, self.kv_dtype)?;
        let lim = self.limits(cache);
        let rows = match row_group::groups(self, batch) {
            Some(groups) => row_group::side_by_side(self, cache, batch, groups)?,
            None => {
                let plan = StepPlan::new(batch, lim, &self.device, &self.upload)?;
                let mut one = RowGroup::new(self, cache, &plan)?;
                for l in 0..self.layers.len() {
                    one.write(l)?;
                    one.read(l)?;
                }
                one.finish()?.map(|x| (x, plan.logit_mapping))
            }
        };
        let Some((x, mapping)) = rows else {
            return Ok(Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device)?);
        };
        Ok(self.lm_head.forward_ahead(&x, &mapping, &mut ReadAhead::new())?.to_dtype(DType::F32)?)
    }

    /// How many row groups `batch` runs as when [`Model::forward`] is called here (in the same
    /// rayon pool): on the CPU as many as the pool cuts a decode step of its rows into
    /// (`multilora_cpu::pool::row_groups`: each thread takes a group through every layer alone),
    /// else 1.
    pub fn row_groups(&self, batch: &Batch) -> usize {
        row_group::groups(self, batch).map_or(1, |(_, cuts)| cuts.len())
    }

    /// What a step's batch is checked against, for a step over `cache`.
    fn limits(&self, cache: &KvCache) -> Limits {
        let kc = cache.config();
        Limits {
            vocab: self.cfg.vocab_size,
            max_len: self.cfg.max_model_len(),
            max_loras: self.lora.max_loras(),
            num_blocks: kc.num_blocks,
            sliding_blocks: kc.sliding_blocks,
            block_size: kc.block_size,
            paged_decode: self.paged_decode(),
            window: self.cfg.sliding_window.filter(|&w| w > 0),
            mixed_windows: self.cfg.mixed_windows(),
            long_rope: Rope::long_rows(&self.cfg),
        }
    }

    /// [`Model::forward`]'s logits on the host, a `Vec` per row (on CUDA through a page-locked
    /// buffer the model keeps, so the copy runs at the link's speed).
    pub fn logits_to_host(&self, logits: &Tensor) -> Result<Vec<Vec<f32>>> {
        Ok(self.readback.read(logits)?)
    }

    /// Whether [`Model::greedy_on_device`] picks on this model's device (CUDA).
    pub fn picks_on_device(&self) -> bool {
        self.device.is_cuda()
    }

    /// On CUDA, `rows` of [`Model::forward`]'s logits picked greedily on the device with their
    /// logprobs (one launch; 8 bytes a row come back); `None` elsewhere.
    pub fn greedy_on_device(&self, logits: &Tensor, rows: &[usize]) -> Result<Option<Vec<GreedyPick>>> {
        Ok(multilora_layers::greedy_rows(logits, rows)?)
    }

    /// [`Model::logits_to_host`] but for the rows in `skip` (picked on the device), which come
    /// back empty and are never copied.
    pub fn logits_to_host_except(&self, logits: &Tensor, skip: &[usize]) -> Result<Vec<Vec<f32>>> {
        if skip.is_empty() {
            return self.logits_to_host(logits);
        }
        let n = logits.dim(0)?;
        let mut skipped = vec![false; n];
        for &r in skip {
            let Some(s) = skipped.get_mut(r) else {
                return Err(Error::Layer(multilora_layers::Error::InvalidLayer {
                    module: "logits".into(),
                    reason: format!("row {r} of {n} logit rows skipped"),
                }));
            };
            *s = true;
        }
        let kept: Vec<u32> = (0..n as u32).filter(|&r| !skipped[r as usize]).collect();
        let mut read = if kept.is_empty() {
            Vec::new()
        } else {
            let len = kept.len();
            let idx = Tensor::from_vec(kept, len, logits.device())?;
            self.readback.read(&logits.index_select(&idx, 0)?)?
        }
        .into_iter();
        Ok(skipped.iter().map(|&s| if s { Vec::new() } else { read.next().unwrap_or_default() }).collect())
    }

    /// Places `adapter` in `slot` at every LoRA site, zeroing the modules it does not target.
    /// An adapter that targets a module without slot buffers is refused before anything is
    /// written; if a later write fails, the slot is cleared so no half-written adapter remains.
    pub fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> Result<()> {
        if let Some(id) = adapter.modules().keys().find(|id| !self.lora.targets(id.kind)) {
            return Err(Error::NotATarget { adapter: adapter.name().to_string(), module: id.peft_name() });
        }
        // PEFT adds an embedding LoRA's rows after Gemma's scale, which the embedding op here
        // would scale with the base rows.
        if self.cfg.embed_scale.is_some() && adapter.modules().keys().any(|id| id.kind == ModuleKind::EmbedTokens) {
            return Err(Error::NotATarget {
                adapter: adapter.name().to_string(),
                module: "model.embed_tokens (on a scaled embedding: not served yet)".to_string(),
            });
        }
        // Off the CPU, the adapter goes to the device in one copy; the sites copy from there.
        let staged = multilora_layers::stage_adapter(adapter, self.lora_dtype, &self.device)?;
        let written = self.for_each_site(|site| site.write(slot.index(), &staged));
        if written.is_err() {
            // Best effort: the write error is the one worth reporting.
            let _ = self.clear_slot(slot);
        }
        written
    }

    /// Zeroes `slot` at every LoRA site.
    pub fn clear_slot(&mut self, slot: SlotId) -> Result<()> {
        self.for_each_site(|site| site.clear(slot.index()))
    }

    fn for_each_site(&mut self, mut f: impl FnMut(Site<'_>) -> multilora_layers::Result<()>) -> Result<()> {
        if self.embed.has_lora() {
            f(Site::Embedding(&mut self.embed))?;
        }
        for layer in &mut self.layers {
            for lin in [&mut layer.qkv, &mut layer.o, &mut layer.gate_up, &mut layer.down] {
                if lin.has_lora() {
                    f(Site::Linear(lin))?;
                }
            }
        }
        if self.lm_head.has_lora() {
            f(Site::Linear(&mut self.lm_head))?;
        }
        Ok(())
    }
}

/// One LoRA site, so slot writes and clears walk the model once.
enum Site<'a> {
    Embedding(&'a mut LoraEmbedding),
    Linear(&'a mut LoraLinear),
}

impl Site<'_> {
    fn write(self, slot: usize, adapter: &LoraAdapter) -> multilora_layers::Result<()> {
        match self {
            Site::Embedding(e) => e.write_slot(slot, adapter),
            Site::Linear(l) => l.write_slot(slot, adapter),
        }
    }

    fn clear(self, slot: usize) -> multilora_layers::Result<()> {
        match self {
            Site::Embedding(e) => e.clear_slot(slot),
            Site::Linear(l) => l.clear_slot(slot),
        }
    }
}

impl multilora_adapter::SlotSink for Model {
    fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> multilora_adapter::Result<()> {
        Model::write_slot(self, slot, adapter).map_err(|e| into_adapter_error(e, slot, adapter.name()))
    }

    fn clear_slot(&mut self, slot: SlotId) -> multilora_adapter::Result<()> {
        Model::clear_slot(self, slot).map_err(|e| into_adapter_error(e, slot, ""))
    }
}

fn into_adapter_error(e: Error, slot: SlotId, adapter: &str) -> multilora_adapter::Error {
    match e {
        Error::Layer(e) => e.into(),
        other => multilora_adapter::Error::SlotWrite {
            slot: slot.index(),
            adapter: adapter.to_string(),
            source: Box::new(other),
        },
    }
}

/// The activations' dtype for `opts`: the served dtype on CUDA, f32 on the CPU (where the kernels
/// read half-precision weights and KV in place and accumulate in f32).
fn activation_dtype(opts: &ModelOptions) -> DType {
    if opts.device.is_cpu() { DType::F32 } else { opts.dtype }
}

/// The input embedding in the served form (a tensor in the model dtype on the device, or
/// quantized blocks), and the shapes adapters are checked against, with the digest of the
/// embedding's values as stored: adapters carry the embedding as saved, and must match it
/// whatever dtype the model runs in (a quantized table's values are ggml's dequantized ones,
/// what a model converted from the file holds).
fn embedding(cfg: &ModelConfig, w: &Weights, opts: &ModelOptions) -> Result<(LinearWeight, ModelShapes)> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let name = "model.embed_tokens.weight";
    match w.linear(name, &[v, h], opts.dtype, opts.quantized)? {
        LinearWeight::Dense(_) => {
            let stored = w.get_as_stored(name, &[v, h])?;
            let shapes = with_embedding_digest(cfg.shapes(), &stored)?;
            Ok((LinearWeight::Dense(stored.to_dtype(opts.dtype)?.to_device(&opts.device)?), shapes))
        }
        quantized => {
            const ROWS: usize = 1024;
            let blocks = (0..v).step_by(ROWS).map(|r0| {
                let ids: Vec<u32> = (r0..(r0 + ROWS).min(v)).map(|r| r as u32).collect();
                match &quantized {
                    LinearWeight::Quant(q) => {
                        q.dequantize_rows(&ids).map_err(|e| candle_core::Error::Msg(e.to_string()))
                    }
                    other => other
                        .dense()
                        .and_then(|t| Ok(t.narrow(0, r0, ids.len())?.to_device(&Device::Cpu)?))
                        .map_err(|e| candle_core::Error::Msg(e.to_string())),
                }
            });
            let mut shapes = cfg.shapes();
            shapes.embed_digest = Some(embedding_digest_of_rows(blocks)?);
            shapes.embed_dtype = Some(DType::F32);
            Ok((quantized, shapes))
        }
    }
}
