//! The paged KV cache: per layer, K and V of `[num_blocks, block_size, kv_heads, head_dim]`.
//!
//! Block `b`, offset `o` is flat row `b · block_size + o`; tensors are held as
//! `[num_blocks · block_size, kv_heads · head_dim]` (the same memory) so that one step writes all
//! its new rows with one in-place write per layer and cache (candle's scatter on the CPU, the
//! KV-write kernel on CUDA), and a sequence's context is one row gather.
//! Block ids come from the prefix cache's block pool; this type only stores what they address.
//!
//! A model whose layers mix a sliding window with full attention (Gemma 3) may keep its sliding
//! layers in a pool of their own ([`KvCacheConfig::sliding_blocks`]): their tensors then have
//! that pool's rows, addressed by each sequence's sliding table, whose blocks behind the window
//! the prefix cache frees. A long context costs its full layers' KV and only a window's in the
//! others.

use candle_core::{DType, Device, Tensor};
use multilora_layers::HostRows;

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// How big the cache is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvCacheConfig {
    /// Number of blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks of the sliding layers' own pool (a model with [`ModelConfig::mixed_windows`]);
    /// `None`: every layer's blocks are the `num_blocks` of the one pool.
    pub sliding_blocks: Option<usize>,
}

impl KvCacheConfig {
    /// `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> KvCacheConfig {
        KvCacheConfig { num_blocks, block_size, sliding_blocks: None }
    }

    /// The sliding layers in a pool of their own of `blocks` blocks.
    pub fn with_sliding_blocks(mut self, blocks: usize) -> KvCacheConfig {
        self.sliding_blocks = Some(blocks);
        self
    }

    /// As many blocks of `block_size` tokens as fit in `budget_bytes` for `cfg` in `dtype`.
    pub fn for_budget(cfg: &ModelConfig, dtype: DType, block_size: usize, budget_bytes: u64) -> KvCacheConfig {
        KvCacheConfig::new(num_blocks_for_budget(cfg, dtype, block_size, budget_bytes), block_size)
    }

    /// For a model with [`ModelConfig::mixed_windows`]: its sliding layers in a pool of their own
    /// of `sliding_cap` blocks (what the requests served at once can hold: each keeps only its
    /// window), the full layers taking the rest of `budget_bytes`. Neither pool gets fewer blocks
    /// than one pool for every layer would have: the sliding pool is at most that many, so a cap
    /// above it gains nothing (then both pools get the one pool's blocks). Other models:
    /// [`KvCacheConfig::for_budget`].
    pub fn for_budget_sliding(
        cfg: &ModelConfig,
        dtype: DType,
        block_size: usize,
        budget_bytes: u64,
        sliding_cap: usize,
    ) -> KvCacheConfig {
        if !cfg.mixed_windows() {
            return KvCacheConfig::for_budget(cfg, dtype, block_size, budget_bytes);
        }
        let sliding = (0..cfg.num_layers).filter(|&l| cfg.layer_window(l).is_some()).count() as u64;
        let full = (cfg.num_layers as u64 - sliding).max(1);
        let per_layer = 2 * (cfg.kv_size() * dtype.size_in_bytes() * block_size.max(1)) as u64;
        let layer_blocks = budget_bytes / per_layer.max(1);
        let one_pool = layer_blocks / cfg.num_layers.max(1) as u64;
        let sliding_blocks = (sliding_cap as u64).min(one_pool);
        let num_blocks = (layer_blocks - sliding * sliding_blocks) / full;
        KvCacheConfig::new(num_blocks as usize, block_size).with_sliding_blocks(sliding_blocks as usize)
    }

    /// The blocks of layer `l`'s pool.
    fn layer_blocks(&self, cfg: &ModelConfig, l: usize) -> usize {
        match self.sliding_blocks {
            Some(n) if cfg.mixed_windows() && cfg.layer_window(l).is_some() => n,
            _ => self.num_blocks,
        }
    }
}

/// Bytes of K and V one token takes over all layers: `2 · layers · kv_heads · head_dim · dtype`.
pub fn kv_bytes_per_token(cfg: &ModelConfig, dtype: DType) -> u64 {
    2 * (cfg.num_layers * cfg.kv_size() * dtype.size_in_bytes()) as u64
}

/// How many blocks of `block_size` tokens fit in `budget_bytes`.
pub fn num_blocks_for_budget(cfg: &ModelConfig, dtype: DType, block_size: usize, budget_bytes: u64) -> usize {
    let per_block = kv_bytes_per_token(cfg, dtype) * block_size.max(1) as u64;
    budget_bytes.checked_div(per_block).unwrap_or(0) as usize
}

/// A device's memory as its driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free now.
    pub free: u64,
    /// Bytes on the device.
    pub total: u64,
}

