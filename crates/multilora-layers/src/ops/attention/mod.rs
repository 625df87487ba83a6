//! Paged decode attention: every decode row (one new token of a sequence) attends over its
//! context in the paged KV cache, read through the block table on the device.
//!
//! ```text
//! out[n, h, :] = Σ_t softmax_t(q[n, h, :] · K[row(n, t), kvh, :]) · V[row(n, t), kvh, :],  t < ctx_lens[n]
//! row(n, t) = block_tables[n, t / block_size] · block_size + t % block_size,   kvh = h / (heads / kv_heads)
//! ```
//!
//! `q: [n, heads, head_dim]` is already scaled by `1/√head_dim`; the caches are the model's
//! flat `[num_blocks · block_size, kv_heads · head_dim]` tensors. [`paged_decode_attention`] runs
//! the CUDA kernels (no gather, no padding, f32 softmax): `paged_decode_split.cu` for head sizes
//! 32, 64, 128 and 256 (the context in partitions, the query heads of a KV head together, a
//! reduce; plan in `split.rs`), `paged_attention.cu` for the others;
//! [`paged_decode_attention_slow`] gathers each sequence's rows with tensor ops, on any device,
//! and is the oracle the kernel is checked against.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
// The CUDA glue and the emulated kernel tests use the plan; a CPU build only tests it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod split;

use candle_core::{DType, Tensor};
use multilora_kernels::params::{ATTN_WARPS, DecodeAttnParams};

use crate::error::{Error, Result};

/// The shapes of one decode-attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedDecodeDims {
    /// Query heads.
    pub heads: usize,
    /// KV heads (divides `heads`).
    pub kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Tokens per cache block.
    pub block_size: usize,
}

impl PagedDecodeDims {
    /// Whether the CUDA kernel is built for this head size and dtype.
    pub fn kernel_supported(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
            && multilora_kernels::kernel::DECODE_HEAD_DIMS.contains(&self.head_dim)
    }
}

fn bad(reason: String) -> Error {
    Error::InvalidLayer { module: "paged_decode_attention".to_string(), reason }
}

/// Checks the operands; returns `(n, max_blocks)`.
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    block_tables: &Tensor,
    ctx_lens: &Tensor,
    d: PagedDecodeDims,
) -> Result<(usize, usize)> {
    if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) || d.block_size == 0 {
        return Err(bad(format!("{} heads over {} kv heads, block size {}", d.heads, d.kv_heads, d.block_size)));
    }
    let (n, heads, hd) =
        q.dims3().map_err(|_| Error::shape("paged_decode_attention", "q", q.dims(), &[0, d.heads, d.head_dim]))?;
    if heads != d.heads || hd != d.head_dim {
        return Err(Error::shape("paged_decode_attention", "q", q.dims(), &[n, d.heads, d.head_dim]));
    }
    let width = d.kv_heads * d.head_dim;
    for (name, c) in [("k_cache", k), ("v_cache", v)] {
        let (rows, w) = c.dims2().map_err(|_| Error::shape("paged_decode_attention", name, c.dims(), &[0, width]))?;
        if w != width || !rows.is_multiple_of(d.block_size) {
            return Err(Error::shape("paged_decode_attention", name, c.dims(), &[rows, width]));
        }
    }
    let (bn, max_blocks) = block_tables
        .dims2()
        .map_err(|_| Error::shape("paged_decode_attention", "block_tables", block_tables.dims(), &[n, 0]))?;
    if bn != n || ctx_lens.dims() != [n] {
        return Err(Error::shape("paged_decode_attention", "ctx_lens", ctx_lens.dims(), &[n]));
    }
    if block_tables.dtype() != DType::U32 || ctx_lens.dtype() != DType::U32 {
        return Err(bad("block tables and context lengths must be u32".to_string()));
    }
    Ok((n, max_blocks))
}

/// The kernel's parameters for a call, every pointer left null (the host plan of the kernel:
/// pure, tested on every machine; the grid is `[n, heads, 1]` of [`ATTN_WARPS`] warps).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn decode_params(n: usize, max_blocks: usize, d: PagedDecodeDims) -> ([u32; 3], [u32; 3], DecodeAttnParams) {
    let mut p = DecodeAttnParams::zeroed();
    p.heads = d.heads as u32;
    p.kv_heads = d.kv_heads as u32;
    p.block_size = d.block_size as u32;
    p.max_blocks = max_blocks as u32;
    p.q_stride = (d.heads * d.head_dim) as u32;
    p.out_stride = (d.heads * d.head_dim) as u32;
    ([n as u32, d.heads as u32, 1], [ATTN_WARPS * 32, 1, 1], p)
}

/// Decode attention with the CUDA kernel: `[n, heads · head_dim]` in `q`'s dtype.
///
/// Every context length must be at least 1 and covered by the sequence's row of
/// `block_tables` (the model's step plan guarantees both); the kernel trusts them.
pub fn paged_decode_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    ctx_lens: &Tensor,
    d: PagedDecodeDims,
) -> Result<Tensor> {
    let (n, max_blocks) = check(q, k_cache, v_cache, block_tables, ctx_lens, d)?;
    if !d.kernel_supported(q.dtype()) || k_cache.dtype() != q.dtype() || v_cache.dtype() != q.dtype() {
        return Err(bad(format!("no kernel for head_dim {} in {:?}", d.head_dim, q.dtype())));
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return cuda::paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, n, max_blocks, d);
    }
    let _ = (n, max_blocks);
    Err(bad(format!("the paged decode kernel runs on CUDA; got {:?} (use paged_decode_attention_slow)", q.device())))
}

/// The oracle: each sequence's rows gathered from the caches with tensor ops, scores and softmax
/// in f32, on any device.
pub fn paged_decode_attention_slow(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    ctx_lens: &Tensor,
    d: PagedDecodeDims,
) -> Result<Tensor> {
    let (n, _) = check(q, k_cache, v_cache, block_tables, ctx_lens, d)?;
    let tables = block_tables.to_vec2::<u32>()?;
    let lens = ctx_lens.to_vec1::<u32>()?;
    let group = d.heads / d.kv_heads;
    let mut outs = Vec::with_capacity(n);
    for (seq, (table, &len)) in tables.iter().zip(&lens).enumerate() {
        let bs = d.block_size as u32;
        let rows: Vec<u32> = (0..len).map(|t| table[(t / bs) as usize] * bs + t % bs).collect();
        let index = Tensor::from_vec(rows, len as usize, q.device())?;
        // [ctx, kv_heads, d] → [kv_heads, d, ctx] for K, [kv_heads, ctx, d] for V.
        let gather = |c: &Tensor| -> Result<Tensor> {
            Ok(c.index_select(&index, 0)?.reshape((len as usize, d.kv_heads, d.head_dim))?.to_dtype(DType::F32)?)
        };
        let (k, v) = (gather(k_cache)?.permute((1, 2, 0))?, gather(v_cache)?.transpose(0, 1)?);
        let qs = q.get(seq)?.to_dtype(DType::F32)?.reshape((d.kv_heads, group, d.head_dim))?;
        let scores = qs.matmul(&k.contiguous()?)?; // [kv_heads, group, ctx]
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = probs.matmul(&v.contiguous()?)?; // [kv_heads, group, d]
        outs.push(o.reshape(d.heads * d.head_dim)?);
    }
    Ok(Tensor::stack(&outs, 0)?.to_dtype(q.dtype())?)
}
