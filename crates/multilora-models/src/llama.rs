//! The Llama-family decoder: embeddings, `num_layers` × (RMSNorm → attention → RMSNorm → SiLU MLP),
//! final norm and `lm_head`, every projection a `LoraLinear` so each token gets its own adapter.
//!
//! q/k/v are fused into one `[q + 2·kv, hidden]` weight and gate/up into one `[2·inter, hidden]`
//! weight: one GEMM each per step for the whole flat batch. The fused layers keep one slot buffer
//! per PEFT module (`q_proj`, `k_proj`, …), so adapters find their slots by PEFT name.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use multilora_layers::{
    LoraAdapter, LoraEmbedding, LoraLinear, ModelShapes, ModuleId, ModuleKind, SlotConfig, with_embedding_digest,
};
use multilora_types::{LoraLimits, SlotId};

use crate::attention::{AttnDims, paged_attention, write_kv};
use crate::batch::{Batch, Limits, StepPlan};
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvCacheConfig, kv_bytes_per_token};
use crate::rope::Rope;
use crate::weights::{CheckpointFiles, ModelSource, Weights};
use multilora_layers::HubConfig;
use multilora_layers::{HiddenAct, ModelConfig};

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
    /// Dtype of the slot buffers; the model dtype when `None`.
    pub lora_dtype: Option<DType>,
    /// The hub cache used for repo ids.
    pub hub: HubConfig,
}

