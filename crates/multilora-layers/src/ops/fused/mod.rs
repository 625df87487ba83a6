//! Fused steps of a decode layer on CUDA, one launch each where candle's tensor ops take several
//! (`fused.cu` of `multilora-kernels`; the CPU has its own one-pass forms: `kv_write::cpu`,
//! `norm`, `swiglu`):
//! - [`rope_kv_write`]: the q/k/v projection's rows rotated (RoPE), the queries scaled, the keys
//!   and values written into their cache rows (was: two copies, two rotations, a scale, two
//!   writes);
//! - the residual add and RMS norm (`norm::add_rms_norm` on CUDA; was an add and a norm);
//! - SiLU times up (`swiglu::silu_mul` on CUDA; was a SiLU and a product);
//! - [`greedy_rows`]: a greedy row's pick and its logprob on the device, so that a step reads
//!   back 8 bytes for it instead of its whole f32 row.
//!
//! Here the launch plans (pure: grid, block, sizes; tested on every machine through the
//! emulator) and the operand checks; `cuda.rs` takes the device addresses and launches.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{DType, Tensor};
use multilora_kernels::params::{
    AddNormParams, FUSED_THREADS, GREEDY_THREADS, GreedyParams, RopeKvParams, SiluMulParams,
};

use crate::error::{Error, Result};
use crate::ops::attention::PagedDecodeDims;
use crate::ops::plan::{Launch, kernel_u32};

/// `rope_kv_write`'s launch for `tokens` rows of `qkv` (`qkv_stride` elements apart) into caches
/// of `num_rows` rows, every pointer left null: one block of [`FUSED_THREADS`] per token.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn rope_kv_launch(
    tokens: usize,
    d: PagedDecodeDims,
    qkv_stride: usize,
    num_rows: usize,
    q_scale: f32,
) -> Result<Launch<RopeKvParams>> {
    const OP: &str = "rope_kv_write";
    if d.head_dim == 0 || !d.head_dim.is_multiple_of(2) {
        return Err(Error::InvalidLayer {
            module: OP.into(),
            reason: format!("a head of {} values cannot be rotated in halves", d.head_dim),
        });
    }
    let mut p = RopeKvParams::zeroed();
    p.heads = kernel_u32(OP, "heads", d.heads)?;
    p.kv_heads = kernel_u32(OP, "kv heads", d.kv_heads)?;
    p.head_dim = kernel_u32(OP, "head size", d.head_dim)?;
    kernel_u32(OP, "q/k/v width", (d.heads + 2 * d.kv_heads) * d.head_dim)?;
    p.qkv_stride = kernel_u32(OP, "q/k/v stride", qkv_stride)?;
    p.num_rows = kernel_u32(OP, "cache rows", num_rows)?;
    p.q_scale = q_scale.to_bits();
    Ok(Launch { grid: [kernel_u32(OP, "tokens", tokens)?, 1, 1], block: [FUSED_THREADS, 1, 1], params: p })
}

/// `add_rms_norm`'s launch for `rows` rows of `cols`: one warp per row.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn add_norm_launch(
    rows: usize,
    cols: usize,
    (x_stride, residual_stride): (usize, usize),
    eps: f32,
) -> Result<Launch<AddNormParams>> {
    const OP: &str = "add_rms_norm";
    let mut p = AddNormParams::zeroed();
    p.cols = kernel_u32(OP, "row width", cols)?;
    p.x_stride = kernel_u32(OP, "x stride", x_stride)?;
    p.residual_stride = kernel_u32(OP, "residual stride", residual_stride)?;
    kernel_u32(OP, "elements", rows * cols)?;
    p.eps = eps.to_bits();
    Ok(Launch { grid: [kernel_u32(OP, "rows", rows)?, 1, 1], block: [32, 1, 1], params: p })
}

/// `silu_mul`'s launch for `rows` rows of `[gate | up]` (`gu_stride` apart) into `[rows, inter]`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn silu_mul_launch(rows: usize, inter: usize, gu_stride: usize) -> Result<Launch<SiluMulParams>> {
    const OP: &str = "silu_mul";
    let mut p = SiluMulParams::zeroed();
    p.inter = kernel_u32(OP, "inter width", inter)?;
    p.gu_stride = kernel_u32(OP, "gate/up stride", gu_stride)?;
    kernel_u32(OP, "elements", rows * inter)?;
    let blocks = inter.div_ceil(FUSED_THREADS as usize);
    Ok(Launch {
        grid: [kernel_u32(OP, "column blocks", blocks)?, kernel_u32(OP, "rows", rows)?, 1],
        block: [FUSED_THREADS, 1, 1],
        params: p,
    })
}

/// `greedy_rows`' launch for `count` selected rows of `vocab` logits (`stride` apart): one block
/// of [`GREEDY_THREADS`] a row.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn greedy_launch(count: usize, vocab: usize, stride: usize) -> Result<Launch<GreedyParams>> {
    const OP: &str = "greedy_rows";
    let mut p = GreedyParams::zeroed();
    p.vocab = kernel_u32(OP, "row width", vocab)?;
    p.stride = kernel_u32(OP, "row stride", stride)?;
    Ok(Launch { grid: [kernel_u32(OP, "rows", count)?, 1, 1], block: [GREEDY_THREADS, 1, 1], params: p })
}

