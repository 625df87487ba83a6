//! Synthetic traffic replayed through the scheduler with an ideal engine, for experiments.
//!
//! The engine is ideal: every step runs what was scheduled and samples token 1 for every request
//! that samples. A [`Workload`] says when requests arrive and which adapter they use;
//! [`run`] replays it and reports steps, batch sizes and per-request timings.
//!
//! The seed experiment: 64 requests over 8 adapters, interleaved, one-token prompts, 20 new tokens
//! each and no other limit take `160 / max_loras` steps at `8 · max_loras` requests per step.
//!
//! ```
//! use multilora_scheduler::{Policy, sim};
//!
//! let report = sim::seed_experiment(&[8; 8], 20, 2, Policy::Fcfs)?;
//! assert_eq!(report.steps, 80);
//! assert_eq!(report.avg_requests_per_step(), 16.0);
//! # Ok::<(), multilora_scheduler::Error>(())
//! ```

use std::fmt::Write as _;

use multilora_prefix_cache::{KvConfig, RequestId};
use multilora_types::{AdapterGen, AdapterId, Fingerprint};

use crate::{Policy, Request, RequestResult, Result, Scheduler, SchedulerConfig};

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// Steps completed before it arrives (0: before the first step).
    pub step: u64,
    /// Adapter index (see [`adapter_gen`]), or `None` for the base model.
    pub adapter: Option<usize>,
    /// Prompt tokens (distinct per request, so prompts never share prefix-cache blocks).
    pub prompt_len: usize,
    /// Tokens to generate.
    pub max_new_tokens: usize,
}

/// Requests and their arrival steps; request `i` gets id `i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    /// Arrivals sorted by step.
    pub arrivals: Vec<Arrival>,
}

impl Workload {
    /// `counts[a]` requests of adapter `a`, all arriving before the first step, interleaved
    /// round-robin over the adapters that still have requests left (0, 1, …, 0, 1, …).
    pub fn interleaved(counts: &[usize], prompt_len: usize, max_new_tokens: usize) -> Self {
        let mut left = counts.to_vec();
        let mut arrivals = Vec::with_capacity(counts.iter().sum());
        while left.iter().any(|&n| n > 0) {
            for (adapter, n) in left.iter_mut().enumerate() {
                if *n > 0 {
                    *n -= 1;
                    arrivals.push(Arrival { step: 0, adapter: Some(adapter), prompt_len, max_new_tokens });
                }
            }
        }
        Self { arrivals }
    }
}

/// The generation key of adapter index `a` in simulations: id `a`, fingerprint bytes from `a`.
pub fn adapter_gen(a: usize) -> AdapterGen {
    let mut fingerprint = [0u8; 32];
    fingerprint[..8].copy_from_slice(&(a as u64).to_le_bytes());
    fingerprint[31] = 0x5a;
    AdapterGen::new(AdapterId(a as u64), Fingerprint(fingerprint))
}

/// Timings of one simulated request, in steps (counted from 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// Its id (its index in the workload).
    pub id: RequestId,
    /// Its adapter index.
    pub adapter: Option<usize>,
    /// Steps completed before it arrived.
    pub arrival_step: u64,
    /// The first step it was scheduled in.
    pub first_scheduled_step: Option<u64>,
    /// The step after which it finished.
    pub finish_step: Option<u64>,
}

/// What a simulation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Steps that scheduled at least one request (model steps).
    pub steps: u64,
    /// Steps elapsed, idle ones included.
    pub elapsed_steps: u64,
    /// Sum over steps of the requests scheduled.
    pub scheduled_requests: u64,
    /// Sum over steps of the tokens scheduled.
    pub scheduled_tokens: u64,
    /// Most distinct adapters in one step.
    pub max_adapters_per_step: usize,
    /// Preemptions.
    pub preemptions: u64,
    /// Per request, in id order.
    pub requests: Vec<SimRequest>,
}

impl SimReport {
    /// Mean requests per model step.
    pub fn avg_requests_per_step(&self) -> f64 {
        if self.steps == 0 { 0.0 } else { self.scheduled_requests as f64 / self.steps as f64 }
    }

    /// Whether every request finished.
    pub fn completed(&self) -> bool {
        self.requests.iter().all(|r| r.finish_step.is_some())
    }
}

