//! One step's input as plain data ([`Batch`], [`SeqInput`]), and the per-step plan the forward
//! derives from it once and shares with every layer: flat token ids and positions, the cache rows
//! to write and to read per sequence (their causal masks made per query tile where they are read),
//! the rows that want logits, and the two
//! `LoraMapping`s (per token, per logit row).

use std::ops::Range;

use candle_core::{Device, Tensor};
use multilora_layers::{LoraMapping, MetaPart, MetaToDevice, PendingMapping, StepMeta, Uploaded};
use multilora_types::{LogitsWanted, SlotId};

use crate::error::{Error, Result};

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqInput {
    /// The new tokens: a prefill chunk or one decode token.
    pub tokens: Vec<u32>,
    /// Tokens of this sequence already in the cache; the first new token sits at this position.
    pub start_pos: usize,
    /// The sequence's blocks, in order; it must cover `start_pos + tokens.len()` positions.
    pub block_table: Vec<u32>,
    /// The sliding layers' blocks when the cache keeps them in a pool of their own
    /// ([`KvCacheConfig::sliding_blocks`](crate::KvCacheConfig)): as long as `block_table`, the
    /// blocks before the first token's window may be anything (they are never read); empty
    /// otherwise.
    pub sliding_table: Vec<u32>,
    /// The LoRA slot, `None` for the base model.
    pub slot: Option<SlotId>,
    /// Which new tokens want logits.
    pub logits: LogitsWanted,
    /// The new tokens are a decode's (a sampled token and those a grammar forced after it): at
    /// most [`MAX_DECODE_CHUNK`] of them attend as that many decode rows, each over its own
    /// context, beside the step's other decode rows, rather than as a prefill chunk.
    pub decode_rows: bool,
}

/// Most new tokens of a [`SeqInput::decode_rows`] sequence that attend as decode rows.
pub const MAX_DECODE_CHUNK: usize = 16;

impl SeqInput {
    /// A sequence with logits for its last token.
    pub fn new(tokens: Vec<u32>, start_pos: usize, block_table: Vec<u32>, slot: Option<SlotId>) -> SeqInput {
        SeqInput {
            tokens,
            start_pos,
            block_table,
            sliding_table: Vec::new(),
            slot,
            logits: LogitsWanted::Last,
            decode_rows: false,
        }
    }

    /// Marks the new tokens as a decode's ([`SeqInput::decode_rows`]).
    pub fn with_decode_rows(mut self, on: bool) -> SeqInput {
        self.decode_rows = on;
        self
    }

    /// Sets the sliding layers' block table.
    pub fn with_sliding_table(mut self, table: Vec<u32>) -> SeqInput {
        self.sliding_table = table;
        self
    }

    /// Sets which rows produce logits.
    pub fn with_logits(mut self, logits: LogitsWanted) -> SeqInput {
        self.logits = logits;
        self
    }

    /// How many logit rows this sequence produces.
    pub fn num_logit_rows(&self) -> usize {
        self.logits.rows(self.tokens.len())
    }
}

/// The sequences of one step, in the order their logit rows come back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The sequences.
    pub seqs: Vec<SeqInput>,
}

impl Batch {
    /// A batch of `seqs`.
    pub fn new(seqs: Vec<SeqInput>) -> Batch {
        Batch { seqs }
    }

    /// Total new tokens.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Total logit rows the forward returns.
    pub fn num_logit_rows(&self) -> usize {
        self.seqs.iter().map(SeqInput::num_logit_rows).sum()
    }
}

