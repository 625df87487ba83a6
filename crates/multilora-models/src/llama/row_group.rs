//! A step's decoder layers over a group of its rows ([`RowGroup`]), in the two phases of a layer
//! that touch the KV cache: [`RowGroup::write`] (the keys and queries rotated, the new keys and
//! values written into the cache) and [`RowGroup::read`] (the attention over the cache, then `o`,
//! the MLP and the next layer's norm and q/k/v); where a group stands is one [`Phase`].
//!
//! A step is one row group, its phases one after the other, each op's parallel regions on every
//! thread. A decode step of enough rows runs as several groups side by side instead, as many as
//! the pool says ([`multilora_cpu::pool::row_groups`]; [`groups`], [`side_by_side`]): each
//! group's thread takes its rows through every layer, its parallel regions on its share of the
//! pool's threads (none of its own on two threads: each group alone), and the groups meet only
//! between phases — every group's cache writes before any group reads
//! that layer, every group's reads before any group writes the next (the cache is one buffer
//! behind one lock, and a group's attention holds it for reading). The step is planned once, in
//! group order, and each group's plan is cut from it ([`StepPlan::cut`]). Each thread then
//! streams all the weights (the products stay compute-bound at these rows), and what goes is the
//! other threads waiting at the end of each of the step's ~390 parallel regions and through the
//! serial code between them. Every row's result is the same either way: each op computes a row
//! alone.

use std::ops::Range;

use candle_core::Tensor;

use super::Model;
use crate::attention::{AttnDims, paged_attention, query_scale, write_kv};
use multilora_layers::{LoraMapping, ReadAhead};
use multilora_types::SlotId;

use crate::batch::{Batch, KvWrites, StepPlan};
use crate::config::HiddenAct;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::rope::Rope;

/// Rows a group takes at least: below that the weights' second stream costs more than the regions
/// it saves (SmolLM2's 16-row LoRA step on two threads: 2 and 4 rows 1–2% slower as two groups,
/// 6 rows 6% faster).
const MIN_GROUP_ROWS: usize = 3;

/// Where a row group stands between two phases.
enum Phase {
    /// Layer `layer`'s q/k/v made, its keys and values not yet written.
    Projected { layer: usize, qkv: Tensor },
    /// Layer `layer`'s keys and values written; its rotated, scaled queries.
    Written { layer: usize, q: Tensor },
    /// The last layer read: its output, which the final norm adds into `x`.
    Done { residual: Tensor },
    /// Between the two halves of a phase (never seen outside one).
    Moving,
}

/// One group of a step's rows on its way through the layers.
pub(super) struct RowGroup<'a> {
    model: &'a Model,
    cache: &'a KvCache,
    plan: &'a StepPlan,
    cos: Tensor,
    sin: Tensor,
    /// The sliding layers' cos/sin rows when their RoPE base differs (Gemma 3).
    local: Option<(Tensor, Tensor)>,
    dims: AttnDims,
    /// The residual stream (through the last layer's attention output once it is added).
    x: Tensor,
    phase: Phase,
    /// What each product asks to be cached (its own slots; during `gate_up` and again during the
    /// next `qkv`, the next attention's KV rows): emptied by each product, so one allocation
    /// serves them all.
    ahead: ReadAhead,
}