/// The memory of `device` (`None` for the CPU, which has no device memory to measure).
pub fn device_memory(device: &Device) -> Result<Option<DeviceMemory>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let (free, total) = d
                .cuda_stream()
                .context()
                .mem_get_info()
                .map_err(|e| Error::KvCache { reason: format!("cannot read the device's memory: {e}") })?;
            Ok(Some(DeviceMemory { free: free as u64, total: total as u64 }))
        }
        _ => Ok(None),
    }
}

/// An upper estimate of the memory one step's activations take beyond the weights, the slots and
/// the KV cache, for steps of up to `tokens` new tokens, `logit_rows` of them giving logits, over
/// contexts of up to `max_model_len` positions: the hidden states, the fused projections' outputs
/// and the MLP's; the attention's working memory; f32 logits (and their copy in the model's dtype)
/// for the logit rows; plus a quarter for the allocator's slack. The attention's: on the CPU
/// (`cpu_threads`), the streaming kernel's workspace on each thread
/// ([`multilora_cpu::float::causal_workspace_bytes`]), whatever the context; elsewhere one
/// prefill sequence's gathered K and V and a query tile's scores and probabilities, at most
/// [`SCORES_BYTES`](crate::attention::SCORES_BYTES). The KV budget on a GPU is what
/// `gpu_memory_utilization` leaves after this; on the CPU the engine caps its step's tokens to
/// keep this under its step budget.
pub fn step_activation_bytes(
    cfg: &ModelConfig,
    dtype: DType,
    tokens: usize,
    logit_rows: usize,
    max_model_len: usize,
    cpu_threads: Option<usize>,
) -> u64 {
    let (t, ctx, dt) = (tokens as u64, max_model_len.max(tokens) as u64, dtype.size_in_bytes() as u64);
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (q, kv, heads) = (cfg.q_size() as u64, cfg.kv_size() as u64, cfg.num_heads as u64);
    let hidden = t * dt * (4 * h + 2 * (q + 2 * kv) + 2 * q + 4 * i);
    let attention = match cpu_threads {
        Some(threads) => {
            let group = cfg.num_heads / cfg.num_kv_heads.max(1);
            (threads * multilora_cpu::float::causal_workspace_bytes(group, cfg.head_dim)) as u64
        }
        None => (heads * t * ctx * 12).min(crate::attention::SCORES_BYTES as u64) + 4 * ctx * kv * dt,
    };
    let logits = logit_rows.min(tokens) as u64 * cfg.vocab_size as u64 * (4 + dt);
    (hidden + attention + logits) * 5 / 4
}