/// Limits a batch is checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) vocab: usize,
    pub(crate) max_len: usize,
    pub(crate) max_loras: usize,
    pub(crate) num_blocks: usize,
    /// Blocks of the sliding layers' own pool, when they have one (then each sequence brings a
    /// sliding table).
    pub(crate) sliding_blocks: Option<usize>,
    pub(crate) block_size: usize,
    /// Decode rows read the cache through their block tables on the device (the CUDA kernel);
    /// otherwise their context rows are listed (and, off the CPU, gathered).
    pub(crate) paged_decode: bool,
    /// The sliding window: position `q` attends to positions `q + 1 - w ..= q` only (every
    /// layer of Mistral; the sliding layers of a model with [`Limits::mixed_windows`]).
    pub(crate) window: Option<usize>,
    /// Some layers slide and others attend to the whole context (Gemma 3): the plan holds both
    /// views ([`StepPlan::attn`]).
    pub(crate) mixed_windows: bool,
    /// LongRoPE (Phi-3): `(original, offset)`: the tokens of a sequence whose context passes
    /// `original` read the RoPE tables' long rows, `offset` past their position.
    pub(crate) long_rope: Option<(usize, usize)>,
}

/// One sequence's attention inputs; `R`, its context rows, as built (`Vec<u32>`) and as uploaded.
#[derive(Debug)]
pub(crate) struct SeqPlan<R = Tensor> {
    /// First row of the sequence in the flat batch.
    pub(crate) offset: usize,
    /// New tokens.
    pub(crate) len: usize,
    /// Flat cache rows of the positions its new tokens may see: `0..start_pos + len`, or from
    /// the first token's window start under a sliding window.
    pub(crate) ctx_rows: R,
    /// The position of its first new token.
    pub(crate) start: usize,
    /// The position of `ctx_rows`' first row.
    pub(crate) lo: usize,
    /// The sliding window its keys are seen through, if any.
    pub(crate) window: Option<usize>,
    /// `ctx_rows` on the host (the CPU attention reads the cache through them in place); empty
    /// until the plan is on the device ([`SeqPlan::with_rows`]).
    pub(crate) host_rows: Vec<u32>,
}

impl<R> SeqPlan<R> {
    /// The first position a query at position `q` sees.
    pub(crate) fn first(&self, q: usize) -> usize {
        self.window.map_or(0, |w| (q + 1).saturating_sub(w))
    }
}

impl SeqPlan<Vec<u32>> {
    /// The same plan over `rows` (its rows on the device), its host rows kept.
    fn with_rows<S>(self, rows: S) -> SeqPlan<S> {
        let SeqPlan { offset, len, ctx_rows, start, lo, window, host_rows: _ } = self;
        SeqPlan { offset, len, ctx_rows: rows, start, lo, window, host_rows: ctx_rows }
    }
}

/// The one-token sequences of a step (decode rows), attended together.
#[derive(Debug)]
pub(crate) struct DecodeGroup {
    /// Number of sequences.
    pub(crate) n: usize,
    /// Longest context.
    pub(crate) max_ctx: usize,
    /// Flat batch rows of the decode tokens; `None` when they are rows `0..n` in order.
    pub(crate) rows: Option<Tensor>,
    /// Each sequence's flat cache rows, unpadded, on the host (the CPU f32 attention reads the
    /// cache through them directly).
    pub(crate) host_ctx: Vec<Vec<u32>>,
    /// How the device reads the contexts.
    pub(crate) reads: DecodeReads,
}

/// What the decode attention reads the cache with, on the model's device.
#[derive(Debug)]
pub(crate) enum DecodeReads {
    /// Contexts padded to the longest one and the padding masked, gathered with tensor ops: a
    /// handful of ops per layer for the whole group.
    Gathered {
        /// `[n · max_ctx]` flat cache rows (padding points at a valid row and is masked).
        ctx_rows: Tensor,
        /// `[n, 1, 1, max_ctx]` additive f32 mask of the padding; `None` when all contexts are equal.
        mask: Option<Tensor>,
    },
    /// The paged kernel's inputs (one copy to the device for the step).
    Paged {
        /// `u32 [n, max_blocks]`: each sequence's blocks, zero-padded.
        block_tables: Tensor,
        /// `u32 [n]`: each sequence's context length.
        ctx_lens: Tensor,
    },
}

/// The cache rows a step's new keys and values go to.
#[derive(Debug)]
pub(crate) enum KvWrites {
    /// Each token's row, on the host: the CPU writes the rows in place (with the keys' rotation
    /// when it can, `multilora_layers::rope_write_kv`).
    Host(Vec<u32>),
    /// `u32 [tokens]`: each token's row, read directly by the CUDA KV-write kernel.
    Rows(Tensor),
}