impl Default for ModelOptions {
    fn default() -> ModelOptions {
        ModelOptions {
            dtype: DType::F32,
            device: Device::Cpu,
            lora: LoraLimits::default(),
            lora_dtype: None,
            hub: HubConfig::from_env(),
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

    /// Sets the hub cache.
    pub fn hub(mut self, hub: HubConfig) -> ModelOptions {
        self.hub = hub;
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
}

/// A loaded Llama-family model with LoRA slots.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    dtype: DType,
    /// Activations: `dtype` on CUDA, f32 on the CPU.
    act_dtype: DType,
    lora_dtype: DType,
    device: Device,
    lora: LoraLimits,
    embed: LoraEmbedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: LoraLinear,
    rope: Rope,
    shapes: ModelShapes,
}

impl Model {
    /// Loads from a directory or a hub id (`org/name[@rev]`).
    pub fn load(source: &ModelSource, opts: &ModelOptions) -> Result<Model> {
        let files = source.resolve(&opts.hub)?;
        Model::load_files(&files, opts)
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
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (wdt, act) = (opts.dtype, activation_dtype(opts));
        // The projections' weights in the served dtype (norms and biases in the activations').
        let mat = |name: &str, shape: &[usize]| w.get_in(name, shape, wdt);
        let (qs, kvs) = (cfg.q_size(), cfg.kv_size());
        let lora = &opts.lora;
        let slot_cfg = SlotConfig::new(
            lora.max_loras(),
            lora.max_lora_rank(),
            opts.lora_dtype.unwrap_or(opts.dtype),
            &opts.device,
        );
        let lora_for = |kinds: &[ModuleKind]| kinds.iter().any(|&k| lora.targets(k)).then_some(&slot_cfg);
        // The digest is taken over the checkpoint's values, not the converted ones: adapters carry
        // the embedding as saved, and must match it whatever dtype the model runs in.
        let embed_stored = w.get_as_stored("model.embed_tokens.weight", &[v, h])?;
        let shapes = model_shapes(&cfg, &embed_stored)?;
        let embed_w = embed_stored.to_dtype(wdt)?.to_device(&opts.device)?;
        drop(embed_stored);
        let embed = LoraEmbedding::new(embed_w.clone(), lora_for(&[ModuleKind::EmbedTokens]))?.output_dtype(act);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let id = |k| ModuleId::layer(l, k);
            let qkv_w = vec![
                mat(&format!("{p}.self_attn.q_proj.weight"), &[qs, h])?,
                mat(&format!("{p}.self_attn.k_proj.weight"), &[kvs, h])?,
                mat(&format!("{p}.self_attn.v_proj.weight"), &[kvs, h])?,
            ];
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
            let qkv = LoraLinear::new_fused(
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
            let o = LoraLinear::new(
                mat(&format!("{p}.self_attn.o_proj.weight"), &[h, qs])?,
                o_b,
                vec![(id(ModuleKind::OProj), h)],
                lora_for(&[ModuleKind::OProj]),
            )?;
            let gate_up_w = vec![
                mat(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?,
                mat(&format!("{p}.mlp.up_proj.weight"), &[i, h])?,
            ];
            let gate_up = LoraLinear::new_fused(
                gate_up_w,
                None,
                vec![(id(ModuleKind::GateProj), i), (id(ModuleKind::UpProj), i)],
                lora_for(&[ModuleKind::GateProj, ModuleKind::UpProj]),
            )?;
            let down = LoraLinear::new(
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
                input_norm: w.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: w.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            });
        }
        let norm = w.get("model.norm.weight", &[h])?;
        // A tied head shares the embedding's storage; a checkpoint that also stores `lm_head`
        // for a tied model is read from the embedding all the same, as transformers does.
        let head_w = if cfg.tie_word_embeddings { embed_w.clone() } else { mat("lm_head.weight", &[v, h])? };
        let head_slices = vec![(ModuleId::lm_head(), v)];
        let head_lora = lora_for(&[ModuleKind::LmHead]);
        let lm_head = if cfg.tie_word_embeddings {
            LoraLinear::new_shared(head_w, None, head_slices, head_lora)?
        } else {
            LoraLinear::new(head_w, None, head_slices, head_lora)?
        };
        let rope = Rope::new(&cfg, act, &opts.device)?;
        Ok(Model {
            cfg,
            dtype: wdt,
            act_dtype: act,
            lora_dtype: opts.lora_dtype.unwrap_or(opts.dtype),
            device: opts.device.clone(),
            lora: opts.lora.clone(),
            embed,
            layers,
            norm,
            lm_head,
            rope,
            shapes,
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

    /// Bytes of K and V per token over all layers, in the model dtype.
    pub fn kv_bytes_per_token(&self) -> u64 {
        kv_bytes_per_token(&self.cfg, self.dtype)
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
        let isa = multilora_layers::Isa::best();
        format!(
            "base products {isa:?} over {:?} weights, LoRA products {isa:?} over {:?} slots, \
             f32 activations and accumulation, decode attention in place over a {:?} KV cache",
            self.dtype, self.lora_dtype, self.dtype
        )
    }

    /// A zeroed KV cache for this model.
    pub fn new_kv_cache(&self, config: KvCacheConfig) -> Result<KvCache> {
        KvCache::new(&self.cfg, config, self.dtype, &self.device)
    }

    /// Runs one step: writes the new tokens' K/V into their blocks and returns f32 logits
    /// `[batch.num_logit_rows(), vocab]`, rows in sequence order.
    pub fn forward(&self, batch: &Batch, cache: &mut KvCache) -> Result<Tensor> {
        cache.check(&self.cfg, self.dtype)?;
        let kc = cache.config();
        let lim = Limits {
            vocab: self.cfg.vocab_size,
            max_len: self.cfg.max_model_len(),
            max_loras: self.lora.max_loras(),
            num_blocks: kc.num_blocks,
            block_size: kc.block_size,
            kv_width: self.cfg.kv_size(),
            paged_decode: self.paged_decode(),
            window: self.cfg.sliding_window.filter(|&w| w > 0),
        };
        let plan = StepPlan::new(batch, lim, &self.device)?;
        let tokens = batch.num_tokens();
        let (qs, kvs) = (self.cfg.q_size(), self.cfg.kv_size());
        let dims = AttnDims {
            heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            block_size: kc.block_size,
        };
        let eps = self.cfg.rms_norm_eps as f32;
        let map = &plan.token_mapping;
        let (cos, sin) = self.rope.gather(&plan.positions)?;
        let mut x = self.embed.forward(&plan.ids, map)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.input_norm, eps)?;
            let qkv = layer.qkv.forward(&h, map)?;
            let q = qkv.narrow(1, 0, qs)?.reshape((tokens, dims.heads, dims.head_dim))?;
            let k = qkv.narrow(1, qs, kvs)?.reshape((tokens, dims.kv_heads, dims.head_dim))?;
            let v = qkv.narrow(1, qs + kvs, kvs)?;
            let q = Rope::apply(&q, &cos, &sin)?;
            let k = Rope::apply(&k, &cos, &sin)?.reshape((tokens, kvs))?;
            let (ck, cv) = cache.layer(l);
            write_kv(&plan, ck, cv, &k, &v)?;
            let attn = paged_attention(&plan, &q, ck, cv, dims)?;
            x = (x + layer.o.forward(&attn, map)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.post_norm, eps)?;
            let gu = layer.gate_up.forward(&h, map)?;
            let inter = self.cfg.intermediate_size;
            let g = gu.narrow(1, 0, inter)?;
            let gate = match self.cfg.hidden_act {
                HiddenAct::Silu => candle_nn::ops::silu(&g)?,
                HiddenAct::Gelu => g.gelu_erf()?,
                HiddenAct::GeluTanh => g.gelu()?,
            };
            let act = (gate * gu.narrow(1, inter, inter)?)?;
            x = (x + layer.down.forward(&act, map)?)?;
        }
        if batch.num_logit_rows() == 0 {
            return Ok(Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device)?);
        }
        let x = match &plan.logit_rows {
            Some(rows) => x.index_select(rows, 0)?,
            None => x,
        };
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        Ok(self.lm_head.forward(&x, &plan.logit_mapping)?.to_dtype(DType::F32)?)
    }

    /// Places `adapter` in `slot` at every LoRA site, zeroing the modules it does not target.
    /// An adapter that targets a module without slot buffers is refused before anything is
    /// written; if a later write fails, the slot is cleared so no half-written adapter remains.
    pub fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> Result<()> {
        if let Some(id) = adapter.modules().keys().find(|id| !self.lora.targets(id.kind)) {
            return Err(Error::NotATarget { adapter: adapter.name().to_string(), module: id.peft_name() });
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

impl multilora_layers::SlotSink for Model {
    fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> multilora_layers::AdapterResult<()> {
        Model::write_slot(self, slot, adapter).map_err(|e| into_adapter_error(e, slot, adapter.name()))
    }

    fn clear_slot(&mut self, slot: SlotId) -> multilora_layers::AdapterResult<()> {
        Model::clear_slot(self, slot).map_err(|e| into_adapter_error(e, slot, ""))
    }
}

fn into_adapter_error(e: Error, slot: SlotId, adapter: &str) -> multilora_layers::AdapterError {
    match e {
        Error::Layer(e) => e.into(),
        other => multilora_layers::AdapterError::SlotWrite {
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

fn model_shapes(cfg: &ModelConfig, embed: &Tensor) -> Result<ModelShapes> {
    Ok(with_embedding_digest(cfg.shapes(), embed)?)
}
