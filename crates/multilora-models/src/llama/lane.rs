//! A step's decoder layers over a set of its rows ([`Lane`]), in the two phases of a layer that
//! touch the KV cache: [`Lane::write`] (the keys and queries rotated, the new keys and values
//! written into the cache) and [`Lane::read`] (the attention over the cache, then `o`, the MLP
//! and the next layer's norm and q/k/v).
//!
//! A step is one lane, its phases one after the other, each op's parallel regions on every
//! thread. A decode step of enough rows on a pool of two threads runs as two lanes side by side
//! instead ([`halves`], [`side_by_side`]): each thread takes half the rows through every layer
//! alone, with no parallel region of its own, and the two meet only between phases — every
//! lane's cache writes before any lane reads that layer, every lane's reads before any lane
//! writes the next (the cache is one buffer behind one lock, and a lane's attention holds it for
//! reading). Each thread then streams all the weights (the products stay compute-bound at these
//! rows), and what goes is the other thread waiting at the end of each of the step's ~390
//! parallel regions and through the serial code between them (docs/BENCHMARKS.md, "A twelfth
//! look"). Every row's result is the same either way: each op computes a row alone.

use candle_core::Tensor;
use multilora_layers::ReadAhead;

use super::Model;
use crate::attention::{AttnDims, paged_attention, query_scale, write_kv};
use crate::batch::{Batch, KvWrites, StepPlan};
use crate::config::HiddenAct;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::rope::Rope;

/// Rows a lane takes at least: below that the weights' second stream costs more than the regions
/// it saves (SmolLM2's 16-row LoRA step of docs/BENCHMARKS.md: 2 and 4 rows 1–2% slower as two
/// lanes, 6 rows 6% faster).
const MIN_LANE_ROWS: usize = 3;

/// One set of a step's rows on its way through the layers.
pub(super) struct Lane<'a> {
    model: &'a Model,
    cache: &'a KvCache,
    plan: &'a StepPlan,
    cos: Tensor,
    sin: Tensor,
    /// The sliding layers' cos/sin rows when their RoPE base differs (Gemma 3).
    local: Option<(Tensor, Tensor)>,
    dims: AttnDims,
    x: Tensor,
    /// The last layer's output, added into `x` together with the next norm.
    residual: Option<Tensor>,
    /// The next layer's q/k/v output, its keys and values not yet written: `(layer, qkv)`.
    qkv: Option<(usize, Tensor)>,
    /// The written layer's rotated, scaled queries: `(layer, q)`.
    q: Option<(usize, Tensor)>,
    /// What each product asks to be cached (its own slots; during `gate_up` and again during the
    /// next `qkv`, the next attention's KV rows): emptied by each product, so one allocation
    /// serves them all.
    ahead: ReadAhead,
}

