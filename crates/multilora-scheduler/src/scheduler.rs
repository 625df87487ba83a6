//! The scheduler: waiting and running queues, one `schedule` per step, `update` with the results.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use multilora_prefix_cache::{KvManager, RequestId};
use multilora_types::{AdapterGen, FinishReason, LogitsWanted, StepTime};

use crate::adapters::AdapterTable;
use crate::request::{ReqState, Status};
use crate::{
    Error, FinishedRequest, Policy, Request, RequestResult, Result, ScheduledRequest, SchedulerConfig, SchedulerCounts,
    SchedulerOutput, StepCost,
};

/// Marks a waiting-queue entry admitted during the scan, removed when the scan ends.
const TOMBSTONE: u32 = u32::MAX;

/// Which running requests a pass over them schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// All of them, in admission order (no step-time budget).
    All,
    /// Those with one token to compute (decodes, and a prompt's last token), and those past
    /// their prompt with a few appended tokens (a grammar's forced tokens): each samples.
    Decodes,
    /// The others (prefill chunks).
    Prefills,
}

/// A multiplicative hasher for `u64` request ids: ids are assigned by the engine, not by users,
/// and the map is on the per-step path.
#[derive(Clone, Copy, Debug, Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        self.0 ^= self.0 >> 32;
    }
}

type IdMap<V> = HashMap<RequestId, V, BuildHasherDefault<IdHasher>>;

/// One waiting request, kept small so the admission scan reads a dense array.
#[derive(Clone, Copy, Debug)]
struct WaitEntry {
    id: RequestId,
    slot: u32,
    /// Interned adapter generation, or `NO_ADAPTER`.
    adapter: u32,
    /// Steps in which it was skipped for the adapter limit since it entered the queue.
    skipped: u32,
}

/// A continuous-batching scheduler with vLLM's `max_loras` admission rule, chunked prefill,
/// prefix-cache hits, preemption by recompute, and (under [`Policy::Aging`]) no starvation.
///
/// Pure and synchronous. The engine alternates [`Scheduler::schedule`] (what to compute this step)
/// and [`Scheduler::update`] (what it sampled); [`Scheduler::add_request`] and
/// [`Scheduler::abort`] may be called at any time.
///
/// ```
/// use multilora_scheduler::{Request, RequestResult, Scheduler, SchedulerConfig};
/// use multilora_types::{AdapterGen, AdapterId, Fingerprint};
///
/// let mut s = Scheduler::new(SchedulerConfig::default().max_loras(1))?;
/// let sql = AdapterGen::new(AdapterId(1), Fingerprint([7; 32]));
/// s.add_request(Request::new(10, vec![1, 2, 3], 2).adapter(sql))?;
/// s.add_request(Request::new(11, vec![4, 5], 2).adapter(AdapterGen::new(AdapterId(2), Fingerprint([8; 32]))))?;
///
/// let step = s.schedule();
/// assert_eq!(step.scheduled.len(), 1); // one adapter at a time
/// assert_eq!(step.skipped_for_adapter_limit, vec![11]);
/// let finished = s.update(&[RequestResult::token(10, 42)])?;
/// assert!(finished.is_empty());
/// # Ok::<(), multilora_scheduler::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvManager,
    /// Request states by slot; `None` slots are on `free_slots`.
    slots: Vec<Option<ReqState>>,
    free_slots: Vec<u32>,
    index: IdMap<u32>,
    /// The waiting queue, front first. A `Vec`, not a `VecDeque`: the admission scan runs over a
    /// plain slice, and insertions at the front (preemptions) are rare.
    waiting: Vec<WaitEntry>,
    /// Slots of running requests in admission order: the last one is the newest.
    running: Vec<u32>,
    adapters: AdapterTable,
    next_arrival: u64,
    step: u64,
    /// Waiting entries with `skipped > max_skipped_steps` (only tracked under aging).
    num_starved: usize,
    /// `(slot, id)` of requests scheduled since the last `update`.
    in_flight: Vec<(u32, RequestId)>,
    /// Interned adapters of the step being built (scratch, reused).
    step_adapters: Vec<u32>,
    /// Interned adapters aging held back in the current scan (scratch, reused).
    aging_held: Vec<u32>,
}

