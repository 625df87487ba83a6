//! Causal grouped-query attention of each sequence over its paged context.
//!
//! For a sequence with `len` new tokens and `ctx = start_pos + len` positions in the cache:
//! `softmax(q · kᵀ / √d + mask) · v` with `q: [heads, len, d]` and `k, v: [kv_heads, ctx, d]`.
//! The `heads / kv_heads` query heads that share a KV head are stacked into one matrix
//! (`[kv_heads, group · len, d]`), so GQA needs no copy of K or V.
//!
//! On the CPU (f32 queries) a prefill sequence streams: `multilora_layers::prefill_attention_rows`
//! reads its keys and values from the cache rows in place, tiles of queries × blocks of keys with
//! an online softmax, a workspace of a few hundred KiB a thread whatever the prompt's length.
//! Elsewhere (CUDA) it attends with candle ops in tiles of query rows ([`query_tile`]), each over
//! the keys its rows can see (up to its last row's position, from its first row's window start):
//! the scores and probabilities of a step stay within [`SCORES_BYTES`], the causal mask is made
//! per tile, and the keys no row of a tile sees are never multiplied. That path with one tile is
//! the materialising oracle of the tests.

use candle_core::{DType, Tensor};

use multilora_layers::{
    CausalSpan, decode_attention_rows, paged_decode_attention, paged_kv_write, prefill_attention_rows, write_kv_rows,
};

use crate::batch::{DecodeGroup, DecodeReads, KvWrites, SeqPlan, StepPlan};
use crate::error::Result;

/// What one query tile's f32 scores, their masked sum and softmax may take together: a prompt of
/// any length attends within it (the K and V it gathers, `2 · ctx · kv_heads · head_dim`, beside).
pub(crate) const SCORES_BYTES: usize = 48 << 20;

/// Query rows a tile of a sequence with `ctx` context keys holds under `budget` bytes of scores
/// (three f32 buffers of `heads × rows × ctx`), at least one.
pub(crate) fn query_tile(heads: usize, ctx: usize, budget: usize) -> usize {
    (budget / (12 * heads.max(1) * ctx.max(1))).max(1)
}

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
        let span = CausalSpan { start: s.start, lo: s.lo, window: s.window };
        let qs = q.narrow(0, s.offset, s.len)?;
        match prefill_attention_rows(&qs, cache_k, cache_v, &s.host_rows, span, d)? {
            Some(o) => outs.push(o),
            None => outs.push(prefill_attention(s, q, cache_k, cache_v, d, SCORES_BYTES)?),
        }
    }
    let out = if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(&outs, 0)? };
    Ok(match &plan.unpermute {
        Some(index) => out.index_select(index, 0)?,
        None => out,
    })
}