/// Replays `workload` for at most `max_steps` steps (stopping early when every request finished).
pub fn run(config: SchedulerConfig, workload: &Workload, max_steps: u64) -> Result<SimReport> {
    let mut sched = Scheduler::new(config)?;
    let mut report = SimReport {
        steps: 0,
        elapsed_steps: 0,
        scheduled_requests: 0,
        scheduled_tokens: 0,
        max_adapters_per_step: 0,
        preemptions: 0,
        requests: Vec::with_capacity(workload.arrivals.len()),
    };
    let mut next = 0;
    let mut results = Vec::new();
    while report.elapsed_steps < max_steps {
        while let Some(a) = workload.arrivals.get(next)
            && a.step <= report.elapsed_steps
        {
            let id = next as RequestId;
            let prompt = (0..a.prompt_len).map(|k| ((id as usize * 7919 + k) % 30_000 + 2) as u32).collect();
            let mut request = Request::new(id, prompt, a.max_new_tokens);
            request.adapter = a.adapter.map(adapter_gen);
            sched.add_request(request)?;
            report.requests.push(SimRequest {
                id,
                adapter: a.adapter,
                arrival_step: report.elapsed_steps,
                first_scheduled_step: None,
                finish_step: None,
            });
            next += 1;
        }
        if next == workload.arrivals.len() && !sched.has_unfinished() {
            break;
        }
        let out = sched.schedule();
        report.elapsed_steps += 1;
        report.preemptions += out.preempted.len() as u64;
        if !out.is_empty() {
            report.steps += 1;
            report.scheduled_requests += out.scheduled.len() as u64;
            report.scheduled_tokens += out.num_scheduled_tokens as u64;
            report.max_adapters_per_step = report.max_adapters_per_step.max(out.active_adapters.len());
        }
        results.clear();
        for s in &out.scheduled {
            let r = &mut report.requests[s.id as usize];
            r.first_scheduled_step.get_or_insert(out.step);
            if s.sample {
                results.push(RequestResult::token(s.id, 1));
            }
        }
        for f in sched.update(&results)? {
            report.requests[f.id as usize].finish_step = Some(out.step);
        }
    }
    Ok(report)
}

/// The seed experiment: `counts[a]` requests of adapter `a`, interleaved, one-token prompts,
/// `new_tokens` each, under `max_loras` and `policy` with no other limit (sequences, tokens and
/// KV blocks sized for everything at once).
pub fn seed_experiment(counts: &[usize], new_tokens: usize, max_loras: usize, policy: Policy) -> Result<SimReport> {
    let workload = Workload::interleaved(counts, 1, new_tokens);
    let n = workload.arrivals.len().max(1);
    let block_size = 16;
    let max_model_len = new_tokens + 2;
    let blocks_per_request = max_model_len.div_ceil(block_size);
    let config = SchedulerConfig::default()
        .max_num_seqs(n)
        .max_num_batched_tokens(n)
        .max_model_len(max_model_len)
        .max_loras(max_loras)
        .policy(policy)
        .kv(KvConfig { num_blocks: n * blocks_per_request, block_size, ..KvConfig::default() });
    // Every request needs `new_tokens` steps once admitted; one adapter group at a time is the
    // worst case, so this bound is never reached by a scheduler that makes progress.
    let max_steps = (n as u64 + 1) * (new_tokens as u64 + 1) + 16;
    run(config, &workload, max_steps)
}

/// The experiment's table: one row per `(max_loras, report)`, columns `max_loras`, `steps` and
/// `avg requests per step`.
pub fn format_table(rows: &[(usize, SimReport)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:>9}  {:>7}  {:>21}", "max_loras", "steps", "avg requests per step");
    for (max_loras, report) in rows {
        let _ = writeln!(s, "{:>9}  {:>7}  {:>21.1}", max_loras, report.steps, report.avg_requests_per_step());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_is_round_robin_over_adapters_with_requests_left() {
        let w = Workload::interleaved(&[3, 1, 2], 1, 1);
        let order: Vec<_> = w.arrivals.iter().map(|a| a.adapter.unwrap_or(99)).collect();
        assert_eq!(order, vec![0, 1, 2, 0, 2, 0]);
    }

    #[test]
    fn seed_experiment_matches_the_seed_numbers_under_both_policies() {
        for policy in [Policy::Fcfs, Policy::default(), Policy::aging(0)] {
            let mut rows = Vec::new();
            for max_loras in [1, 2, 4, 8] {
                let report = seed_experiment(&[8; 8], 20, max_loras, policy).unwrap();
                assert!(report.completed());
                assert!(report.max_adapters_per_step <= max_loras);
                rows.push((max_loras, report));
            }
            let expected = "\
max_loras    steps  avg requests per step
        1      160                    8.0
        2       80                   16.0
        4       40                   32.0
        8       20                   64.0
";
            assert_eq!(format_table(&rows), expected, "policy {policy:?}");
        }
    }
}