/// Everything the layers need about a step, computed once.
#[derive(Debug)]
pub(crate) struct StepPlan {
    pub(crate) ids: Tensor,
    /// The RoPE tables' row of each token: its position (past the short rows, with LongRoPE, for
    /// a sequence whose context passes the original length).
    pub(crate) positions: Tensor,
    /// The flat cache row of each new token, as the K/V write of the step's device reads it.
    pub(crate) kv_writes: KvWrites,
    /// Sequences with more than one new token, attended one by one.
    pub(crate) seqs: Vec<SeqPlan>,
    /// Sequences with one new token, attended together.
    pub(crate) decode: Option<DecodeGroup>,
    /// The sliding layers' contexts when some layers slide and others do not (then `seqs` and
    /// `decode` are the full layers'), in the same order.
    pub(crate) windowed: Option<Windowed>,
    /// Attention outputs come out as [decode rows, then each of `seqs`]; this gathers them back
    /// into flat batch order. `None` when that order is already the flat one.
    pub(crate) unpermute: Option<Tensor>,
    /// Rows of the flat batch that want logits; `None` when that is every row.
    pub(crate) logit_rows: Option<Tensor>,
    pub(crate) token_mapping: LoraMapping,
    pub(crate) logit_mapping: LoraMapping,
}

/// The sliding layers' attention inputs, beside the full layers' of a [`StepPlan`].
#[derive(Debug)]
pub(crate) struct Windowed {
    pub(crate) seqs: Vec<SeqPlan>,
    pub(crate) decode: Option<DecodeGroup>,
    /// The rows the new keys and values go to when the sliding layers have a pool of their own.
    pub(crate) kv_writes: Option<KvWrites>,
}

/// A sequence's context rows under `window`: the positions its first new token sees (from 0, or
/// from the start of its window) to its last new token.
fn context(start: usize, len: usize, window: Option<usize>, row: impl Fn(usize) -> u32) -> (usize, Vec<u32>) {
    let lo = window.map_or(0, |w| (start + 1).saturating_sub(w));
    (lo, (lo..start + len).map(row).collect())
}

impl StepPlan {
    /// What layers attend with: the sliding layers' own contexts (`sliding`) when the model mixes
    /// sliding and full layers, otherwise the step's one set.
    pub(crate) fn attn(&self, sliding: bool) -> (&[SeqPlan], Option<&DecodeGroup>) {
        match (&self.windowed, sliding) {
            (Some(w), true) => (&w.seqs, w.decode.as_ref()),
            _ => (&self.seqs, self.decode.as_ref()),
        }
    }

    /// Where a layer's new keys and values go: the sliding layers' own rows (`sliding`) when
    /// they have a pool of their own, otherwise the step's one set.
    pub(crate) fn kv_writes(&self, sliding: bool) -> &KvWrites {
        match (&self.windowed, sliding) {
            (Some(Windowed { kv_writes: Some(w), .. }), true) => w,
            _ => &self.kv_writes,
        }
    }