/// One prefill sequence's attention (`q` the step's queries, already scaled), in tiles of query
/// rows whose scores take at most `budget` bytes: `[len, heads · head_dim]`.
fn prefill_attention(
    s: &SeqPlan,
    q: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
    d: AttnDims,
    budget: usize,
) -> Result<Tensor> {
    let group = d.heads / d.kv_heads;
    let ctx = s.ctx_rows.dim(0)?;
    // K and V of the whole context once, `[kv_heads, ctx, d]`; each tile reads a range of it.
    let gather = |c: &Tensor| -> Result<Tensor> {
        Ok(c.index_select(&s.ctx_rows, 0)?
            .to_dtype(q.dtype())?
            .reshape((ctx, d.kv_heads, d.head_dim))?
            .transpose(0, 1)?
            .contiguous()?)
    };
    let (k, v) = (gather(cache_k)?, gather(cache_v)?);
    let tile = query_tile(d.heads, ctx, budget);
    let mut outs = Vec::with_capacity(s.len.div_ceil(tile));
    for from in (0..s.len).step_by(tile) {
        let n = tile.min(s.len - from);
        // The keys the tile's rows see: from its first row's window start to its last row.
        let (q0, q1) = (s.start + from, s.start + from + n - 1);
        let (k_lo, k_hi) = (s.first(q0) - s.lo, q1 + 1 - s.lo);
        let kn = k_hi - k_lo;
        // [n, heads, d] → [heads, n, d] → [kv_heads, group · n, d].
        let qs = q.narrow(0, s.offset + from, n)?.transpose(0, 1)?.contiguous()?.reshape((
            d.kv_heads,
            group * n,
            d.head_dim,
        ))?;
        let (kt, vt) = (k.narrow(1, k_lo, kn)?, v.narrow(1, k_lo, kn)?);
        // Softmax in f32 even for half-precision models: the row sums are what loses precision.
        let mut scores = qs.matmul(&kt.t()?)?.to_dtype(DType::F32)?;
        let mask: Vec<f32> = (q0..=q1)
            .flat_map(|q| {
                let first = s.first(q);
                (s.lo + k_lo..s.lo + k_hi).map(move |p| if p <= q && p >= first { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        if mask.iter().any(|m| *m != 0.0) {
            let mask = Tensor::from_vec(mask, (n, kn), q.device())?;
            scores = scores.reshape((d.kv_heads, group, n, kn))?.broadcast_add(&mask)?.reshape((
                d.kv_heads,
                group * n,
                kn,
            ))?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(q.dtype())?;
        let o = probs.matmul(&vt)?; // [kv_heads, group · n, d]
        outs.push(o.reshape((d.heads, n, d.head_dim))?.transpose(0, 1)?.reshape((n, d.heads * d.head_dim))?);
    }
    Ok(if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(&outs, 0)? })
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

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use multilora_layers::MetaToDevice;
    use multilora_types::SplitMix64;

    use super::*;
    use crate::batch::{Batch, Limits, SeqInput};

    fn random(rng: &mut SplitMix64, shape: (usize, usize)) -> Result<Tensor> {
        let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| rng.next_f32() * 2.0 - 1.0).collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// Tiles of 1, 2, 3 and 7 query rows, and the CPU's streaming kernel, give what one tile over
    /// the whole context gives (the materialising oracle) within 1e-5: grouped query heads, a
    /// cached prefix of 5 (the new rows start mid-block), 11 new rows (odd), with and without a
    /// sliding window of 3.
    #[test]
    fn query_tiles_equal_one_tile() -> Result<()> {
        let d = AttnDims { heads: 4, kv_heads: 2, head_dim: 8, block_size: 4 };
        let (start, len, bs) = (5, 11, 4);
        let mut rng = SplitMix64::new(7);
        let (cache_k, cache_v) = (random(&mut rng, (32, 16))?, random(&mut rng, (32, 16))?);
        let q = random(&mut rng, (len, 32))?.reshape((len, 4, 8))?;
        for window in [None, Some(3)] {
            let lim = Limits {
                vocab: 10,
                max_len: 64,
                max_loras: 1,
                num_blocks: 8,
                sliding_blocks: None,
                block_size: bs,
                paged_decode: false,
                window,
                mixed_windows: false,
                long_rope: None,
            };
            let batch = Batch::new(vec![SeqInput::new(vec![1; len], start, vec![7, 2, 5, 0, 3], None)]);
            let plan = StepPlan::new(&batch, lim, &Device::Cpu, &MetaToDevice::new())?;
            let s = &plan.seqs[0];
            let ctx = s.ctx_rows.dim(0)?;
            let oracle = prefill_attention(s, &q, &cache_k, &cache_v, d, usize::MAX)?;
            for rows in [1, 2, 3, 7] {
                assert_eq!(query_tile(d.heads, ctx, 12 * d.heads * ctx * rows), rows);
                let tiled = prefill_attention(s, &q, &cache_k, &cache_v, d, 12 * d.heads * ctx * rows)?;
                let diff = (&tiled - &oracle)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert!(diff <= 1e-5, "window {window:?}, tiles of {rows}: {diff}");
            }
            // The CPU's streaming kernel, reading the cache rows in place.
            let span = CausalSpan { start: s.start, lo: s.lo, window: s.window };
            let streamed =
                prefill_attention_rows(&q, &cache_k, &cache_v, &s.host_rows, span, d)?.expect("f32 on the cpu");
            let diff = (&streamed - &oracle)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff <= 1e-5, "window {window:?}, streamed: {diff}");
        }
        Ok(())
    }
}