impl<'a> Lane<'a> {
    /// The rows `plan` plans (over `cache`), embedded and through the first layer's q/k/v.
    pub(super) fn new(model: &'a Model, cache: &'a KvCache, plan: &'a StepPlan) -> Result<Lane<'a>> {
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
        let mut lane = Lane {
            model,
            cache,
            plan,
            cos,
            sin,
            local,
            dims,
            x,
            residual: None,
            qkv: None,
            q: None,
            ahead: ReadAhead::new(),
        };
        lane.project(0)?;
        Ok(lane)
    }

    /// Layer `l`'s first phase: its keys and values (from the last phase's q/k/v) rotated and
    /// written into the cache, its queries rotated and scaled.
    pub(super) fn write(&mut self, l: usize) -> Result<()> {
        let Some((_, qkv)) = self.qkv.take().filter(|(at, _)| *at == l) else {
            return Err(Error::KvCache { reason: format!("layer {l}: keys written before their projection") });
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
        // On the CPU, the rotation, the queries' scale and the cache write in one pass;
        // elsewhere as tensor ops.
        let fused = match writes {
            KvWrites::Host(rows) => {
                multilora_layers::rope_write_kv(&qkv, (cos, sin), d, (ck, cv), rows, Some(q_scale))?
            }
            _ => None,
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
        self.q = Some((l, q));
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
        let Some((_, q)) = self.q.take().filter(|(at, _)| *at == l) else {
            return Err(Error::KvCache { reason: format!("layer {l} attended before its keys were written") });
        };
        let (ck, cv) = self.cache.layer(l);
        let sliding = self.model.cfg.layer_window(l).is_some();
        let attn = paged_attention(self.plan, sliding, &q, ck, cv, self.dims)?;
        self.after_attention(l, &attn)?;
        if l + 1 < self.model.layers.len() {
            self.project(l + 1)?;
        }
        Ok(())
    }

    /// The rows that give logits, after the last layer's `read`, through the final norm
    /// (`[logit rows, hidden]`); `None` when none of its rows gives logits.
    pub(super) fn finish(self) -> Result<Option<Tensor>> {
        // The logit mapping has a row for each row that gives logits.
        if self.plan.logit_mapping.num_rows() == 0 {
            return Ok(None);
        }
        let eps = self.model.cfg.rms_norm_eps as f32;
        // Only the rows that give logits go on: the last residual added to them alone.
        let (x, residual) = match &self.plan.logit_rows {
            Some(rows) => (self.x.index_select(rows, 0)?, self.residual.map(|d| d.index_select(rows, 0)).transpose()?),
            None => (self.x, self.residual),
        };
        Ok(Some(match residual {
            Some(d) => multilora_layers::add_rms_norm(&x, &d, &self.model.norm, eps)?.1,
            None => multilora_layers::rms_norm(&x, &self.model.norm, eps)?,
        }))
    }

    /// Layer `l`'s norm (the last layer's output added first) and q/k/v.
    fn project(&mut self, l: usize) -> Result<()> {
        let layer = &self.model.layers[l];
        let h = self.add_norm(&layer.input_norm)?;
        // The attention right after reads these cache rows: asked for during the last layer's
        // `gate_up` already (`after_attention`), and again here, for the lines the products in
        // between pushed out of this core's L2 (each lane streams every weight through it).
        self.ask_for_context(l);
        self.qkv = Some((l, layer.qkv.forward_ahead(&h, &self.plan.token_mapping, &mut self.ahead)?));
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

    /// `x` plus the last layer's output (kept as the new `x`), normed by `weight`.
    fn add_norm(&mut self, weight: &Tensor) -> Result<Tensor> {
        let eps = self.model.cfg.rms_norm_eps as f32;
        Ok(match self.residual.take() {
            Some(d) => {
                let (sum, h) = multilora_layers::add_rms_norm(&self.x, &d, weight, eps)?;
                self.x = sum;
                h
            }
            None => multilora_layers::rms_norm(&self.x, weight, eps)?,
        })
    }

    /// Layer `l` after its attention: `o`, the residual add and norm, the MLP; its output kept
    /// as the residual the next norm adds.
    fn after_attention(&mut self, l: usize, attn: &Tensor) -> Result<()> {
        let (m, map) = (self.model, &self.plan.token_mapping);
        let layer = &m.layers[l];
        let eps = m.cfg.rms_norm_eps as f32;
        let o = layer.o.forward_ahead(attn, map, &mut self.ahead)?;
        // Gemma norms the attention's and the MLP's outputs before each residual add.
        let o = match &layer.sandwich {
            Some((attn_out, _)) => multilora_layers::rms_norm(&o, attn_out, eps)?,
            None => o,
        };
        self.residual = Some(o);
        let h = self.add_norm(&layer.post_norm)?;
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
        self.residual = Some(match &layer.sandwich {
            Some((_, mlp_out)) => multilora_layers::rms_norm(&down, mlp_out, eps)?,
            None => down,
        });
        Ok(())
    }
}

/// The two halves of `batch` (its sequences' indices) to run as lanes side by side, or `None`
/// when it runs as one: side by side only on the CPU, in a pool of exactly two threads (more
/// would each stream all the weights: past two, the step would turn memory-bound), for a
/// decode step (one new token a sequence) of at least `2 · MIN_LANE_ROWS` sequences. The
/// sequences are ordered by adapter before they are cut in two, so that each adapter's slots are
/// read by one thread (at most one adapter's rows straddle the cut).
pub(super) fn halves(model: &Model, batch: &Batch) -> Option<[Vec<usize>; 2]> {
    let n = batch.seqs.len();
    if !model.device.is_cpu()
        || multilora_layers::pool_threads() != 2
        || n < 2 * MIN_LANE_ROWS
        || batch.seqs.iter().any(|s| s.tokens.len() != 1)
    {
        return None;
    }
    let mut first: Vec<usize> = (0..n).collect();
    first.sort_by_key(|&i| (batch.seqs[i].slot.map(|s| s.index()), i));
    let second = first.split_off(n / 2);
    Some([first, second])
}

/// The decoder layers of `batch` as two lanes side by side (`halves` of its sequences), phase by
/// phase; the rows that give logits, through the final norm, in `batch`'s order (`None` when
/// none does).
pub(super) fn side_by_side(
    model: &Model,
    cache: &KvCache,
    batch: &Batch,
    halves: [Vec<usize>; 2],
) -> Result<Option<Tensor>> {
    let lim = model.limits(cache);
    let subs: Vec<Batch> =
        halves.iter().map(|h| Batch::new(h.iter().map(|&i| batch.seqs[i].clone()).collect())).collect();
    let plans = subs.iter().map(|b| StepPlan::new(b, lim, &model.device, &model.upload)).collect::<Result<Vec<_>>>()?;
    // Each lane embedded and through the first layer's q/k/v on its own thread.
    let mut parts: Vec<&StepPlan> = plans.iter().collect();
    let mut lanes = multilora_layers::side_by_side(&mut parts, |p| Lane::new(model, cache, p))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    for l in 0..model.layers.len() {
        phase(&mut lanes, |lane| lane.write(l))?;
        phase(&mut lanes, |lane| lane.read(l))?;
    }
    let outs: Vec<Tensor> =
        lanes.into_iter().map(Lane::finish).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
    if outs.is_empty() {
        return Ok(None);
    }
    // Each logit row's place among the lanes' rows, in `batch`'s order.
    let mut place = vec![None; batch.seqs.len()];
    let mut next = 0u32;
    for &i in halves.iter().flatten() {
        if batch.seqs[i].num_logit_rows() > 0 {
            place[i] = Some(next);
            next += 1;
        }
    }
    let order: Vec<u32> = place.into_iter().flatten().collect();
    let rows = Tensor::cat(&outs, 0)?;
    if order.iter().enumerate().all(|(i, &p)| p as usize == i) {
        return Ok(Some(rows));
    }
    let index = Tensor::from_vec(order, next as usize, rows.device())?;
    Ok(Some(rows.index_select(&index, 0)?))
}

/// `f` on every lane, side by side; the first error, if any.
fn phase(lanes: &mut [Lane<'_>], f: impl Fn(&mut Lane<'_>) -> Result<()> + Sync) -> Result<()> {
    multilora_layers::side_by_side(lanes, f).into_iter().collect()
}