/// Whether the fused kernels take tensors of `dtype` (the kernels' f32, bf16 and f16).
fn fused_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// On CUDA: rotates each token's q and k (`qkv: [tokens, (heads + 2 · kv_heads) · head_dim]`,
/// `cos`, `sin`: `[tokens, head_dim / 2]`), writes k and v into rows `slots` (`u32 [tokens]`) of
/// `k_cache` / `v_cache` (`[rows, kv_heads · head_dim]`, contiguous), and returns the rotated
/// queries times `q_scale`, `[tokens, heads, head_dim]`: one launch. `None` when the tensors are
/// not all on CUDA in one dtype the kernel takes (the caller then takes the tensor-op path).
///
/// # Errors
/// When the shapes disagree with `d`.
pub fn rope_kv_write(
    qkv: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    d: PagedDecodeDims,
    (k_cache, v_cache): (&Tensor, &Tensor),
    slots: &Tensor,
    q_scale: f64,
) -> Result<Option<Tensor>> {
    let same = [cos, sin, k_cache, v_cache].iter().all(|t| t.dtype() == qkv.dtype());
    if !qkv.device().is_cuda() || !same || !fused_dtype(qkv.dtype()) || slots.dtype() != DType::U32 {
        return Ok(None);
    }
    let tokens = slots.dims1().map_err(|_| Error::shape("rope_kv_write", "slots", slots.dims(), &[0]))?;
    let (hd, kvs) = (d.head_dim, d.kv_heads * d.head_dim);
    let want = [tokens, (d.heads + 2 * d.kv_heads) * hd];
    if qkv.dims() != want {
        return Err(Error::shape("rope_kv_write", "qkv", qkv.dims(), &want));
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [tokens, hd / 2] {
            return Err(Error::shape("rope_kv_write", name, t.dims(), &[tokens, hd / 2]));
        }
    }
    let rows = k_cache.dim(0)?;
    for (name, t) in [("k_cache", k_cache), ("v_cache", v_cache)] {
        if t.dims() != [rows, kvs] {
            return Err(Error::shape("rope_kv_write", name, t.dims(), &[rows, kvs]));
        }
    }
    #[cfg(feature = "cuda")]
    return Ok(Some(cuda::rope_kv_write(qkv, (cos, sin), d, (k_cache, v_cache), slots, q_scale as f32)?));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = q_scale;
        Ok(None)
    }
}

/// On CUDA, `(x + delta, rms_norm(x + delta, alpha, eps))` in one launch (the sum rounded to the
/// dtype, as candle's add gives it); `None` elsewhere or for other dtypes.
pub(crate) fn add_rms_norm(x: &Tensor, delta: &Tensor, alpha: &Tensor, eps: f32) -> Result<Option<(Tensor, Tensor)>> {
    let same = delta.dtype() == x.dtype() && alpha.dtype() == x.dtype() && delta.dims() == x.dims();
    let Some(&cols) = x.dims().last() else { return Ok(None) };
    if !x.device().is_cuda() || !same || !fused_dtype(x.dtype()) || x.rank() != 2 || alpha.dims() != [cols] {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    return Ok(Some(cuda::add_rms_norm(x, delta, alpha, eps)?));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = eps;
        Ok(None)
    }
}

/// On CUDA, `silu(gu[:, ..inter]) · gu[:, inter..]` in one launch; `None` elsewhere.
pub(crate) fn silu_mul(gu: &Tensor, inter: usize) -> Result<Option<Tensor>> {
    if !gu.device().is_cuda() || !fused_dtype(gu.dtype()) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    return Ok(Some(cuda::silu_mul(gu, inter)?));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = inter;
        Ok(None)
    }
}

/// A greedy row sampled on the device: its pick and the pick's log probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GreedyPick {
    /// The first index of the row's largest logit (NaN passed over; 0 for a row of NaN alone),
    /// as the host's `argmax`.
    pub token: u32,
    /// `−ln Σ exp(x − max)` over the row's numbers (summed in f32), the pick's log probability
    /// under the raw logits; NaN where the max is not finite, as the host's `x − lse` gives.
    pub logprob: f32,
}

/// On CUDA, each of `rows` of the f32 `logits` (`[n, vocab]`) picked greedily with its
/// log probability, in one launch, and only those 8 bytes a row read back; `None` elsewhere (the
/// caller reads the rows and picks on the host).
///
/// # Errors
/// When `logits` is not `[n, vocab]` or a row is past `n`.
pub fn greedy_rows(logits: &Tensor, rows: &[usize]) -> Result<Option<Vec<GreedyPick>>> {
    const OP: &str = "greedy_rows";
    if !logits.device().is_cuda() || logits.dtype() != DType::F32 {
        return Ok(None);
    }
    let (n, vocab) = logits.dims2().map_err(|_| Error::shape(OP, "logits", logits.dims(), &[0, 0]))?;
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        return Err(Error::InvalidLayer { module: OP.into(), reason: format!("row {r} of {n} logit rows") });
    }
    if rows.is_empty() || vocab == 0 {
        return Ok(Some(vec![GreedyPick { token: 0, logprob: f32::NAN }; rows.len()]));
    }
    #[cfg(feature = "cuda")]
    return Ok(Some(cuda::greedy_rows(logits, rows)?));
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}