/// The K/V blocks of every layer. Not `Clone`: a clone would share storage with the original,
/// and writes through one would show in the other.
#[derive(Debug)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Where each layer's K and V rows lie in host memory (`None` on a device), for the step's
    /// read-ahead hints: found once, the buffers are written in place and never move.
    host: Vec<Option<[HostRows; 2]>>,
    config: KvCacheConfig,
    kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// A zeroed cache for a model of `cfg`.
    pub fn new(cfg: &ModelConfig, config: KvCacheConfig, dtype: DType, device: &Device) -> Result<KvCache> {
        if config.block_size == 0 {
            return Err(Error::KvCache { reason: "block_size must be positive".into() });
        }
        if config.sliding_blocks.is_some() && !cfg.mixed_windows() {
            return Err(Error::KvCache {
                reason: "a sliding pool of its own needs a model whose layers mix sliding and full attention".into(),
            });
        }
        let layer_rows = (0..cfg.num_layers)
            .map(|l| {
                let blocks = config.layer_blocks(cfg, l);
                blocks.checked_mul(config.block_size).ok_or_else(|| Error::KvCache {
                    reason: format!("{blocks} blocks of {} rows overflow", config.block_size),
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        // Pages handed out as rows are written: a pool sized for the longest context costs
        // memory only as far as it is used. On the CPU every layer's K and V are views of one
        // buffer whose huge pages are advised: a decode step reads its sequences' rows of every
        // layer as short streams (and asks for them ahead, `ReadAhead`), which on 4 KiB pages
        // are a page walk every 4 KiB (docs/BENCHMARKS.md, "One GGUF decode step, and memory").
        // The keys of every layer, then the values: tensor `i` holds layer `i % layers`.
        let tensor_rows: Vec<usize> = layer_rows.iter().chain(&layer_rows).copied().collect();
        let tensors = if device.is_cpu() {
            let overflow = || Error::KvCache {
                reason: format!("{} layers of {} values a row overflow", cfg.num_layers, cfg.kv_size()),
            };
            let total = tensor_rows.iter().try_fold(0usize, |sum, &rows| {
                rows.checked_mul(cfg.kv_size()).and_then(|n| sum.checked_add(n)).ok_or_else(overflow)
            })?;
            let all = multilora_layers::huge_zeros(total, dtype, device)?;
            let mut at = 0;
            let mut views = Vec::with_capacity(tensor_rows.len());
            for &rows in &tensor_rows {
                views.push(all.narrow(0, at, rows * cfg.kv_size())?.reshape((rows, cfg.kv_size()))?);
                at += rows * cfg.kv_size();
            }
            views
        } else {
            tensor_rows
                .iter()
                .map(|&rows| multilora_layers::lazy_zeros(&[rows, cfg.kv_size()], dtype, device))
                .collect::<multilora_layers::Result<Vec<_>>>()?
        };
        let (k, v) = (tensors[..cfg.num_layers].to_vec(), tensors[cfg.num_layers..].to_vec());
        let host = k.iter().zip(&v).map(|(k, v)| Some([HostRows::of(k)?, HostRows::of(v)?])).collect();
        Ok(KvCache { k, v, host, config, kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim })
    }

    /// The sizes it was made with.
    pub fn config(&self) -> KvCacheConfig {
        self.config
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes held by all K and V tensors.
    pub fn nbytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
    }

    /// Layer `layer`'s keys as `[num_blocks, block_size, kv_heads, head_dim]` (a view; a sliding
    /// layer's with its own pool has `sliding_blocks` blocks).
    pub fn keys(&self, layer: usize) -> Result<Tensor> {
        self.view(&self.k[layer])
    }

    /// Layer `layer`'s values as `[num_blocks, block_size, kv_heads, head_dim]` (a view).
    pub fn values(&self, layer: usize) -> Result<Tensor> {
        self.view(&self.v[layer])
    }

    fn view(&self, t: &Tensor) -> Result<Tensor> {
        let bs = self.config.block_size;
        Ok(t.reshape((t.dim(0)? / bs, bs, self.kv_heads, self.head_dim))?)
    }

    /// The flat `[rows, kv_heads · head_dim]` K and V of a layer.
    pub(crate) fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.k[layer], &self.v[layer])
    }

    /// Where a layer's K and V rows lie in host memory; `None` on a device or past the last layer.
    pub(crate) fn host_rows(&self, layer: usize) -> Option<[HostRows; 2]> {
        self.host.get(layer).copied().flatten()
    }

    pub(crate) fn check(&self, cfg: &ModelConfig, dtype: DType) -> Result<()> {
        let ok = self.k.len() == cfg.num_layers
            && (self.config.sliding_blocks.is_none() || cfg.mixed_windows())
            && self.kv_heads == cfg.num_kv_heads
            && self.head_dim == cfg.head_dim
            && self.k.first().is_none_or(|t| t.dtype() == dtype);
        if ok {
            Ok(())
        } else {
            Err(Error::KvCache {
                reason: format!(
                    "made for {} layers of {}x{} in {:?}, the model has {} layers of {}x{} in {dtype:?}",
                    self.k.len(),
                    self.kv_heads,
                    self.head_dim,
                    self.k.first().map(|t| t.dtype()),
                    cfg.num_layers,
                    cfg.num_kv_heads,
                    cfg.head_dim
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the layers' K and V are views of one buffer, laid end to end: each of its own
    /// shape, zero, and apart from every other (a write into one shows in no other).
    #[test]
    fn layers_are_apart_views_of_one_buffer() -> Result<()> {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny/base/config.json");
        let cfg = ModelConfig::from_file(&path).expect("fixture config");
        let cache = KvCache::new(&cfg, KvCacheConfig::new(3, 4), DType::F16, &Device::Cpu)?;
        let (rows, width, layers) = (12, cfg.kv_size(), cfg.num_layers);
        assert_eq!(cache.nbytes(), (2 * layers * rows * width * 2) as u64);
        let tensors: Vec<&Tensor> = cache.k.iter().chain(&cache.v).collect();
        for (i, t) in tensors.iter().enumerate() {
            assert_eq!(t.dims(), [rows, width], "tensor {i}");
            let marked = Tensor::full(i as f32 + 1.0, (rows, width), &Device::Cpu)?.to_dtype(DType::F16)?;
            t.slice_set(&marked, 0, 0)?;
        }
        for (i, t) in tensors.iter().enumerate() {
            let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(v.iter().all(|&x| x == i as f32 + 1.0), "tensor {i} holds its own values only");
        }
        let offsets: Vec<usize> = tensors.iter().map(|t| t.layout().start_offset()).collect();
        let want: Vec<usize> = (0..2 * layers).map(|i| i * rows * width).collect();
        assert_eq!(offsets, want, "end to end in one buffer, the keys then the values");
        Ok(())
    }
}