    /// The plan of `batch`, checked against `lim`. Its small integer tables (token ids,
    /// positions, cache rows, the decode rows' block tables or context rows, the row orders, both
    /// mappings' indexes) go to `device` in one copy through `upload`; only a decode group's f32
    /// mask, when its contexts differ and the paged kernel does not serve, is a tensor of its own
    /// (a prefill sequence's causal mask is made per query tile where it is read).
    pub(crate) fn new(batch: &Batch, lim: Limits, device: &Device, upload: &MetaToDevice) -> Result<StepPlan> {
        let total = batch.num_tokens();
        if batch.seqs.is_empty() {
            return Err(Error::batch(0, "the batch holds no sequences"));
        }
        let mut ids = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut write_rows = Vec::with_capacity(total);
        let own_pool = lim.mixed_windows && lim.sliding_blocks.is_some();
        let mut w_write_rows = Vec::with_capacity(if own_pool { total } else { 0 });
        let mut token_slots = Vec::with_capacity(total);
        let mut logit_rows = Vec::new();
        let mut logit_slots = Vec::new();
        // Each sequence with more than one new token, its context rows still on the host.
        let mut prefill: Vec<SeqPlan<Vec<u32>>> = Vec::new();
        let mut decode: Vec<(usize, Vec<u32>, &[u32])> = Vec::new();
        // The same for the sliding layers when others attend to everything.
        let mut w_prefill: Vec<SeqPlan<Vec<u32>>> = Vec::new();
        let mut w_decode: Vec<(usize, Vec<u32>, &[u32])> = Vec::new();
        let main_window = if lim.mixed_windows { None } else { lim.window };
        let bs = lim.block_size;
        for (i, s) in batch.seqs.iter().enumerate() {
            let len = s.tokens.len();
            if len == 0 {
                return Err(Error::batch(i, "no new tokens"));
            }
            let ctx = s.start_pos + len;
            if ctx > lim.max_len {
                return Err(Error::batch(i, format!("context of {ctx} tokens exceeds the model's {}", lim.max_len)));
            }
            if s.block_table.len() * bs < ctx {
                return Err(Error::batch(
                    i,
                    format!("{} blocks of {bs} tokens cannot hold {ctx} positions", s.block_table.len()),
                ));
            }
            if let Some(b) = s.block_table.iter().find(|&&b| b as usize >= lim.num_blocks) {
                return Err(Error::batch(i, format!("block {b} is out of range (the cache has {})", lim.num_blocks)));
            }
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= lim.vocab) {
                return Err(Error::batch(i, format!("token {t} is out of the vocabulary of {}", lim.vocab)));
            }
            let row = |p: usize| s.block_table[p / bs] * bs as u32 + (p % bs) as u32;
            // The sliding layers' rows: from their own table, which is checked where it is read.
            let w_table = if own_pool { sliding_table(i, s, lim)? } else { &s.block_table };
            let w_row = |p: usize| w_table[p / bs] * bs as u32 + (p % bs) as u32;
            let offset = ids.len();
            ids.extend_from_slice(&s.tokens);
            let rope_row = match lim.long_rope {
                Some((original, offset)) if ctx > original => offset,
                _ => 0,
            };
            positions.extend((s.start_pos..ctx).map(|p| (p + rope_row) as u32));
            write_rows.extend((s.start_pos..ctx).map(row));
            if own_pool {
                w_write_rows.extend((s.start_pos..ctx).map(w_row));
            }
            token_slots.extend(std::iter::repeat_n(s.slot, len));
            let wanted = match s.logits {
                LogitsWanted::Last => offset + len - 1..offset + len,
                LogitsWanted::AllPrompt => offset..offset + len,
                LogitsWanted::None => offset..offset,
            };
            logit_slots.extend(std::iter::repeat_n(s.slot, wanted.len()));
            logit_rows.extend(wanted.map(|r| r as u32));
            let table = &s.block_table[..ctx.div_ceil(bs)];
            let plan = |window: Option<usize>, (lo, ctx_rows): (usize, Vec<u32>)| SeqPlan {
                offset,
                len,
                ctx_rows,
                start: s.start_pos,
                lo,
                window,
                host_rows: Vec::new(),
            };
            if len == 1 || s.decode_rows && len <= MAX_DECODE_CHUNK {
                // Each new token a decode row over its own context (the cache holds every new
                // token's keys and values before any attends).
                for j in 0..len {
                    let p = s.start_pos + j;
                    let blocks = (p + 1).div_ceil(bs);
                    decode.push((offset + j, context(p, 1, main_window, row).1, &table[..blocks]));
                    if lim.mixed_windows {
                        let w_ctx = context(p, 1, lim.window, w_row).1;
                        w_decode.push((offset + j, w_ctx, &w_table[..blocks]));
                    }
                }
                continue;
            }
            prefill.push(plan(main_window, context(s.start_pos, len, main_window, row)));
            if lim.mixed_windows {
                w_prefill.push(plan(lim.window, context(s.start_pos, len, lim.window, w_row)));
            }
        }
        let mut order: Vec<u32> = decode.iter().map(|d| d.0 as u32).collect();
        for p in &prefill {
            order.extend((p.offset..p.offset + p.len).map(|r| r as u32));
        }
        let mut meta = StepMeta::new();
        let ids_part = meta.push(ids);
        let positions_part = meta.push(positions);
        // The CUDA KV-write kernel reads each token's row; the CPU writes from the host's copy.
        let rows_part = device.is_cuda().then(|| meta.push(write_rows.iter().copied()));
        let w_rows_part = (own_pool && device.is_cuda()).then(|| meta.push(w_write_rows.iter().copied()));
        let unpermute = (!order.iter().enumerate().all(|(i, &r)| i as u32 == r)).then(|| {
            let mut inv = vec![0u32; order.len()];
            for (i, &r) in order.iter().enumerate() {
                inv[r as usize] = i as u32;
            }
            meta.push(inv)
        });
        let seq_parts: Vec<MetaPart> = prefill.iter().map(|p| meta.push(p.ctx_rows.iter().copied())).collect();
        let decode = decode_group(decode, lim.paged_decode, device, &mut meta)?;
        let w_parts: Vec<MetaPart> = w_prefill.iter().map(|p| meta.push(p.ctx_rows.iter().copied())).collect();
        let w_decode = decode_group(w_decode, false, device, &mut meta)?;
        let logit_part = (logit_rows.len() != total).then(|| meta.push(logit_rows));
        let token_mapping = token_mapping(batch, &token_slots, lim.max_loras, device, &mut meta)?;
        let logit_mapping = LoraMapping::plan(&logit_slots, lim.max_loras, device, &mut meta)?;
        // The one copy of the step's tables to the device.
        let up = upload.upload(meta, device)?;
        let kv_writes = match rows_part {
            Some(p) => KvWrites::Rows(up.part(p)?),
            None => KvWrites::Host(write_rows),
        };
        let w_kv_writes = match w_rows_part {
            Some(p) => Some(KvWrites::Rows(up.part(p)?)),
            None => own_pool.then_some(KvWrites::Host(w_write_rows)),
        };
        let plans = |prefill: Vec<SeqPlan<Vec<u32>>>, parts: Vec<MetaPart>| {
            prefill.into_iter().zip(parts).map(|(s, p)| Ok(s.with_rows(up.part(p)?))).collect::<Result<Vec<_>>>()
        };
        let seqs = plans(prefill, seq_parts)?;
        let windowed = match lim.mixed_windows {
            true => Some(Windowed {
                seqs: plans(w_prefill, w_parts)?,
                decode: w_decode.map(|d| d.finish(&up)).transpose()?,
                kv_writes: w_kv_writes,
            }),
            false => None,
        };
        Ok(StepPlan {
            ids: up.part(ids_part)?,
            positions: up.part(positions_part)?,
            kv_writes,
            seqs,
            decode: decode.map(|d| d.finish(&up)).transpose()?,
            windowed,
            unpermute: unpermute.map(|p| up.part(p)).transpose()?,
            logit_rows: logit_part.map(|p| up.part(p)).transpose()?,
            token_mapping: token_mapping.finish(&up)?,
            logit_mapping: logit_mapping.finish(&up)?,
        })
    }
}

