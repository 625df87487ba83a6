//! One engine step: schedule → pin the slots of requests that start running (and unpin the
//! preempted) → activate the step's generations into slots → one forward over the flat
//! batch (on CUDA the rows a greedy pick serves picked on the device, only the other rows'
//! logits read back) → prompt logprobs and sampling (the requests side by side on the pool's
//! threads), stop strings → the scheduler's update → stream the events and count the step. Also
//! the warm-up that seeds the step cost model.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use multilora_models::{Batch, GreedyPick, SeqInput};
use multilora_scheduler::{ScheduledRequest, SchedulerOutput};
use multilora_types::{AdapterGen, SlotId};

use rayon::prelude::*;

use super::EngineLoop;
use super::live::{Computed, Live};
use crate::error::{EngineError, SharedError};
use crate::guided::Guide;

/// Logit entries in a step from which its rows are sampled on the pool's threads (two rows of a
/// 16k vocabulary): below it the work is a few µs, which waking the pool's other threads (tens
/// of µs) would not pay for; above it a sampled 49k-entry row alone takes ~25 µs, a 262k one
/// ~130 µs (`benches/sampler.rs`).
const PARALLEL_SAMPLING_ENTRIES: usize = 1 << 15;

/// One request's share of a step's sampling: its schedule, its live entry (`None` once it is
/// gone), its logit rows and the pick the device made of its sampled row.
type RowWork<'a> = (&'a ScheduledRequest, Option<&'a mut Live>, &'a mut [Vec<f32>], Option<GreedyPick>);

impl EngineLoop {
    /// Seeds the step cost model before the first request: a 32-token prefill and decode steps
    /// of 1 and 8 rows, each run twice and timed the second time (the first pays one-time
    /// costs). They write into the first KV blocks (of each pool), which are free; no real step
    /// reads what a request did not write. Skipped when the cache is too small to hold them.
    pub(super) fn warm_up(&mut self) {
        let bs = self.config.block_size;
        let prompt = 32.min(self.config.max_model_len.saturating_sub(2));
        let blocks = (prompt + 1).div_ceil(bs);
        // The sliding layers' own pool, when they have one, gives its first blocks too.
        let sliding = self.config.sliding_kv_blocks;
        if prompt < 2 || blocks > self.config.num_kv_blocks || sliding.is_some_and(|n| blocks > n) {
            return;
        }
        let table: Vec<u32> = (0..blocks as u32).collect();
        let seq = |ids: Vec<u32>, start: usize| {
            let s = SeqInput::new(ids, start, table.clone(), None);
            if sliding.is_some() { s.with_sliding_table(table.clone()) } else { s }
        };
        let ids: Vec<u32> = (0..prompt as u32).map(|t| (t * 7 + 3) % self.config.vocab_size.max(1) as u32).collect();
        let prefill = Batch::new(vec![seq(ids.clone(), 0)]);
        let decode = |rows: usize| Batch::new((0..rows).map(|_| seq(vec![ids[0]], prompt)).collect());
        for (batch, rows, tokens) in [(prefill, 0, prompt), (decode(1), 1, 0), (decode(8), 8, 0)] {
            let mut seconds = f64::NAN;
            for _ in 0..2 {
                let t = Instant::now();
                if let Err(e) = self.model.forward(&batch, &mut self.kv).and_then(|l| self.model.logits_to_host(&l)) {
                    tracing::warn!(error = %e, "warm-up step failed; the step cost model starts from traffic");
                    return;
                }
                seconds = t.elapsed().as_secs_f64();
            }
            self.cost.observe(rows, tokens, seconds);
        }
        if let Some(c) = self.cost.cost() {
            tracing::info!(
                fixed_ms = c.fixed_s * 1e3,
                per_decode_row_ms = c.per_decode_row_s * 1e3,
                per_prefill_token_ms = c.per_prefill_token_s * 1e3,
                step_time = self.config.step_time.name(),
                "step cost model seeded"
            );
        }
    }

