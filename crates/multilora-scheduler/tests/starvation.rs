//! A steady stream for one adapter starves another under `Fcfs` (as in vLLM) but not under
//! `Aging`.

use multilora_scheduler::sim::{self, Arrival, Workload};
use multilora_scheduler::{KvConfig, Policy, SchedulerConfig};

const STEPS: u64 = 400;
const NEW_TOKENS: usize = 10;

/// Adapter 0: one request per step for `STEPS` steps; adapter 1: one request at step 5.
fn workload() -> Workload {
    let mut arrivals: Vec<Arrival> =
        (0..STEPS).map(|step| Arrival { step, adapter: Some(0), prompt_len: 4, max_new_tokens: NEW_TOKENS }).collect();
    arrivals.insert(6, Arrival { step: 5, adapter: Some(1), prompt_len: 4, max_new_tokens: NEW_TOKENS });
    Workload { arrivals }
}

fn config(policy: Policy) -> SchedulerConfig {
    SchedulerConfig::default()
        .max_loras(1)
        .max_model_len(64)
        .policy(policy)
        .kv(KvConfig { num_blocks: 4096, ..KvConfig::default() })
}

fn adapter1(report: &sim::SimReport) -> &sim::SimRequest {
    report.requests.iter().find(|r| r.adapter == Some(1)).expect("adapter 1 arrived")
}

#[test]
fn fcfs_starves_the_other_adapter() -> anyhow::Result<()> {
    let report = sim::run(config(Policy::Fcfs), &workload(), STEPS)?;
    let starved = adapter1(&report);
    assert_eq!(starved.arrival_step, 5);
    assert_eq!(starved.first_scheduled_step, None, "never admitted in {STEPS} steps");
    Ok(())
}

#[test]
fn aging_admits_it_within_the_bound_and_keeps_serving_the_stream() -> anyhow::Result<()> {
    let max_skipped_steps = 8;
    let report = sim::run(config(Policy::aging(max_skipped_steps)), &workload(), STEPS + 100)?;
    let r = adapter1(&report);
    let admitted = r.first_scheduled_step.expect("admitted");
    let waited = admitted - r.arrival_step;
    // Starved after the bound, then the running adapter drains in at most one request lifetime.
    let bound = u64::from(max_skipped_steps) + NEW_TOKENS as u64 + 2;
    assert!(waited <= bound, "waited {waited} steps, bound {bound}");
    assert!(report.completed(), "every request of the stream finishes too");
    assert_eq!(report.max_adapters_per_step, 1);
    Ok(())
}