impl StepPlan {
    /// The plan of rows `rows` of this one, cut from it rather than planned again: for a row
    /// group of a decode step (one new token a sequence) whose sequences are `rows` of `batch`.
    /// Each table is narrowed to the run, the rows that give logits and the mappings are made
    /// for its sequences; an error for any other step (the groups run only on those).
    pub(crate) fn cut(&self, batch: &Batch, rows: Range<usize>, max_loras: usize) -> Result<StepPlan> {
        let decode_only = self.seqs.is_empty()
            && self.unpermute.is_none()
            && self.windowed.as_ref().is_none_or(|w| w.seqs.is_empty());
        let Some(seqs) = batch.seqs.get(rows.clone()).filter(|_| decode_only) else {
            return Err(Error::batch(rows.start, "only a decode step's rows are cut into row groups"));
        };
        let slots: Vec<Option<SlotId>> = seqs.iter().map(|s| s.slot).collect();
        let device = self.ids.device();
        let logits: Vec<u32> = (0..seqs.len() as u32).filter(|&i| seqs[i as usize].num_logit_rows() > 0).collect();
        let logit_slots: Vec<Option<SlotId>> = logits.iter().map(|&i| slots[i as usize]).collect();
        let token_mapping = LoraMapping::new(&slots, max_loras, device)?;
        // Every row giving its logits (a decode step's usual case): the same mapping, shared.
        let (logit_rows, logit_mapping) = match logits.len() == seqs.len() {
            true => (None, token_mapping.clone()),
            false => {
                let n = logits.len();
                (Some(Tensor::from_vec(logits, n, device)?), LoraMapping::new(&logit_slots, max_loras, device)?)
            }
        };
        let cut_decode = |g: &Option<DecodeGroup>| g.as_ref().map(|g| g.cut(&rows)).transpose();
        Ok(StepPlan {
            ids: self.ids.narrow(0, rows.start, rows.len())?,
            positions: self.positions.narrow(0, rows.start, rows.len())?,
            kv_writes: self.kv_writes.cut(&rows)?,
            seqs: Vec::new(),
            decode: cut_decode(&self.decode)?,
            windowed: match &self.windowed {
                Some(w) => Some(Windowed {
                    seqs: Vec::new(),
                    decode: cut_decode(&w.decode)?,
                    kv_writes: w.kv_writes.as_ref().map(|k| k.cut(&rows)).transpose()?,
                }),
                None => None,
            },
            unpermute: None,
            logit_rows,
            token_mapping,
            logit_mapping,
        })
    }
}

