//! Causal grouped-query attention of each sequence over its paged context.
//!
//! For a sequence with `len` new tokens and `ctx = start_pos + len` positions in the cache:
//! `softmax(q · kᵀ / √d + mask) · v` with `q: [heads, len, d]` and `k, v: [kv_heads, ctx, d]`.
//! The `heads / kv_heads` query heads that share a KV head are stacked into one matrix
//! (`[kv_heads, group · len, d]`), so GQA needs no copy of K or V.

use candle_core::{DType, Layout, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use multilora_layers::{Elem, PagedDecodeDims, paged_decode_attention};

use crate::batch::{DecodeGroup, DecodeReads, StepPlan};
use crate::error::Result;

/// Shapes of the attention.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnDims {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
}

/// Writes the step's new `k`, `v` (`[tokens, kv_heads · head_dim]`) into the layer's cache rows.
/// Keys and values are rounded to the cache's dtype (bf16 / f16 caches under f32 activations on
/// the CPU).
pub(crate) fn write_kv(plan: &StepPlan, cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let dt = cache_k.dtype();
    cache_k.scatter_set(&plan.write_index, &k.to_dtype(dt)?.contiguous()?, 0)?;
    cache_v.scatter_set(&plan.write_index, &v.to_dtype(dt)?.contiguous()?, 0)?;
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
    let mut outs = Vec::with_capacity(plan.seqs.len() + 1);
    if let Some(g) = &plan.decode {
        let qd = match &g.rows {
            Some(rows) => q.index_select(rows, 0)?,
            None => q.narrow(0, 0, g.n)?,
        };
        match &g.reads {
            DecodeReads::Paged { block_tables, ctx_lens } => {
                let pd = PagedDecodeDims {
                    heads: d.heads,
                    kv_heads: d.kv_heads,
                    head_dim: d.head_dim,
                    block_size: d.block_size,
                };
                outs.push(paged_decode_attention(&qd, cache_k, cache_v, block_tables, ctx_lens, pd)?);
            }
            DecodeReads::Gathered { ctx_rows, mask } => match decode_in_place(&qd, cache_k, cache_v, g, d)? {
                Some(o) => outs.push(o),
                None => outs.push(decode_tensor_ops(&qd, cache_k, cache_v, g, ctx_rows, mask.as_ref(), d)?),
            },
        }
    }
    for s in &plan.seqs {
        let ctx = s.ctx_rows.dim(0)?;
        // [len, heads, d] → [heads, len, d] → [kv_heads, group · len, d].
        let qs = q.narrow(0, s.offset, s.len)?.transpose(0, 1)?.contiguous()?.reshape((
            d.kv_heads,
            group * s.len,
            d.head_dim,
        ))?;
        let gather = |c: &Tensor| -> Result<Tensor> {
            Ok(c.index_select(&s.ctx_rows, 0)?
                .to_dtype(q.dtype())?
                .reshape((ctx, d.kv_heads, d.head_dim))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let (k, v) = (gather(cache_k)?, gather(cache_v)?);
        // Softmax in f32 even for half-precision models: the row sums are what loses precision.
        let scores = qs.matmul(&k.t()?)?.to_dtype(DType::F32)?;
        let scores = scores.reshape((d.kv_heads, group, s.len, ctx))?.broadcast_add(&s.mask)?.reshape((
            d.kv_heads,
            group * s.len,
            ctx,
        ))?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(q.dtype())?;
        let o = probs.matmul(&v)?; // [kv_heads, group · len, d]
        let o = o.reshape((d.heads, s.len, d.head_dim))?.transpose(0, 1)?.reshape((s.len, d.heads * d.head_dim))?;
        outs.push(o);
    }
    let out = if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(&outs, 0)? };
    Ok(match &plan.unpermute {
        Some(index) => out.index_select(index, 0)?,
        None => out,
    })
}

/// The decode group with candle ops: contexts gathered from the cache, padded and transposed to
/// `[n, kv_heads, max_ctx, d]`, then two batched matmuls. `qd: [n, heads, d]`, already scaled.
fn decode_tensor_ops(
    qd: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    g: &DecodeGroup,
    ctx_rows: &Tensor,
    mask: Option<&Tensor>,
    d: AttnDims,
) -> Result<Tensor> {
    let group = d.heads / d.kv_heads;
    let qd = qd.reshape((g.n, d.kv_heads, group, d.head_dim))?;
    let gather = |c: &Tensor| -> Result<Tensor> {
        Ok(c.index_select(ctx_rows, 0)?
            .to_dtype(qd.dtype())?
            .reshape((g.n, g.max_ctx, d.kv_heads, d.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let (k, v) = (gather(cache_k)?, gather(cache_v)?);
    let mut scores = qd.matmul(&k.transpose(2, 3)?)?.to_dtype(DType::F32)?;
    if let Some(mask) = mask {
        scores = scores.broadcast_add(mask)?;
    }
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(qd.dtype())?;
    Ok(probs.matmul(&v)?.reshape((g.n, d.heads * d.head_dim))?)
}

/// The decode group on the CPU (f32 queries over an f32, bf16 or f16 cache), reading each
/// sequence's keys and values straight from the cache rows (no gather, no transpose, no padding;
/// half-precision values widened as they are read): per sequence and query head,
/// `softmax(q · kᵀ) · v` over its own context, sequences side by side on the rayon pool.
/// `None` when the operands are not contiguous CPU tensors of those dtypes.
fn decode_in_place(
    qd: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    g: &DecodeGroup,
    d: AttnDims,
) -> Result<Option<Tensor>> {
    if qd.dtype() != DType::F32 || !qd.device().is_cpu() || cache_v.dtype() != cache_k.dtype() {
        return Ok(None);
    }
    match cache_k.dtype() {
        DType::F32 => decode_with::<f32>(qd, cache_k, cache_v, g, d),
        DType::BF16 => decode_with::<bf16>(qd, cache_k, cache_v, g, d),
        DType::F16 => decode_with::<f16>(qd, cache_k, cache_v, g, d),
        _ => Ok(None),
    }
}

/// [`decode_in_place`] over a cache of element `E`.
fn decode_with<E: Elem>(
    qd: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    g: &DecodeGroup,
    d: AttnDims,
) -> Result<Option<Tensor>> {
    let qd = qd.contiguous()?;
    let (qg, ql) = qd.storage_and_layout();
    let (kg, kl) = cache_k.storage_and_layout();
    let (vg, vl) = cache_v.storage_and_layout();
    let (Some(q), Some(k), Some(v)) = (cpu_values::<f32>(&qg, ql), cpu_values::<E>(&kg, kl), cpu_values::<E>(&vg, vl))
    else {
        return Ok(None);
    };
    let (hd, heads) = (d.head_dim, d.heads);
    let group = heads / d.kv_heads;
    let width = d.kv_heads * hd;
    let rows_ok = g.host_ctx.iter().flatten().all(|&r| (r as usize + 1) * width <= k.len().min(v.len()));
    if q.len() < g.n * heads * hd || g.host_ctx.len() != g.n || !rows_ok {
        return Ok(None);
    }
    let mut out = vec![0f32; g.n * heads * hd];
    out.par_chunks_mut(heads * hd).zip(&g.host_ctx).enumerate().for_each(|(b, (o, rows))| {
        let mut scores = vec![0f32; rows.len()];
        for h in 0..heads {
            let col = (h / group) * hd;
            let qh = &q[(b * heads + h) * hd..][..hd];
            let mut max = f32::NEG_INFINITY;
            for (s, &r) in scores.iter_mut().zip(rows) {
                *s = dot(qh, &k[r as usize * width + col..][..hd]);
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let oh = &mut o[h * hd..][..hd];
            for (&s, &r) in scores.iter().zip(rows) {
                let p = s / sum;
                for (a, &x) in oh.iter_mut().zip(&v[r as usize * width + col..][..hd]) {
                    *a += p * x.to_f32();
                }
            }
        }
    });
    drop((qg, kg, vg));
    Ok(Some(Tensor::from_vec(out, (g.n, heads * hd), qd.device())?))
}

/// `a · b` with eight partial sums, so the compiler vectorises it.
fn dot<E: Elem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y.to_f32()).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l].to_f32();
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The contiguous values of a CPU tensor of element `E` from its layout's start, if it is one.
fn cpu_values<'a, E: Elem>(storage: &'a Storage, layout: &Layout) -> Option<&'a [E]> {
    match storage {
        Storage::Cpu(cpu) if layout.is_contiguous() => E::slice(cpu)?.get(layout.start_offset()..),
        _ => None,
    }
}
