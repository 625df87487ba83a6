//! `paged_kv_write`: a step's new keys and values into their rows of the paged KV cache.
//!
//! ```text
//! cache_k[slots[t], :] = k[t, :],   cache_v[slots[t], :] = v[t, :]        for every new token t
//! ```
//!
//! The caches are the model's flat `[num_blocks · block_size, kv_heads · head_dim]` tensors and
//! `slots` the step's slot mapping (`u32 [tokens]`, one cache row per token). On CUDA
//! [`paged_kv_write`] launches `kv_write.cu` (one block per token, 16-byte stores, the row read
//! from `slots` on the device), once for K and once for V; [`paged_kv_write_slow`] is candle's
//! `scatter_set` along rows with the index broadcast to `[tokens, width]`, on any device, and is
//! the oracle the kernel is checked against. On the CPU, [`cpu::rope_write_kv`] rotates the keys
//! and writes them with the values in one pass, and [`cpu::write_kv_rows`] writes given rows.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{DType, Tensor};
use multilora_kernels::params::{KV_WRITE_THREADS, KvWriteParams};

use crate::error::{Error, Result};
use crate::ops::plan::{Launch, kernel_u32};

fn bad(reason: String) -> Error {
    Error::InvalidLayer { module: "paged_kv_write".to_string(), reason }
}

/// Checks the operands; returns `(tokens, width)`.
fn check(cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor, slots: &Tensor) -> Result<(usize, usize)> {
    let (rows, width) =
        cache_k.dims2().map_err(|_| Error::shape("paged_kv_write", "k_cache", cache_k.dims(), &[0, 0]))?;
    if cache_v.dims() != [rows, width] {
        return Err(Error::shape("paged_kv_write", "v_cache", cache_v.dims(), &[rows, width]));
    }
    let tokens = slots.dims1().map_err(|_| Error::shape("paged_kv_write", "slots", slots.dims(), &[0]))?;
    for (name, t) in [("k", k), ("v", v)] {
        if t.dims() != [tokens, width] {
            return Err(Error::shape("paged_kv_write", name, t.dims(), &[tokens, width]));
        }
        if t.dtype() != cache_k.dtype() {
            return Err(bad(format!("{name} is {:?}, the cache {:?}", t.dtype(), cache_k.dtype())));
        }
    }
    if cache_v.dtype() != cache_k.dtype() || slots.dtype() != DType::U32 {
        return Err(bad(format!(
            "caches {:?} / {:?} and slots {:?} (the slots must be u32)",
            cache_k.dtype(),
            cache_v.dtype(),
            slots.dtype()
        )));
    }
    Ok((tokens, width))
}

/// The kernel's launch for one cache, every pointer left null (the host plan: pure, tested on
/// every machine): one block of [`KV_WRITE_THREADS`] per token; `src_stride` in elements.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn kv_write_launch(
    tokens: usize,
    width: usize,
    src_stride: usize,
    dtype: DType,
    num_rows: usize,
) -> Result<Launch<KvWriteParams>> {
    let u32_of = |what: &str, v: usize| kernel_u32("paged_kv_write", what, v);
    let elem = dtype.size_in_bytes();
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(bad(format!("the kernel writes f32, bf16 or f16 caches, not {dtype:?}")));
    }
    u32_of("row bytes", width * elem)?;
    let mut p = KvWriteParams::zeroed();
    p.width = u32_of("cache width", width)?;
    p.src_stride = u32_of("source stride", src_stride)?;
    p.elem_bytes = elem as u32;
    p.num_rows = u32_of("cache rows", num_rows)?;
    Ok(Launch { grid: [u32_of("tokens", tokens)?, 1, 1], block: [KV_WRITE_THREADS, 1, 1], params: p })
}

/// Writes `k`, `v` (`[tokens, width]`, the caches' dtype, rows may be strided) into rows `slots`
/// of the caches with the CUDA kernel. A slot past the cache's rows writes nothing (the model
/// checks every block against the cache before a step; the kernel only stays inside it).
pub fn paged_kv_write(cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor, slots: &Tensor) -> Result<()> {
    check(cache_k, cache_v, k, v, slots)?;
    #[cfg(feature = "cuda")]
    if cache_k.device().is_cuda() {
        return cuda::kv_write(cache_k, cache_v, k, v, slots);
    }
    Err(bad(format!("the KV-write kernel runs on CUDA; got {:?} (use paged_kv_write_slow)", cache_k.device())))
}

/// The oracle, on any device: `scatter_set` along rows with the slot of each token broadcast
/// over its row (`[tokens, width]`).
pub fn paged_kv_write_slow(cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor, slots: &Tensor) -> Result<()> {
    let (tokens, width) = check(cache_k, cache_v, k, v, slots)?;
    let index = slots.reshape((tokens, 1))?.broadcast_as((tokens, width))?.contiguous()?;
    cache_k.scatter_set(&index, &k.contiguous()?, 0)?;
    cache_v.scatter_set(&index, &v.contiguous()?, 0)?;
    Ok(())
}