impl KvWrites {
    /// The rows of tokens `rows` (a decode step's: one token a sequence).
    fn cut(&self, rows: &Range<usize>) -> Result<KvWrites> {
        Ok(match self {
            KvWrites::Host(r) => KvWrites::Host(r[rows.clone()].to_vec()),
            KvWrites::Rows(t) => KvWrites::Rows(t.narrow(0, rows.start, rows.len())?),
        })
    }
}

impl DecodeGroup {
    /// Sequences `r` of the group (in flat order, as a decode step's are), their contexts still
    /// padded to the group's longest.
    fn cut(&self, r: &Range<usize>) -> Result<DecodeGroup> {
        let (start, len, max_ctx) = (r.start, r.len(), self.max_ctx);
        if self.rows.is_some() || r.end > self.n {
            return Err(Error::batch(start, "a decode group is cut only along its own, in-order rows"));
        }
        let reads = match &self.reads {
            DecodeReads::Gathered { ctx_rows, mask } => DecodeReads::Gathered {
                ctx_rows: ctx_rows.narrow(0, start * max_ctx, len * max_ctx)?,
                mask: mask.as_ref().map(|m| m.narrow(0, start, len)).transpose()?,
            },
            DecodeReads::Paged { block_tables, ctx_lens } => DecodeReads::Paged {
                block_tables: block_tables.narrow(0, start, len)?,
                ctx_lens: ctx_lens.narrow(0, start, len)?,
            },
        };
        Ok(DecodeGroup { n: len, max_ctx, rows: None, host_ctx: self.host_ctx[r.clone()].to_vec(), reads })
    }
}

/// Sequence `i`'s sliding table, checked: it covers the context, and every block from the first
/// token's window on is one of the sliding pool's (those before are never read).
fn sliding_table(i: usize, s: &SeqInput, lim: Limits) -> Result<&[u32]> {
    let (bs, ctx) = (lim.block_size, s.start_pos + s.tokens.len());
    let blocks = lim.sliding_blocks.unwrap_or(0);
    let t = &s.sliding_table;
    if t.len() * bs < ctx {
        return Err(Error::batch(i, format!("{} sliding blocks of {bs} tokens cannot hold {ctx} positions", t.len())));
    }
    let first = lim.window.map_or(0, |w| (s.start_pos + 1).saturating_sub(w)) / bs;
    if let Some(b) = t[first..ctx.div_ceil(bs)].iter().find(|&&b| b as usize >= blocks) {
        return Err(Error::batch(i, format!("sliding block {b} is out of range (the sliding pool has {blocks})")));
    }
    Ok(t)
}