    /// One step; `false` when nothing was scheduled.
    pub(super) fn step(&mut self) -> bool {
        // Fault injection for the tests of a dead or stuck loop (the `failpoints` feature;
        // nothing at all without it).
        fail::fail_point!("engine-step", |_| false);
        let started = Instant::now();
        let out = match self.cost.cost() {
            Some(cost) => self.scheduler.schedule_with_cost(&cost),
            None => self.scheduler.schedule(),
        };
        self.note_deferred();
        if out.is_empty() {
            return false;
        }
        self.update_pins(&out);
        let slots = self.activate(&out);
        let mut seqs = Vec::with_capacity(out.scheduled.len());
        let mut kept = Vec::with_capacity(out.scheduled.len());
        for s in &out.scheduled {
            let slot = match s.adapter {
                None => None,
                Some(g) => match slots.get(&g) {
                    Some(&slot) => Some(slot),
                    None => continue,
                },
            };
            // Failed since `schedule`: not part of this step.
            match self.live.get(&s.id) {
                Some(live) if live.hold.runs_on(s.adapter) => {}
                _ => continue,
            }
            seqs.push(
                SeqInput::new(s.token_ids.clone(), s.num_computed_tokens, s.block_table.clone(), slot)
                    .with_sliding_table(s.sliding_table.clone())
                    .with_logits(s.logits)
                    // A sampled token and those its grammar forced attend as decode rows.
                    .with_decode_rows(s.is_decode()),
            );
            kept.push(s);
        }
        if seqs.is_empty() {
            return true;
        }
        let batch = Batch::new(seqs);
        let device_rows = self.device_rows(&kept, &batch);
        // The masks of the constrained rows that sample this step and will need one (see
        // `Guide`) are computed on the pool's other thread while this one runs the forward pass
        // (whose parallel regions it then takes alone for that long): a mask needs only the
        // tokens fed so far.
        let mut guides: Vec<(&mut Guide, usize)> = Vec::new();
        if self.live.values().any(|l| l.guide.as_ref().is_some_and(Guide::mask_ahead)) {
            let sampling: HashSet<u64> = kept.iter().filter(|s| s.sample).map(|s| s.id).collect();
            guides = self
                .live
                .iter_mut()
                .filter(|(id, _)| sampling.contains(id))
                .filter_map(|(_, l)| {
                    let left = l.tokens_left();
                    l.guide.as_mut().filter(|g| g.mask_ahead()).map(|g| (g, left))
                })
                .collect();
        }
        let (model, kv) = (&self.model, &mut self.kv);
        let logits = rayon::in_place_scope(|scope| {
            if !guides.is_empty() {
                // An error here comes back when the row samples (`Live::compute` prepares again).
                scope.spawn(move |_| guides.into_iter().for_each(|(g, left)| drop(g.prepare(left))));
            }
            model.forward(&batch, kv).and_then(|t| {
                let rows: Vec<usize> = device_rows.iter().flatten().copied().collect();
                match model.greedy_on_device(&t, &rows)? {
                    Some(picks) if !rows.is_empty() => Ok((model.logits_to_host_except(&t, &rows)?, picks)),
                    _ => Ok((model.logits_to_host(&t)?, Vec::new())),
                }
            })
        });
        let (mut logits, picks) = match logits {
            Ok(l) => l,
            Err(e) => {
                self.fail_step(&kept, "forward", Arc::new(e));
                return true;
            }
        };
        // Each request's pick made on the device, in the order of `device_rows`.
        let mut picks = picks.into_iter();
        let on_device: Vec<Option<GreedyPick>> = device_rows.iter().map(|r| r.and_then(|_| picks.next())).collect();
        let computed = self.compute_rows(&kept, &batch, &mut logits, &on_device);
        let mut results = Vec::new();
        let mut token_events = Vec::new();
        let mut failed = Vec::new();
        for (s, c) in kept.iter().zip(computed) {
            let tokenizer = self.tokenizer.as_deref();
            let Some(live) = self.live.get_mut(&s.id) else { continue };
            if let Some(t) = live.guide.as_mut().and_then(Guide::take_mask_time) {
                self.counters.mask_duration.observe(t);
            }
            let Some(c) = c else { continue };
            if let Some(reason) = c.error.clone() {
                let kind = live.sub.params.constraint.as_ref().map_or("grammar", |c| c.kind());
                failed.push((s.id, EngineError::Constraint { kind, reason }));
                continue;
            }
            if let Some(r) = live.deliver(s, c, tokenizer, &mut self.counters, &mut token_events) {
                self.counters.forced_tokens += r.forced.len() as u64;
                results.push(r);
            }
        }
        for (id, e) in failed {
            self.fail(id, e);
        }
        let finished = match self.scheduler.update(&results) {
            Ok(f) => f,
            Err(e) => {
                self.fail_step(&kept, "update", Arc::new(e));
                return true;
            }
        };
        for (id, ev) in token_events {
            if let Some(live) = self.live.get(&id) {
                let _ = live.sub.events.send(ev);
            }
        }
        for f in finished {
            self.finish(f.id, f.reason, f.output_token_ids.len());
        }
        // Each decode row counts once (the tokens a grammar forced beside its sampled one count as
        // prefill tokens); every other row's tokens are prefill tokens.
        let decode_rows = kept.iter().filter(|s| s.is_decode()).count();
        let prefill_tokens: usize = kept.iter().map(|s| s.token_ids.len()).sum::<usize>() - decode_rows;
        let adapters = kept.iter().filter_map(|s| s.adapter).collect::<HashSet<_>>().len();
        let elapsed = started.elapsed();
        self.cost.observe(decode_rows, prefill_tokens, elapsed.as_secs_f64());
        let c = &mut self.counters;
        c.steps += 1;
        c.step_duration.observe(elapsed);
        c.iteration_tokens.observe_value((decode_rows + prefill_tokens) as f64);
        c.step_rows.observe_value(batch.seqs.len() as f64);
        c.step_adapters.observe_value(adapters as f64);
        if prefill_tokens > 0 {
            c.prefill_tokens.observe_value(prefill_tokens as f64);
        }
        true
    }

