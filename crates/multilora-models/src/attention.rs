//! Causal grouped-query attention of each sequence over its paged context.
//!
//! For a sequence with `len` new tokens and `ctx = start_pos + len` positions in the cache:
//! `softmax(q · kᵀ / √d + mask) · v` with `q: [heads, len, d]` and `k, v: [kv_heads, ctx, d]`.
//! The `heads / kv_heads` query heads that share a KV head are stacked into one matrix
//! (`[kv_heads, group · len, d]`), so GQA needs no copy of K or V.

use candle_core::{DType, Tensor};

use multilora_layers::{decode_attention_rows, paged_decode_attention, paged_kv_write, write_kv_rows};

use crate::batch::{DecodeGroup, DecodeReads, KvWrites, StepPlan};
use crate::error::Result;

/// Shapes of the attention (the layers' decode-kernel shapes).
pub(crate) use multilora_layers::PagedDecodeDims as AttnDims;

/// Writes the step's new `k`, `v` (`[tokens, kv_heads · head_dim]`) into the layer's cache rows
/// (`writes`, [`StepPlan::kv_writes`]).
/// Keys and values are rounded to the cache's dtype (bf16 / f16 caches under f32 activations on
/// the CPU). On the CPU in place from the step's rows on the host; on CUDA the KV-write kernel
/// reads each token's row from the step's rows directly (one block per token; `v`, a column range
/// of the fused qkv output, is read in place).
pub(crate) fn write_kv(writes: &KvWrites, cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let dt = cache_k.dtype();
    match writes {
        KvWrites::Host(rows) => write_kv_rows(cache_k, cache_v, k, v, rows)?,
        KvWrites::Rows(rows) => paged_kv_write(cache_k, cache_v, &k.to_dtype(dt)?, &v.to_dtype(dt)?, rows)?,
    }
    Ok(())
}

/// Attention's query scale, `1 / √head_dim`, or `1 / √s` for Gemma's `query_pre_attn_scalar` `s`.
pub(crate) fn query_scale(d: AttnDims, query_pre_attn_scalar: Option<f64>) -> f64 {
    1.0 / query_pre_attn_scalar.unwrap_or(d.head_dim as f64).sqrt()
}

/// `q: [tokens, heads, head_dim]` (already rotated and times [`query_scale`]) → `[tokens, heads ·
/// head_dim]`, each sequence attending over its rows of the cache (which already hold this step's
/// keys and values), over the sliding layers' contexts when `sliding` ([`StepPlan::attn`]).
pub(crate) fn paged_attention(
    plan: &StepPlan,
    sliding: bool,
    q: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    d: AttnDims,
) -> Result<Tensor> {
    let group = d.heads / d.kv_heads;
    let (seqs, decode) = plan.attn(sliding);
    let mut outs = Vec::with_capacity(seqs.len() + 1);
    if let Some(g) = decode {
        let qd = match &g.rows {
            Some(rows) => q.index_select(rows, 0)?,
            None => q.narrow(0, 0, g.n)?,
        };
        match &g.reads {
            DecodeReads::Paged { block_tables, ctx_lens } => {
                outs.push(paged_decode_attention(&qd, cache_k, cache_v, block_tables, ctx_lens, d)?);
            }
            DecodeReads::Gathered { ctx_rows, mask } => {
                // On the CPU the cache rows are read in place; elsewhere gathered with tensor ops.
                match decode_attention_rows(&qd, cache_k, cache_v, &g.host_ctx, d)? {
                    Some(o) => outs.push(o),
                    None => outs.push(decode_tensor_ops(&qd, cache_k, cache_v, g, ctx_rows, mask.as_ref(), d)?),
                }
            }
        }
    }
    for s in seqs {
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