impl<'a> RowGroup<'a> {
    /// The rows `plan` plans (over `cache`), embedded and through the first layer's q/k/v.
    pub(super) fn new(model: &'a Model, cache: &'a KvCache, plan: &'a StepPlan) -> Result<RowGroup<'a>> {
        let cfg = &model.cfg;
        let dims = AttnDims {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: cache.config().block_size,
        };
        let (cos, sin) = model.rope.gather(&plan.positions)?;
        let local = model.rope_local.as_ref().map(|r| r.gather(&plan.positions)).transpose()?;
        let x = model.embed.forward(&plan.ids, &plan.token_mapping)?;
        // Gemma's embedding times √hidden (made at load, in the activations' dtype).
        let x = match &model.embed_scale {
            Some(s) => x.broadcast_mul(s)?,
            None => x,
        };
        let mut group =
            RowGroup { model, cache, plan, cos, sin, local, dims, x, phase: Phase::Moving, ahead: ReadAhead::new() };
        group.project(0, None)?;
        Ok(group)
    }

    /// Layer `l`'s first phase: its keys and values (from the last phase's q/k/v) rotated and
    /// written into the cache, its queries rotated and scaled.
    pub(super) fn write(&mut self, l: usize) -> Result<()> {
        let qkv = match std::mem::replace(&mut self.phase, Phase::Moving) {
            Phase::Projected { layer, qkv } if layer == l => qkv,
            _ => return Err(Error::KvCache { reason: format!("layer {l}: keys written before their projection") }),
        };
        let qkv = match &self.model.layers[l].qk_norm {
            Some((qn, kn)) => self.qk_normed(&qkv, qn, kn)?,
            None => qkv,
        };
        let (ck, cv) = self.cache.layer(l);
        let d = self.dims;
        let q_scale = query_scale(d, self.model.cfg.query_pre_attn_scalar);
        let sliding = self.model.cfg.layer_window(l).is_some();
        let (cos, sin) = match (&self.local, sliding) {
            (Some((c, s)), true) => (c, s),
            _ => (&self.cos, &self.sin),
        };
        let writes = self.plan.kv_writes(sliding);
        // The rotation, the queries' scale and the cache write in one pass on the CPU, in one
        // launch on CUDA; otherwise as tensor ops.
        let fused = match writes {
            KvWrites::Host(rows) => {
                multilora_layers::rope_write_kv(&qkv, (cos, sin), d, (ck, cv), rows, Some(q_scale))?
            }
            KvWrites::Rows(slots) => multilora_layers::rope_kv_write(&qkv, (cos, sin), d, (ck, cv), slots, q_scale)?,
        };
        let q = match fused {
            Some(q) => q,
            None => {
                let cfg = &self.model.cfg;
                let (tokens, qs, kvs) = (qkv.dim(0)?, cfg.q_size(), cfg.kv_size());
                let q = qkv.narrow(1, 0, qs)?.reshape((tokens, d.heads, d.head_dim))?;
                let k = qkv.narrow(1, qs, kvs)?.reshape((tokens, d.kv_heads, d.head_dim))?;
                let v = qkv.narrow(1, qs + kvs, kvs)?;
                let k = Rope::apply(&k, cos, sin)?.reshape((tokens, kvs))?;
                write_kv(writes, ck, cv, &k, &v)?;
                (Rope::apply(&q, cos, sin)? * q_scale)?
            }
        };
        self.phase = Phase::Written { layer: l, q };
        Ok(())
    }

    /// `qkv` with each query head RMS-normed by `qn` and each key head by `kn` (Qwen3), the
    /// values as they were.
    fn qk_normed(&self, qkv: &Tensor, qn: &Tensor, kn: &Tensor) -> Result<Tensor> {
        let cfg = &self.model.cfg;
        let (tokens, qs, kvs, d) = (qkv.dim(0)?, cfg.q_size(), cfg.kv_size(), self.dims);
        let eps = cfg.rms_norm_eps as f32;
        let heads = |at: usize, width: usize, n: usize, w: &Tensor| -> Result<Tensor> {
            let x = qkv.narrow(1, at, width)?.contiguous()?.reshape((tokens, n, d.head_dim))?;
            Ok(multilora_layers::rms_norm(&x, w, eps)?.reshape((tokens, width))?)
        };
        let q = heads(0, qs, d.heads, qn)?;
        let k = heads(qs, kvs, d.kv_heads, kn)?;
        Ok(Tensor::cat(&[&q, &k, &qkv.narrow(1, qs + kvs, kvs)?], 1)?)
    }

    /// Layer `l`'s second phase: the attention of its queries over the cache, the rest of the
    /// layer, and the next layer's norm and q/k/v (its keys and values for the next `write`).
    pub(super) fn read(&mut self, l: usize) -> Result<()> {
        let q = match std::mem::replace(&mut self.phase, Phase::Moving) {
            Phase::Written { layer, q } if layer == l => q,
            _ => return Err(Error::KvCache { reason: format!("layer {l} attended before its keys were written") }),
        };
        let (ck, cv) = self.cache.layer(l);
        let sliding = self.model.cfg.layer_window(l).is_some();
        let attn = paged_attention(self.plan, sliding, &q, ck, cv, self.dims)?;
        let residual = self.after_attention(l, &attn)?;
        match l + 1 < self.model.layers.len() {
            true => self.project(l + 1, Some(residual)),
            false => {
                self.phase = Phase::Done { residual };
                Ok(())
            }
        }
    }

    /// The rows that give logits, after the last layer's `read`, through the final norm
    /// (`[logit rows, hidden]`); `None` when none of its rows gives logits.
    pub(super) fn finish(self) -> Result<Option<Tensor>> {
        let Phase::Done { residual } = self.phase else {
            return Err(Error::KvCache { reason: "the final norm before the last layer was read".into() });
        };
        // The logit mapping has a row for each row that gives logits.
        if self.plan.logit_mapping.num_rows() == 0 {
            return Ok(None);
        }
        let eps = self.model.cfg.rms_norm_eps as f32;
        // Only the rows that give logits go on: the last residual added to them alone.
        let (x, residual) = match &self.plan.logit_rows {
            Some(rows) => (self.x.index_select(rows, 0)?, residual.index_select(rows, 0)?),
            None => (self.x, residual),
        };
        Ok(Some(multilora_layers::add_rms_norm(&x, &residual, &self.model.norm, eps)?.1))
    }

    /// Layer `l`'s norm (the last layer's output, `residual`, added first) and q/k/v.
    fn project(&mut self, l: usize, residual: Option<Tensor>) -> Result<()> {
        let layer = &self.model.layers[l];
        let h = self.add_norm(residual, &layer.input_norm)?;
        // The attention right after reads these cache rows: asked for during the last layer's
        // `gate_up` already (`after_attention`), and again here, for the lines the products in
        // between pushed out of this core's L2 (each group streams every weight through it).
        self.ask_for_context(l);
        let qkv = layer.qkv.forward_ahead(&h, &self.plan.token_mapping, &mut self.ahead)?;
        self.phase = Phase::Projected { layer: l, qkv };
        Ok(())
    }

    /// Adds the cache rows layer `l`'s attention reads to what the next product asks for.
    fn ask_for_context(&mut self, l: usize) {
        let sliding = self.model.cfg.layer_window(l).is_some();
        let context_rows = self.plan.attn(sliding).1.map_or(&[][..], |g| g.host_ctx.as_slice());
        if let Some(kv) = self.cache.host_rows(l) {
            self.ahead.push_listed_rows(&kv, context_rows);
        }
    }

    /// `x` plus `residual` (kept as the new `x`), normed by `weight`.
    fn add_norm(&mut self, residual: Option<Tensor>, weight: &Tensor) -> Result<Tensor> {
        let eps = self.model.cfg.rms_norm_eps as f32;
        Ok(match residual {
            Some(d) => {
                let (sum, h) = multilora_layers::add_rms_norm(&self.x, &d, weight, eps)?;
                self.x = sum;
                h
            }
            None => multilora_layers::rms_norm(&self.x, weight, eps)?,
        })
    }

    /// Layer `l` after its attention: `o`, the residual add and norm, the MLP; its output, the
    /// residual the next norm adds.
    fn after_attention(&mut self, l: usize, attn: &Tensor) -> Result<Tensor> {
        let (m, map) = (self.model, &self.plan.token_mapping);
        let layer = &m.layers[l];
        let eps = m.cfg.rms_norm_eps as f32;
        let o = layer.o.forward_ahead(attn, map, &mut self.ahead)?;
        // Gemma norms the attention's and the MLP's outputs before each residual add.
        let o = match &layer.sandwich {
            Some((attn_out, _)) => multilora_layers::rms_norm(&o, attn_out, eps)?,
            None => o,
        };
        let h = self.add_norm(Some(o), &layer.post_norm)?;
        // The next layer's attention reads its sequences' cache rows: asked for while this
        // compute-bound product runs (see `ReadAhead`).
        self.ask_for_context(l + 1);
        let gu = layer.gate_up.forward_ahead(&h, map, &mut self.ahead)?;
        let inter = m.cfg.intermediate_size;
        // SiLU or GELU's tanh form in one pass on the CPU; otherwise the activation, then the
        // product.
        let fused = match m.cfg.hidden_act {
            HiddenAct::Silu => multilora_layers::silu_mul(&gu, inter)?,
            HiddenAct::GeluTanh => multilora_layers::gelu_tanh_mul(&gu, inter)?,
            HiddenAct::Gelu => None,
        };
        let act = match fused {
            Some(act) => act,
            None => {
                let g = gu.narrow(1, 0, inter)?;
                let gate = match m.cfg.hidden_act {
                    HiddenAct::Silu => candle_nn::ops::silu(&g)?,
                    HiddenAct::Gelu => g.gelu_erf()?,
                    HiddenAct::GeluTanh => g.gelu()?,
                };
                (gate * gu.narrow(1, inter, inter)?)?
            }
        };
        let down = layer.down.forward_ahead(&act, map, &mut self.ahead)?;
        Ok(match &layer.sandwich {
            Some((_, mlp_out)) => multilora_layers::rms_norm(&down, mlp_out, eps)?,
            None => down,
        })
    }
}

/// `batch`'s sequences in row-group order and the rows each group takes, or `None` when the step
/// runs as one group: as groups only on the CPU, for a decode step (one new token a sequence) of
/// rows enough for [`multilora_cpu::pool::row_groups`] to cut it.
/// The sequences are ordered by adapter before they are cut, so that each adapter's slots are
/// read by one thread (at most one adapter's rows straddle a cut).
pub(super) fn groups(model: &Model, batch: &Batch) -> Option<(Vec<usize>, Vec<Range<usize>>)> {
    let n = batch.seqs.len();
    let decode = batch.seqs.iter().all(|s| s.tokens.len() == 1);
    let count = multilora_cpu::pool::row_groups(n, MIN_GROUP_ROWS);
    if !model.device.is_cpu() || !decode || count < 2 {
        return None;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (batch.seqs[i].slot.map(|s| s.index()), i));
    let cuts: Vec<Range<usize>> = (0..count).map(|g| g * n / count..(g + 1) * n / count).collect();
    Some((order, cuts))
}

/// The decoder layers of `batch` as row groups side by side (`order`: its sequences in group
/// order, `cuts`: each group's rows of it), phase by phase; the rows that give logits, through
/// the final norm, in `batch`'s order, with their mapping for `lm_head`.
pub(super) fn side_by_side(
    model: &Model,
    cache: &KvCache,
    batch: &Batch,
    (order, cuts): (Vec<usize>, Vec<Range<usize>>),
) -> Result<Option<(Tensor, LoraMapping)>> {
    let lim = model.limits(cache);
    let ordered = Batch::new(order.iter().map(|&i| batch.seqs[i].clone()).collect());
    // Planned (and checked) once; each group's plan cut from it. A refused sequence is named by
    // its place in `batch`, not in the group order.
    let plan = StepPlan::new(&ordered, lim, &model.device, &model.upload).map_err(|e| match e {
        Error::InvalidBatch { seq, reason } => {
            Error::InvalidBatch { seq: order.get(seq).copied().unwrap_or(seq), reason }
        }
        other => other,
    })?;
    let plans = cuts.into_iter().map(|r| plan.cut(&ordered, r, lim.max_loras)).collect::<Result<Vec<_>>>()?;
    // Each group embedded and through the first layer's q/k/v on its own thread.
    let mut parts: Vec<&StepPlan> = plans.iter().collect();
    let mut groups = multilora_cpu::pool::side_by_side(&mut parts, |p| RowGroup::new(model, cache, p))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    for l in 0..model.layers.len() {
        phase(&mut groups, |g| g.write(l))?;
        phase(&mut groups, |g| g.read(l))?;
    }
    let outs: Vec<Tensor> =
        groups.into_iter().map(RowGroup::finish).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
    if outs.is_empty() {
        return Ok(None);
    }
    let rows = Tensor::cat(&outs, 0)?;
    // The groups' logit rows in group order; `place[i]`: sequence `i`'s among them.
    let mut place = vec![None; batch.seqs.len()];
    let mut next = 0u32;
    for &i in &order {
        if batch.seqs[i].num_logit_rows() > 0 {
            place[i] = Some(next);
            next += 1;
        }
    }
    let slots: Vec<Option<SlotId>> = batch.seqs.iter().filter(|s| s.num_logit_rows() > 0).map(|s| s.slot).collect();
    let mapping = LoraMapping::new(&slots, lim.max_loras, &model.device)?;
    let back: Vec<u32> = place.into_iter().flatten().collect();
    if back.iter().enumerate().all(|(p, &r)| p as u32 == r) {
        return Ok(Some((rows, mapping)));
    }
    let index = Tensor::from_vec(back, next as usize, rows.device())?;
    Ok(Some((rows.index_select(&index, 0)?, mapping)))
}

/// `f` on every group, side by side; the first error, if any.
fn phase(groups: &mut [RowGroup<'_>], f: impl Fn(&mut RowGroup<'_>) -> Result<()> + Sync) -> Result<()> {
    multilora_cpu::pool::side_by_side(groups, f).into_iter().collect()
}