/// The step's per-token mapping. `LoraMapping::plan` is the one place a step's slots are checked;
/// a slot out of range is reported as the batch error of the sequence whose token it is (every
/// logit row's slot is some token's, so the logit mapping never meets one).
fn token_mapping(
    batch: &Batch,
    slots: &[Option<SlotId>],
    max_loras: usize,
    device: &Device,
    meta: &mut StepMeta,
) -> Result<PendingMapping> {
    LoraMapping::plan(slots, max_loras, device, meta).map_err(|e| match e {
        multilora_layers::Error::SlotOutOfRange { row, slot, max_loras } => {
            let mut end = 0;
            let seq = batch.seqs.iter().position(|s| {
                end += s.tokens.len();
                row < end
            });
            Error::batch(seq.unwrap_or(0), format!("slot {slot} is out of range (max_loras {max_loras})"))
        }
        other => other.into(),
    })
}

/// A [`DecodeGroup`] whose tables are still in the step's [`StepMeta`].
struct PendingDecode {
    n: usize,
    max_ctx: usize,
    rows: Option<MetaPart>,
    host_ctx: Vec<Vec<u32>>,
    reads: PendingReads,
}

/// [`DecodeReads`] with its `u32` tables as parts of the step's [`StepMeta`].
enum PendingReads {
    Gathered { ctx_rows: MetaPart, mask: Option<Tensor> },
    Paged { block_tables: MetaPart, max_blocks: usize, ctx_lens: MetaPart },
}

impl PendingDecode {
    /// The group, its tables views of the step's upload.
    fn finish(self, up: &Uploaded) -> Result<DecodeGroup> {
        let reads = match self.reads {
            PendingReads::Gathered { ctx_rows, mask } => DecodeReads::Gathered { ctx_rows: up.part(ctx_rows)?, mask },
            PendingReads::Paged { block_tables, max_blocks, ctx_lens } => DecodeReads::Paged {
                block_tables: up.part(block_tables)?.reshape((self.n, max_blocks))?,
                ctx_lens: up.part(ctx_lens)?,
            },
        };
        Ok(DecodeGroup {
            n: self.n,
            max_ctx: self.max_ctx,
            rows: self.rows.map(|p| up.part(p)).transpose()?,
            host_ctx: self.host_ctx,
            reads,
        })
    }
}

