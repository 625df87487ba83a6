//! Causal grouped-query attention of each sequence over its paged context.
//!
//! For a sequence with `len` new tokens and `ctx = start_pos + len` positions in the cache:
//! `softmax(q · kᵀ / √d + mask) · v` with `q: [heads, len, d]` and `k, v: [kv_heads, ctx, d]`.
//! The `heads / kv_heads` query heads that share a KV head are stacked into one matrix
//! (`[kv_heads, group · len, d]`), so GQA needs no copy of K or V.

use candle_core::{DType, Tensor};

use crate::batch::StepPlan;
use crate::error::Result;

/// Shapes of the attention.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnDims {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

/// Writes the step's new `k`, `v` (`[tokens, kv_heads · head_dim]`) into the layer's cache rows.
pub(crate) fn write_kv(plan: &StepPlan, cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    cache_k.scatter_set(&plan.write_index, &k.contiguous()?, 0)?;
    cache_v.scatter_set(&plan.write_index, &v.contiguous()?, 0)?;
    Ok(())
}

/// `q: [tokens, heads, head_dim]` (already rotated) → `[tokens, heads · head_dim]`, each sequence
/// attending over its rows of the cache (which already hold this step's keys and values).
pub(crate) fn paged_attention(
    plan: &StepPlan,
    q: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    d: AttnDims,
) -> Result<Tensor> {
    let scale = 1.0 / (d.head_dim as f64).sqrt();
    let group = d.heads / d.kv_heads;
    let q = (q * scale)?;
    let mut outs = Vec::with_capacity(plan.seqs.len());
    for s in &plan.seqs {
        let ctx = s.ctx_rows.dim(0)?;
        // [len, heads, d] → [heads, len, d] → [kv_heads, group · len, d].
        let qs = q.narrow(0, s.offset, s.len)?.transpose(0, 1)?.contiguous()?.reshape((
            d.kv_heads,
            group * s.len,
            d.head_dim,
        ))?;
        let gather = |c: &Tensor| -> Result<Tensor> {
            Ok(c.index_select(&s.ctx_rows, 0)?.reshape((ctx, d.kv_heads, d.head_dim))?.transpose(0, 1)?.contiguous()?)
        };
        let k = gather(cache_k)?;
        let v = gather(cache_v)?;
        let mut scores = qs.matmul(&k.t()?)?;
        // Softmax in f32 even for half-precision models: the row sums are what loses precision.
        let in_dtype = scores.dtype();
        scores = scores.to_dtype(DType::F32)?;
        if let Some(mask) = &s.mask {
            scores = scores.reshape((d.kv_heads, group, s.len, ctx))?.broadcast_add(mask)?.reshape((
                d.kv_heads,
                group * s.len,
                ctx,
            ))?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(in_dtype)?;
        let o = probs.matmul(&v)?; // [kv_heads, group · len, d]
        let o = o.reshape((d.heads, s.len, d.head_dim))?.transpose(0, 1)?.reshape((s.len, d.heads * d.head_dim))?;
        outs.push(o);
    }
    Ok(Tensor::cat(&outs, 0)?)
}
