//! Property tests: the adapter limit and the budgets hold every step, finite workloads finish, a
//! skipped request never loses its place to a later request of its adapter, and KV is returned.

mod common;

use std::collections::{HashMap, HashSet};

use common::lora;
use multilora_scheduler::{KvConfig, Policy, Request, RequestId, RequestResult, Scheduler, SchedulerConfig, StepCost};
use multilora_types::StepTime;
use proptest::prelude::*;

const MAX_MODEL_LEN: usize = 24;
const STOP: u32 = 3;

#[derive(Clone, Debug)]
struct Req {
    arrival: u64,
    adapter: Option<usize>,
    /// Prompts share leading tokens per `family`, so the prefix cache gets hits.
    family: u32,
    prompt_len: usize,
    max_new_tokens: usize,
    prompt_logprobs: bool,
}

fn req() -> impl Strategy<Value = Req> {
    (
        0u64..12,
        prop_oneof![1 => Just(None), 3 => (0usize..5).prop_map(Some)],
        0u32..3,
        1usize..20,
        1usize..8,
        prop::bool::weighted(0.1),
    )
        .prop_map(|(arrival, adapter, family, prompt_len, max_new_tokens, prompt_logprobs)| Req {
            arrival,
            adapter,
            family,
            prompt_len,
            max_new_tokens,
            prompt_logprobs,
        })
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        1usize..4,
        1usize..7,
        1usize..40,
        prop_oneof![Just(2usize), Just(4)],
        0usize..16,
        any::<bool>(),
        prop_oneof![Just(Policy::Fcfs), (0u32..4).prop_map(Policy::aging)],
    )
        .prop_map(|(max_loras, seqs, tokens, block_size, extra_blocks, caching, policy)| {
            SchedulerConfig::default()
                .max_loras(max_loras)
                .max_num_seqs(seqs)
                .max_num_batched_tokens(tokens)
                .max_model_len(MAX_MODEL_LEN)
                .policy(policy)
                .kv(KvConfig {
                    num_blocks: MAX_MODEL_LEN.div_ceil(block_size) + extra_blocks,
                    block_size,
                    enable_prefix_caching: caching,
                    ..KvConfig::default()
                })
        })
}

/// A step-time budget and a cost model for it.
fn budget() -> impl Strategy<Value = (StepTime, StepCost)> {
    (
        prop_oneof![
            (1.2f64..4.0).prop_map(|factor| StepTime::Auto { factor }),
            (0.001f64..0.03).prop_map(|seconds| StepTime::Max { seconds })
        ],
        0.0f64..0.01,
        0.0f64..0.002,
        // Up to a few prefill tokens per step, so prompts are chunked and run side by side.
        0.0005f64..0.01,
    )
        .prop_map(|(t, fixed_s, per_decode_row_s, per_prefill_token_s)| {
            (t, StepCost { fixed_s, per_decode_row_s, per_prefill_token_s })
        })
}