impl Scheduler {
    /// A scheduler with an empty KV pool, or [`Error::InvalidConfig`].
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let kv = KvManager::try_new(config.kv.clone())?;
        Ok(Self {
            config,
            kv,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: IdMap::default(),
            waiting: Vec::new(),
            running: Vec::new(),
            adapters: AdapterTable::default(),
            next_arrival: 0,
            step: 0,
            num_starved: 0,
            in_flight: Vec::new(),
            step_adapters: Vec::new(),
            aging_held: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV manager, read-only.
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Steps scheduled so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Requests in the running set.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests in the waiting queue.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any request is live.
    pub fn has_unfinished(&self) -> bool {
        !self.index.is_empty()
    }

    /// Whether `id` is a live request.
    pub fn contains(&self, id: RequestId) -> bool {
        self.index.contains_key(&id)
    }

    /// Counts for metrics: running, waiting, deferred, running and waiting adapters, KV.
    pub fn counts(&self) -> SchedulerCounts {
        let full = self.config.max_loras > 0 && self.adapters.num_running() >= self.config.max_loras;
        SchedulerCounts {
            running: self.running.len(),
            waiting: self.waiting.len(),
            deferred: if full { self.adapters.waiting_not_running() } else { 0 },
            running_adapters: self.adapters.running_gens(),
            waiting_adapters: self.adapters.waiting_gens(),
            kv: self.kv.metrics(),
        }
    }

    /// Queues a request at the back of the waiting queue, or rejects it with a typed error
    /// (empty prompt, zero `max_new_tokens`, no room for a new token within `max_model_len`, an
    /// adapter while LoRA is off, a duplicate id); a rejection changes nothing.
    pub fn add_request(&mut self, request: Request) -> Result<()> {
        let id = request.id;
        if self.index.contains_key(&id) {
            return Err(Error::DuplicateRequest(id));
        }
        if request.prompt.is_empty() {
            return Err(Error::EmptyPrompt { id });
        }
        if request.max_new_tokens == 0 {
            return Err(Error::ZeroMaxTokens { id });
        }
        if request.prompt.len() >= self.config.max_model_len {
            return Err(Error::PromptTooLong {
                id,
                prompt_len: request.prompt.len(),
                max_model_len: self.config.max_model_len,
            });
        }
        if request.adapter.is_some() && self.config.max_loras == 0 {
            return Err(Error::LoraDisabled { id });
        }
        let adapter_idx = self.adapters.acquire(request.adapter);
        self.adapters.add_waiting(adapter_idx);
        let state = ReqState {
            id,
            adapter: request.adapter,
            adapter_idx,
            num_prompt_tokens: request.prompt.len(),
            tokens: request.prompt,
            max_new_tokens: request.max_new_tokens,
            stop_token_ids: request.stop_token_ids,
            prompt_logprobs: request.prompt_logprobs,
            extra: multilora_prefix_cache::ExtraKeys {
                adapter: request.adapter.map(|g| g.fingerprint.0),
                cache_salt: request.cache_salt,
            },
            arrival: self.next_arrival,
            num_computed: 0,
            status: Status::Waiting,
            sample_pending: false,
            in_flight: false,
            computed_before_step: 0,
            got_token: false,
            reported_finish: None,
            num_preemptions: 0,
        };
        self.next_arrival += 1;
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(state);
                slot
            }
            None => {
                self.slots.push(Some(state));
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        self.waiting.push(WaitEntry { id, slot, adapter: adapter_idx, skipped: 0 });
        Ok(())
    }

    /// Plans one step: running requests first (decodes and ongoing prefill chunks, preempting the
    /// newest running request when KV blocks run out), then waiting requests in queue order under
    /// the token, sequence, KV and adapter budgets. No step-time budget applies (see
    /// [`Scheduler::schedule_with_cost`]).
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.schedule_inner(None)
    }

    /// [`Scheduler::schedule`] under the configured [`StepTime`] budget, with `cost` the
    /// engine's measured cost of a step. When the budget is bounded and the step has decode rows:
    /// every decode row first (never dropped for prefill), then every running prefill by
    /// `min(remaining, max(prefill budget left, min_prefill_chunk))` tokens, so each admitted
    /// prompt advances every step, then admissions while prefill budget is left. The prefill
    /// budget is the tokens that fit next to the decode rows within the step's time, and at least
    /// `min_prefill_chunk`, so waiting prompts are always admitted in the end.
    pub fn schedule_with_cost(&mut self, cost: &StepCost) -> SchedulerOutput {
        self.schedule_inner(Some(cost))
    }

    fn schedule_inner(&mut self, cost: Option<&StepCost>) -> SchedulerOutput {
        self.step += 1;
        // Sized once: growing these vectors step by step is a measurable share of a step.
        let capacity = self.config.max_num_seqs.min(self.index.len());
        let mut out =
            SchedulerOutput { step: self.step, scheduled: Vec::with_capacity(capacity), ..SchedulerOutput::default() };
        self.in_flight.reserve(capacity);
        self.step_adapters.clear();
        let mut budget = self.config.max_num_batched_tokens;
        let mut prefill: Option<usize> = None;
        match cost {
            Some(cost) if self.config.step_time != StepTime::Unbounded => {
                self.schedule_running(Pass::Decodes, &mut budget, &mut prefill, &mut out);
                let rows = out.scheduled.len();
                if let Some(limit) = cost.limit_s(self.config.step_time, rows) {
                    let fits = cost.prefill_tokens_within(limit, rows);
                    prefill = Some(fits.max(self.config.min_prefill_chunk));
                    out.prefill_budget = prefill;
                }
                if out.preempted.is_empty() {
                    self.schedule_running(Pass::Prefills, &mut budget, &mut prefill, &mut out);
                }
            }
            // Running requests, in admission order: each catches its computed tokens up with
            // its tokens (a decode is the one sampled token, a prefill continues its chunks).
            _ => self.schedule_running(Pass::All, &mut budget, &mut prefill, &mut out),
        }

        // Waiting requests, unless this step had to preempt (then the pool is tight and the
        // preempted requests come first next step).
        if out.preempted.is_empty() {
            self.admit_waiting(&mut budget, &mut prefill, &mut out);
        }
        out
    }

    /// One pass over the running requests in admission order, scheduling those `pass` takes.
    ///
    /// When blocks run out: in a single pass (`Pass::All`) the newest running request is
    /// preempted, which is never one already scheduled this step (those are older); in the
    /// two-pass order the newest running request *not yet scheduled* this step is.
    fn schedule_running(
        &mut self,
        pass: Pass,
        budget: &mut usize,
        prefill: &mut Option<usize>,
        out: &mut SchedulerOutput,
    ) {
        let min_chunk = self.config.min_prefill_chunk;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let (id, remaining, computed, scheduled, logit_rows, decoding) = {
                let req = self.req(slot);
                let rows = req.prompt_rows(self.config.max_prompt_logprob_rows);
                // Past its prompt, a request's uncomputed tokens are its own output (a sampled
                // token and those its grammar forced): a decode row, however many.
                let decoding = req.num_computed >= req.num_prompt_tokens;
                (req.id, req.num_tokens() - req.num_computed, req.num_computed, req.in_flight, rows, decoding)
            };
            let decode = remaining == 1 || decoding;
            let wanted = match pass {
                Pass::All => true,
                Pass::Decodes => decode,
                Pass::Prefills => !decode,
            };
            if remaining == 0 || scheduled || !wanted {
                i += 1;
                continue;
            }
            let mut num_new = remaining.min(*budget).min(logit_rows);
            if let (Pass::Prefills, Some(left)) = (pass, *prefill) {
                num_new = num_new.min(left.max(min_chunk));
            }
            let target = computed + num_new;
            let mut preempted_self = false;
            while self.kv.allocate(id, target).is_err() {
                let victim = match pass {
                    Pass::All => self.running.pop(),
                    Pass::Decodes | Pass::Prefills => self.pop_unscheduled().map(|(victim, at)| {
                        if at < i {
                            i -= 1;
                        }
                        victim
                    }),
                };
                let Some(victim) = victim else {
                    break;
                };
                self.preempt(victim, out);
                if victim == slot {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                if pass == Pass::All {
                    break;
                }
                // `slot` left `running`; position `i` now holds the next request.
                continue;
            }
            self.emit(slot, num_new, out);
            *budget -= num_new;
            if !decode && let Some(left) = prefill {
                *left = left.saturating_sub(num_new);
            }
            i += 1;
        }
    }

    /// Removes the newest running request not scheduled this step from `running`: its slot and
    /// where it was.
    fn pop_unscheduled(&mut self) -> Option<(u32, usize)> {
        let at = self.running.iter().rposition(|&s| !self.req(s).in_flight)?;
        Some((self.running.remove(at), at))
    }

    /// Applies the engine's results for the step(s) scheduled since the last call: appends sampled
    /// tokens, registers newly computed full blocks with the prefix cache, and retires finished
    /// requests (an engine-reported finish, then `max_new_tokens` or `max_model_len` as
    /// [`FinishReason::Length`], then a stop token as [`FinishReason::Stop`]), freeing their blocks.
    ///
    /// Results for unknown ids (e.g. aborted since) are ignored. A request that was to sample but
    /// gets neither a token nor a finish is retired with [`FinishReason::Error`], so it cannot
    /// hang. A token for a request that was not to sample is [`Error::UnexpectedToken`], and then
    /// nothing is applied.
    pub fn update(&mut self, results: &[RequestResult]) -> Result<Vec<FinishedRequest>> {
        for r in results {
            if let Some(&slot) = self.index.get(&r.id)
                && r.token.is_some()
                && !self.req(slot).sample_pending
            {
                return Err(Error::UnexpectedToken { id: r.id });
            }
        }
        for r in results {
            let Some(&slot) = self.index.get(&r.id) else {
                continue;
            };
            let req = self.req_mut(slot);
            if let Some(token) = r.token
                && req.sample_pending
                && !req.got_token
            {
                req.tokens.push(token);
                req.tokens.extend_from_slice(&r.forced);
                req.got_token = true;
            }
            if let Some(reason) = r.finish {
                req.reported_finish.get_or_insert(reason);
            }
        }

        let mut finished = Vec::new();
        let caching = self.kv.config().enable_prefix_caching;
        let sliding = self.kv.config().sliding.is_some();
        let block_size = self.kv.config().block_size;
        let mut in_flight = std::mem::take(&mut self.in_flight);
        for &(slot, id) in &in_flight {
            let max_model_len = self.config.max_model_len;
            let Some(req) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if req.id != id || !req.in_flight {
                continue;
            }
            req.in_flight = false;
            // Only a step that filled a block has anything to cache (most decodes do not); with a
            // sliding group every step may move the window past a block, which is freed.
            if req.status == Status::Running
                && (sliding || caching && req.num_computed / block_size > req.computed_before_step / block_size)
            {
                // Caching is an optimization: a failed commit only means these blocks are not
                // shared, so it must not fail the step (its one error is a count out of range).
                let committed = self.kv.commit(id, &req.tokens, req.num_computed);
                debug_assert!(committed.is_ok(), "commit of request {id}: {committed:?}");
            }
            let reason = if let Some(reason) = req.reported_finish.take() {
                Some(reason)
            } else if req.got_token {
                check_stop(req, max_model_len)
            } else if req.sample_pending {
                Some(FinishReason::Error)
            } else {
                None
            };
            req.got_token = false;
            req.sample_pending = false;
            if let Some(reason) = reason {
                finished.push(self.retire(slot, reason));
            }
        }
        in_flight.clear();
        self.in_flight = in_flight;

        // Finishes the engine reported for requests that were not in the step.
        for r in results {
            if r.finish.is_none() {
                continue;
            }
            if let Some(&slot) = self.index.get(&r.id)
                && let Some(reason) = self.req_mut(slot).reported_finish.take()
            {
                finished.push(self.retire(slot, reason));
            }
        }
        if !finished.is_empty() {
            let slots = &self.slots;
            self.running.retain(|&s| slots[s as usize].is_some());
        }
        Ok(finished)
    }

    /// Removes a request in any state and frees everything it held; `None` if `id` is not live.
    pub fn abort(&mut self, id: RequestId) -> Option<FinishedRequest> {
        let slot = *self.index.get(&id)?;
        if self.req(slot).status == Status::Running
            && let Some(pos) = self.running.iter().position(|&s| s == slot)
        {
            self.running.remove(pos);
        }
        Some(self.retire(slot, FinishReason::Aborted))
    }

    /// The admission scan over the waiting queue; `prefill`, when set, is what the step-time budget
    /// leaves for prompt tokens.
    fn admit_waiting(&mut self, budget: &mut usize, prefill: &mut Option<usize>, out: &mut SchedulerOutput) {
        let bound = match self.config.policy {
            Policy::Aging { max_skipped_steps } => Some(max_skipped_steps),
            _ => None,
        };
        let (mut target, mut drain) = self.aging_target(bound);
        // Adapters aging held back earlier in this scan stay held after the target gets in:
        // otherwise a request could overtake a skipped request of its own adapter.
        self.aging_held.clear();
        let max_loras = self.config.max_loras;
        let mut pos = 0;
        let mut admitted_any = false;
        while pos < self.waiting.len() {
            if self.running.len() >= self.config.max_num_seqs || *budget == 0 || *prefill == Some(0) {
                break;
            }
            // The tokens this admission may compute: the token budget, and the time budget's.
            let allowance = prefill.map_or(*budget, |p| p.min(*budget));
            // Skip the run of requests the adapter rule keeps out, in one tight pass over the
            // slice: under skewed traffic this is most of the queue.
            let adapters = &self.adapters;
            let held = &mut self.aging_held;
            let mut admissible = |adapter: u32| {
                let running = adapters.is_running(adapter);
                // vLLM's rule: a running adapter (or none) is fine; a new one needs a free slot.
                if !running && adapters.num_running() >= max_loras {
                    return false;
                }
                // Aging: the drained adapter and every other new adapter wait for the target.
                if drain == Some(adapter) || (!running && target.is_some_and(|t| t != adapter)) {
                    if !held.contains(&adapter) {
                        held.push(adapter);
                    }
                    return false;
                }
                !held.contains(&adapter)
            };
            let queue_len = self.waiting.len();
            for entry in &mut self.waiting[pos..] {
                if admissible(entry.adapter) {
                    break;
                }
                entry.skipped += 1;
                if bound.is_some_and(|b| entry.skipped == b.saturating_add(1)) {
                    self.num_starved += 1;
                }
                if out.skipped_for_adapter_limit.capacity() == 0 {
                    out.skipped_for_adapter_limit.reserve(queue_len - pos);
                }
                out.skipped_for_adapter_limit.push(entry.id);
                pos += 1;
            }
            let Some(&entry) = self.waiting.get(pos) else {
                break;
            };

            let Some(req) = self.slots[entry.slot as usize].as_mut() else {
                pos += 1;
                continue;
            };
            let skip_cache = req.prompt_logprobs;
            let num_tokens = req.num_tokens();
            let logit_rows = req.prompt_rows(self.config.max_prompt_logprob_rows);
            let admitted = if self.kv.fits(num_tokens) {
                // Room for every token even without hits: admit the cached prefix alone, then
                // grow by the chunk; both succeed (hit blocks that leave the free queue are no
                // more than the blocks they save), and the prompt is hashed once.
                self.kv.admit(entry.id, &req.tokens, &req.extra, skip_cache, 0).and_then(|cached| {
                    let num_new = (num_tokens - cached).min(allowance).min(logit_rows);
                    self.kv.allocate(entry.id, cached + num_new)?;
                    Ok((cached, num_new))
                })
            } else {
                // Tight pool: size the admission exactly, all or nothing.
                let cached = self.kv.lookup(&req.tokens, &req.extra, skip_cache);
                let num_new = (num_tokens - cached).min(allowance).min(logit_rows);
                self.kv.admit(entry.id, &req.tokens, &req.extra, skip_cache, num_new).map(|cached| (cached, num_new))
            };
            let num_new = match admitted {
                Ok((cached, num_new)) => {
                    req.num_computed = cached;
                    num_new
                }
                Err(_) => {
                    // Cannot happen on the fast path; if it did, leave nothing half-admitted.
                    self.kv.free(entry.id);
                    // Strict queue order for blocks: nobody behind it takes what frees up first.
                    out.waiting_for_blocks.push(entry.id);
                    break;
                }
            };
            req.status = Status::Running;
            self.adapters.remove_waiting(entry.adapter);
            self.adapters.add_running(entry.adapter);
            self.running.push(entry.slot);
            if bound.is_some_and(|b| entry.skipped > b) {
                self.num_starved -= 1;
            }
            if target == Some(entry.adapter) {
                target = None;
                drain = None;
            }
            self.emit(entry.slot, num_new, out);
            *budget -= num_new;
            if let Some(p) = prefill {
                *p = p.saturating_sub(num_new);
            }
            self.waiting[pos].slot = TOMBSTONE;
            admitted_any = true;
            pos += 1;
        }
        if admitted_any {
            let mut kept = 0;
            for r in 0..pos {
                if self.waiting[r].slot != TOMBSTONE {
                    self.waiting.swap(kept, r);
                    kept += 1;
                }
            }
            self.waiting.drain(kept..pos);
        }
    }

    /// Under aging with a starved request: the adapter to bring in (`target`), and, when every
    /// slot is taken, the running adapter that stops admitting so its slot drains (`drain`).
    fn aging_target(&self, bound: Option<u32>) -> (Option<u32>, Option<u32>) {
        let Some(bound) = bound else {
            return (None, None);
        };
        if self.num_starved == 0 {
            return (None, None);
        }
        let target =
            self.waiting.iter().find(|e| e.skipped > bound && !self.adapters.is_running(e.adapter)).map(|e| e.adapter);
        let Some(target) = target else {
            return (None, None);
        };
        let drain =
            if self.adapters.num_running() >= self.config.max_loras { self.adapters.fewest_running() } else { None };
        (Some(target), drain)
    }

    /// Adds a running request's chunk of `num_new` tokens to the step.
    fn emit(&mut self, slot: u32, num_new: usize, out: &mut SchedulerOutput) {
        let Some(req) = self.slots[slot as usize].as_mut() else {
            return;
        };
        let start = req.num_computed;
        let end = start + num_new;
        let sample = end == req.num_tokens();
        let logits = if req.prompt_logprobs && req.num_output_tokens() == 0 {
            LogitsWanted::AllPrompt
        } else if sample {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        out.scheduled.push(ScheduledRequest {
            id: req.id,
            adapter: req.adapter,
            num_computed_tokens: start,
            token_ids: req.tokens[start..end].to_vec(),
            block_table: self.kv.block_table(req.id).to_vec(),
            sliding_table: self.kv.sliding_table(req.id).to_vec(),
            logits,
            sample,
            num_prompt_tokens: req.num_prompt_tokens,
        });
        out.num_scheduled_tokens += num_new;
        if let Some(generation) = req.adapter
            && !self.step_adapters.contains(&req.adapter_idx)
        {
            self.step_adapters.push(req.adapter_idx);
            out.active_adapters.push(generation);
        }
        if !req.in_flight {
            req.computed_before_step = start;
        }
        req.num_computed = end;
        req.sample_pending = sample;
        req.in_flight = true;
        self.in_flight.push((slot, req.id));
    }

    /// Preempts a running request (already popped from `running`): frees its blocks and puts it
    /// at the front of the waiting queue to recompute prompt and outputs later.
    fn preempt(&mut self, slot: u32, out: &mut SchedulerOutput) {
        let Some(req) = self.slots[slot as usize].as_mut() else {
            return;
        };
        self.kv.free(req.id);
        req.status = Status::Waiting;
        req.num_computed = 0;
        req.sample_pending = false;
        req.num_preemptions += 1;
        self.adapters.remove_running(req.adapter_idx);
        self.adapters.add_waiting(req.adapter_idx);
        self.waiting.insert(0, WaitEntry { id: req.id, slot, adapter: req.adapter_idx, skipped: 0 });
        out.preempted.push(req.id);
    }

    /// Removes a live request from the books (the caller removes a running one from `running`).
    fn retire(&mut self, slot: u32, reason: FinishReason) -> FinishedRequest {
        let Some(mut req) = self.slots[slot as usize].take() else {
            unreachable!("retire of an empty slot");
        };
        self.free_slots.push(slot);
        self.index.remove(&req.id);
        self.kv.free(req.id);
        match req.status {
            Status::Running => self.adapters.remove_running(req.adapter_idx),
            Status::Waiting => {
                self.adapters.remove_waiting(req.adapter_idx);
                if let Some(pos) = self.waiting.iter().position(|e| e.slot == slot) {
                    let entry = self.waiting.remove(pos);
                    if let Policy::Aging { max_skipped_steps } = self.config.policy
                        && entry.skipped > max_skipped_steps
                    {
                        self.num_starved -= 1;
                    }
                }
            }
        }
        self.adapters.release(req.adapter_idx);
        let output_token_ids = req.tokens.split_off(req.num_prompt_tokens);
        FinishedRequest {
            id: req.id,
            adapter: req.adapter,
            reason,
            output_token_ids,
            num_preemptions: req.num_preemptions,
        }
    }

    fn req(&self, slot: u32) -> &ReqState {
        match &self.slots[slot as usize] {
            Some(req) => req,
            None => unreachable!("slot {slot} is empty"),
        }
    }

    fn req_mut(&mut self, slot: u32) -> &mut ReqState {
        match &mut self.slots[slot as usize] {
            Some(req) => req,
            None => unreachable!("slot {slot} is empty"),
        }
    }

    /// The arrival number of a live request: its place in the order of `add_request` calls.
    pub fn arrival(&self, id: RequestId) -> Option<u64> {
        let slot = *self.index.get(&id)?;
        Some(self.req(slot).arrival)
    }

    /// The running adapter generations (sorted).
    pub fn running_adapters(&self) -> Vec<AdapterGen> {
        self.adapters.running_gens()
    }
}

/// The scheduler's own stop rules, after a token was appended.
fn check_stop(req: &ReqState, max_model_len: usize) -> Option<FinishReason> {
    if req.num_output_tokens() >= req.max_new_tokens || req.num_tokens() >= max_model_len {
        return Some(FinishReason::Length);
    }
    let last = *req.tokens.last()?;
    req.stop_token_ids.contains(&last).then_some(FinishReason::Stop)
}