fn decode_group(
    rows: Vec<(usize, Vec<u32>, &[u32])>,
    paged: bool,
    device: &Device,
    meta: &mut StepMeta,
) -> Result<Option<PendingDecode>> {
    let n = rows.len();
    if n == 0 {
        return Ok(None);
    }
    let max_ctx = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    let in_order = rows.iter().enumerate().all(|(i, r)| r.0 == i);
    let reads = if paged {
        let max_blocks = rows.iter().map(|r| r.2.len()).max().unwrap_or(0).max(1);
        let block_tables =
            meta.push(rows.iter().flat_map(|(_, _, table)| {
                table.iter().copied().chain(std::iter::repeat_n(0, max_blocks - table.len()))
            }));
        let ctx_lens = meta.push(rows.iter().map(|r| r.1.len() as u32));
        PendingReads::Paged { block_tables, max_blocks, ctx_lens }
    } else {
        let uniform = rows.iter().all(|r| r.1.len() == max_ctx);
        let ctx_rows = meta.push(
            rows.iter()
                .flat_map(|(_, ctx, _)| ctx.iter().copied().chain(std::iter::repeat_n(ctx[0], max_ctx - ctx.len()))),
        );
        let mask = if uniform {
            None
        } else {
            let mask: Vec<f32> = rows
                .iter()
                .flat_map(|(_, ctx, _)| (0..max_ctx).map(|p| if p < ctx.len() { 0.0f32 } else { f32::NEG_INFINITY }))
                .collect();
            Some(Tensor::from_vec(mask, (n, 1, 1, max_ctx), device)?)
        };
        PendingReads::Gathered { ctx_rows, mask }
    };
    let flat = (!in_order).then(|| meta.push(rows.iter().map(|r| r.0 as u32)));
    let host_ctx = rows.into_iter().map(|r| r.1).collect();
    Ok(Some(PendingDecode { n, max_ctx, rows: flat, host_ctx, reads }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(paged_decode: bool) -> Limits {
        Limits {
            vocab: 100,
            max_len: 64,
            max_loras: 4,
            num_blocks: 16,
            sliding_blocks: None,
            block_size: 4,
            paged_decode,
            window: None,
            mixed_windows: false,
            long_rope: None,
        }
    }

    /// The address of the storage behind a tensor: views of one upload share it.
    fn storage_of(t: &Tensor) -> usize {
        let (s, _) = t.storage_and_layout();
        std::ptr::from_ref(&*s) as usize
    }

    /// A mixed step (a prefill chunk with an adapter, decodes out of order with and without one,
    /// a sequence wanting no logits) gets every `u32` table from one upload, each with its own
    /// values: ids, positions, the row order, the logit rows, the decode group's block tables and
    /// lengths (paged) or context rows (gathered), the prefill's context rows, both mappings.
    #[test]
    fn a_step_uploads_its_tables_once() -> Result<()> {
        let dev = Device::Cpu;
        let s = |i| Some(SlotId::new(i));
        let batch = Batch::new(vec![
            SeqInput::new(vec![5], 6, vec![3, 7], s(2)),
            SeqInput::new(vec![1, 2, 3], 0, vec![9], s(1)),
            SeqInput::new(vec![8], 2, vec![4], None),
            SeqInput::new(vec![6, 7], 1, vec![2], s(2)).with_logits(LogitsWanted::None),
        ]);
        for paged in [true, false] {
            let plan = StepPlan::new(&batch, limits(paged), &dev, &MetaToDevice::new())?;
            let one = storage_of(&plan.ids);
            let v = |t: &Tensor| -> Result<Vec<u32>> {
                assert_eq!(storage_of(t), one, "a table outside the step's one upload");
                Ok(t.flatten_all()?.to_vec1::<u32>()?)
            };
            assert_eq!(v(&plan.ids)?, [5, 1, 2, 3, 8, 6, 7]);
            assert_eq!(v(&plan.positions)?, [6, 0, 1, 2, 2, 1, 2]);
            // Decode rows (flat 0 and 4) first, then the two prefill sequences.
            assert_eq!(v(plan.unpermute.as_ref().expect("an order"))?, [0, 2, 3, 4, 1, 5, 6]);
            assert_eq!(v(plan.logit_rows.as_ref().expect("logit rows"))?, [0, 3, 4]);
            assert_eq!(v(&plan.seqs[0].ctx_rows)?, [36, 37, 38]);
            assert_eq!(v(&plan.seqs[1].ctx_rows)?, [8, 9, 10]);
            let d = plan.decode.as_ref().expect("a decode group");
            assert_eq!(v(d.rows.as_ref().expect("decode rows"))?, [0, 4]);
            match &d.reads {
                DecodeReads::Paged { block_tables, ctx_lens } => {
                    assert!(paged);
                    assert_eq!(block_tables.dims(), [2, 2]);
                    assert_eq!((v(block_tables)?, v(ctx_lens)?), (vec![3, 7, 4, 0], vec![7, 3]));
                }
                DecodeReads::Gathered { ctx_rows, mask } => {
                    assert!(!paged && mask.is_some());
                    assert_eq!(v(ctx_rows)?, [12, 13, 14, 15, 28, 29, 30, 16, 17, 18, 16, 16, 16, 16]);
                }
            }
            let m = &plan.token_mapping;
            assert_eq!(v(m.lora_index().expect("LoRA rows"))?, m.lora_rows());
            assert_eq!(m.lora_rows(), [1, 2, 3, 0, 5, 6]);
            assert!(m.tile_index().is_some_and(|t| storage_of(t) == one));
            assert_eq!(v(plan.logit_mapping.lora_index().expect("LoRA logit rows"))?, [1, 0]);
            assert!(matches!(plan.kv_writes, KvWrites::Host(_)), "the CPU's rows on the host");
        }
        Ok(())
    }
}