/// Runs the workload; with `cost`, under the config's step-time budget, where also every running
/// decode row and every running prefill is in every step (unless the token cap is reached, or
/// blocks ran out and it was preempted).
fn run(config: SchedulerConfig, mut reqs: Vec<Req>, cost: Option<StepCost>) -> Result<(), TestCaseError> {
    reqs.sort_by_key(|r| r.arrival);
    let mut s = Scheduler::new(config.clone()).expect("valid config");
    let adapter_of: HashMap<RequestId, Option<usize>> =
        reqs.iter().enumerate().map(|(i, r)| (i as RequestId, r.adapter)).collect();
    let mut running: HashSet<RequestId> = HashSet::new();
    let mut finished: HashSet<RequestId> = HashSet::new();
    // Running requests that will compute again next step: decoding, or mid-prefill.
    let mut continuing: HashSet<RequestId> = HashSet::new();
    let mut next = 0;
    let max_steps = 4000;
    for step in 0..max_steps {
        while next < reqs.len() && reqs[next].arrival <= step {
            let r = &reqs[next];
            let prompt = (0..r.prompt_len as u32).map(|k| 10 + r.family * 100 + k).collect();
            let mut request = Request::new(next as RequestId, prompt, r.max_new_tokens)
                .stop_token_ids(vec![STOP])
                .prompt_logprobs(r.prompt_logprobs);
            request.adapter = r.adapter.map(lora);
            s.add_request(request).expect("valid request");
            next += 1;
        }
        if next == reqs.len() && !s.has_unfinished() {
            break;
        }
        let out = match &cost {
            Some(cost) => s.schedule_with_cost(cost),
            None => s.schedule(),
        };
        if cost.is_some()
            && out.num_scheduled_tokens < config.max_num_batched_tokens
            && out.scheduled.len() < config.max_num_seqs
        {
            for id in &continuing {
                prop_assert!(
                    out.scheduled.iter().any(|r| r.id == *id) || out.preempted.contains(id),
                    "running request {} was left out of step {}",
                    id,
                    step
                );
            }
        }

        // Budgets.
        prop_assert!(out.num_scheduled_tokens <= config.max_num_batched_tokens);
        prop_assert_eq!(out.num_scheduled_tokens, out.scheduled.iter().map(|r| r.token_ids.len()).sum::<usize>());
        prop_assert!(out.scheduled.len() <= config.max_num_seqs);
        prop_assert!(s.num_running() <= config.max_num_seqs);
        for r in &out.scheduled {
            prop_assert!(!r.token_ids.is_empty());
            let end = r.num_computed_tokens + r.token_ids.len();
            prop_assert!(end <= MAX_MODEL_LEN);
            prop_assert!(r.block_table.len() * config.kv.block_size >= end);
        }
        // The adapter limit, over all running requests.
        let counts = s.counts();
        prop_assert!(counts.running_adapters.len() <= config.max_loras);
        prop_assert!(out.active_adapters.len() <= config.max_loras);

        // Admission order within an adapter.
        for id in &out.preempted {
            running.remove(id);
        }
        for r in &out.scheduled {
            if running.insert(r.id) {
                let adapter = adapter_of[&r.id];
                for skipped in &out.skipped_for_adapter_limit {
                    prop_assert!(
                        !(adapter_of[skipped] == adapter && *skipped < r.id),
                        "request {} of adapter {:?} admitted before skipped {}",
                        r.id,
                        adapter,
                        skipped
                    );
                }
            }
        }

        let results: Vec<_> = out
            .scheduled
            .iter()
            .filter(|r| r.sample)
            .map(|r| {
                let token = if (r.id + step) % 7 == 0 { STOP } else { 5 };
                RequestResult::token(r.id, token)
            })
            .collect();
        continuing = out.scheduled.iter().map(|r| r.id).filter(|id| !out.preempted.contains(id)).collect();
        for f in s.update(&results).expect("update") {
            prop_assert!(f.output_token_ids.len() <= reqs[f.id as usize].max_new_tokens);
            prop_assert!(finished.insert(f.id));
            running.remove(&f.id);
            continuing.remove(&f.id);
        }
    }
    prop_assert_eq!(finished.len(), reqs.len(), "every request finishes (no livelock)");
    prop_assert_eq!(s.kv().num_free_blocks(), config.kv.num_blocks, "all KV blocks returned");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn invariants_hold_and_every_request_finishes(
        config in config(),
        reqs in prop::collection::vec(req(), 1..24),
    ) {
        run(config, reqs, None)?;
    }

    #[test]
    fn under_a_step_time_budget_too(
        config in config(),
        (step_time, cost) in budget(),
        min_chunk in 1usize..6,
        reqs in prop::collection::vec(req(), 1..24),
    ) {
        run(config.step_time(step_time).min_prefill_chunk(min_chunk), reqs, Some(cost))?;
    }
}
