//! The paged KV cache: per layer, K and V of `[num_blocks, block_size, kv_heads, head_dim]`.
//!
//! Block `b`, offset `o` is flat row `b · block_size + o`; tensors are held as
//! `[num_blocks · block_size, kv_heads · head_dim]` (the same memory) so that one step writes all
//! its new rows with one in-place write per layer and cache (candle's scatter on the CPU, the
//! KV-write kernel on CUDA), and a sequence's context is one row gather.
//! Block ids come from the prefix cache's block pool; this type only stores what they address.

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
}

impl KvCacheConfig {
    /// `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> KvCacheConfig {
        KvCacheConfig { num_blocks, block_size }
    }

    /// As many blocks of `block_size` tokens as fit in `budget_bytes` for `cfg` in `dtype`.
    pub fn for_budget(cfg: &ModelConfig, dtype: DType, block_size: usize, budget_bytes: u64) -> KvCacheConfig {
        KvCacheConfig { num_blocks: num_blocks_for_budget(cfg, dtype, block_size, budget_bytes), block_size }
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

/// An upper estimate of the device memory one step's activations take beyond the weights, the
/// slots and the KV cache, for steps of up to `tokens` new tokens over contexts of up to
/// `max_model_len` positions: the hidden states, the fused projections' outputs, one prefill
/// sequence's attention scores (f32) and probabilities over its whole context with its gathered
/// K and V, and f32 logits for every token; plus a quarter for the allocator's slack. The KV
/// budget on a GPU is what `gpu_memory_utilization` leaves after this.
pub fn step_activation_bytes(cfg: &ModelConfig, dtype: DType, tokens: usize, max_model_len: usize) -> u64 {
    let (t, ctx, dt) = (tokens as u64, max_model_len.max(tokens) as u64, dtype.size_in_bytes() as u64);
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (q, kv, heads) = (cfg.q_size() as u64, cfg.kv_size() as u64, cfg.num_heads as u64);
    let hidden = t * dt * (4 * h + 2 * (q + 2 * kv) + 2 * q + 4 * i);
    let attention = heads * t * ctx * (4 + dt) + 4 * ctx * kv * dt;
    let logits = t * cfg.vocab_size as u64 * (4 + dt);
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
        let rows = config.num_blocks.checked_mul(config.block_size).ok_or_else(|| Error::KvCache {
            reason: format!("{} blocks of {} rows overflow", config.num_blocks, config.block_size),
        })?;
        // Pages handed out as rows are written: a pool sized for the longest context costs
        // memory only as far as it is used. On the CPU every layer's K and V are views of one
        // buffer whose huge pages are advised: a decode step reads its sequences' rows of every
        // layer as short streams (and asks for them ahead, `ReadAhead`), which on 4 KiB pages
        // are a page walk every 4 KiB (docs/BENCHMARKS.md, "A ninth look").
        let (k, v) = if device.is_cpu() {
            let per = rows * cfg.kv_size();
            let total = per.checked_mul(2 * cfg.num_layers).ok_or_else(|| Error::KvCache {
                reason: format!("{rows} rows of {} values for {} layers overflow", cfg.kv_size(), cfg.num_layers),
            })?;
            let all = multilora_layers::huge_zeros(total, dtype, device)?;
            let view =
                |i: usize| -> Result<Tensor> { Ok(all.narrow(0, i * per, per)?.reshape((rows, cfg.kv_size()))?) };
            let k = (0..cfg.num_layers).map(view).collect::<Result<Vec<_>>>()?;
            let v = (cfg.num_layers..2 * cfg.num_layers).map(view).collect::<Result<Vec<_>>>()?;
            (k, v)
        } else {
            let alloc = || multilora_layers::lazy_zeros(&[rows, cfg.kv_size()], dtype, device);
            let k = (0..cfg.num_layers).map(|_| alloc()).collect::<multilora_layers::Result<Vec<_>>>()?;
            let v = (0..cfg.num_layers).map(|_| alloc()).collect::<multilora_layers::Result<Vec<_>>>()?;
            (k, v)
        };
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

    /// Layer `layer`'s keys as `[num_blocks, block_size, kv_heads, head_dim]` (a view).
    pub fn keys(&self, layer: usize) -> Result<Tensor> {
        self.view(&self.k[layer])
    }

    /// Layer `layer`'s values as `[num_blocks, block_size, kv_heads, head_dim]` (a view).
    pub fn values(&self, layer: usize) -> Result<Tensor> {
        self.view(&self.v[layer])
    }

    fn view(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.reshape((self.config.num_blocks, self.config.block_size, self.kv_heads, self.head_dim))?)
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