    /// For each of the step's requests, the logit row the device picks for it (its sampled row,
    /// where the model picks on the device and the request allows a greedy pick of the raw row:
    /// `Live::picks_on_device`), else `None`; rows counted in sequence order.
    fn device_rows(&self, kept: &[&ScheduledRequest], batch: &Batch) -> Vec<Option<usize>> {
        let on_device = self.model.picks_on_device();
        let mut at = 0;
        kept.iter()
            .zip(&batch.seqs)
            .map(|(s, seq)| {
                let rows = seq.num_logit_rows();
                let here = at;
                at += rows;
                let device = on_device && rows == 1 && self.live.get(&s.id).is_some_and(|l| l.picks_on_device(s));
                device.then_some(here)
            })
            .collect()
    }

    /// Prompt logprobs and sampling for each of the step's requests (`None` for one no longer
    /// live), side by side on the pool's threads when the step has enough logit entries to pay
    /// for waking them: each request's rows and state are its own (`on_device`: its pick made on
    /// the device, if any).
    fn compute_rows(
        &mut self,
        kept: &[&ScheduledRequest],
        batch: &Batch,
        logits: &mut [Vec<f32>],
        on_device: &[Option<GreedyPick>],
    ) -> Vec<Option<Computed>> {
        let entries: usize = logits.iter().map(Vec::len).sum();
        let mut rest = logits;
        let mut lives: HashMap<u64, &mut Live> = self.live.iter_mut().map(|(&id, l)| (id, l)).collect();
        let mut work: Vec<RowWork<'_>> = Vec::with_capacity(kept.len());
        for ((s, seq), &pick) in kept.iter().zip(&batch.seqs).zip(on_device) {
            let (rows, tail) = std::mem::take(&mut rest).split_at_mut(seq.num_logit_rows());
            rest = tail;
            work.push((s, lives.remove(&s.id), rows, pick));
        }
        let one = |(s, live, rows, pick): &mut RowWork<'_>| live.as_mut().map(|l| l.compute(s, rows, *pick));
        if work.len() > 1 && entries >= PARALLEL_SAMPLING_ENTRIES {
            work.par_iter_mut().with_max_len(1).map(one).collect()
        } else {
            work.iter_mut().map(one).collect()
        }
    }

    /// Fails every request of a step whose `stage` failed; the engine goes on.
    fn fail_step(&mut self, kept: &[&ScheduledRequest], stage: &'static str, e: SharedError) {
        tracing::error!(error = %e, stage, "step failed; failing its requests");
        for s in kept {
            self.fail(s.id, EngineError::step(stage, &e));
        }
    }

    /// Pins the slot of every request that starts running this step, and lets go of the slots
    /// of preempted requests (they wait again, on their host-memory entry): `Hold::run` and
    /// `Hold::preempt`, neither of which can fail, since the request holds its generation all
    /// along.
    fn update_pins(&mut self, out: &SchedulerOutput) {
        for &id in &out.preempted {
            if let Some(live) = self.live.get_mut(&id) {
                live.hold.preempt();
                self.counters.preemptions += 1;
            }
        }
        for s in &out.scheduled {
            if let Some(live) = self.live.get_mut(&s.id) {
                live.hold.run();
            }
        }
    }

    /// Puts every adapter generation of the step in a slot; requests whose generation cannot be
    /// activated fail alone.
    fn activate(&mut self, out: &SchedulerOutput) -> HashMap<AdapterGen, SlotId> {
        let mut slots = HashMap::new();
        // Only the requests running on the generation take part.
        let on =
            |live: &HashMap<u64, Live>, id: u64, g: AdapterGen| live.get(&id).is_some_and(|l| l.hold.runs_on(Some(g)));
        for &g in &out.active_adapters {
            if !out.scheduled.iter().any(|s| s.adapter == Some(g) && on(&self.live, s.id, g)) {
                continue;
            }
            match self.store.activate(g, &mut self.model) {
                Ok(slot) => {
                    slots.insert(g, slot);
                }
                Err(e) => {
                    let e = Arc::new(e);
                    let ids: Vec<u64> = out
                        .scheduled
                        .iter()
                        .filter(|s| s.adapter == Some(g) && on(&self.live, s.id, g))
                        .map(|s| s.id)
                        .collect();
                    for id in ids {
                        let name = self.live.get(&id).map(|l| l.sub.model.clone()).unwrap_or_default();
                        self.fail(id, EngineError::from_store_arc(&name, &e));
                    }
                }
            }
        }
        slots
    }
}
