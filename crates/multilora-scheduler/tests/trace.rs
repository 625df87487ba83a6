//! Data-driven traces: a small workload in, the scheduler's step-by-step decisions out.
//!
//! Line format: `step: id[aN][from..to]X` per scheduled request (X: `L` logits at the last
//! position, `-` none, `A` at every prompt position), then preemptions, skips, requests waiting
//! for blocks and finishes.

mod common;

use common::{Trace, check, lora};
use multilora_scheduler::{KvConfig, Policy, Request, SchedulerConfig};

fn kv(num_blocks: usize, block_size: usize, caching: bool) -> KvConfig {
    KvConfig { num_blocks, block_size, enable_prefix_caching: caching, ..KvConfig::default() }
}

fn prompt(from: u32, len: u32) -> Vec<u32> {
    (from..from + len).collect()
}

#[test]
fn chunked_prefill() {
    let config = SchedulerConfig::default().max_num_batched_tokens(8).max_model_len(64).kv(kv(32, 4, true));
    let trace = Trace::new(config)
        .arrive(1, Request::new(1, prompt(1, 19), 2))
        .arrive(1, Request::new(2, prompt(100, 3), 2))
        .arrive(3, Request::new(3, prompt(200, 2), 1))
        .run(20);
    check(
        &trace,
        "
         1: 1[0..8]-
         2: 1[8..16]-
         3: 1[16..19]L 2[0..3]L 3[0..2]L | done 3 length(1)
         4: 1[19..20]L 2[3..4]L | done 1 length(2) | done 2 length(2)
        ",
    );
}

#[test]
fn preemption_by_recompute() {
    let config = SchedulerConfig::default().max_model_len(16).kv(kv(4, 4, false));
    let trace = Trace::new(config)
        .arrive(1, Request::new(1, prompt(1, 6), 8))
        .arrive(1, Request::new(2, prompt(100, 6), 4))
        .run(40);
    check(
        &trace,
        "
         1: 1[0..6]L 2[0..6]L
         2: 1[6..7]L 2[6..7]L
         3: 1[7..8]L 2[7..8]L
         4: 1[8..9]L | preempted [2]
         5: 1[9..10]L | no-blocks [2]
         6: 1[10..11]L | no-blocks [2]
         7: 1[11..12]L | no-blocks [2]
         8: 1[12..13]L | no-blocks [2] | done 1 length(8)
         9: 2[0..9]L | done 2 length(4)
        ",
    );
}

#[test]
fn prefix_hits() {
    let config = SchedulerConfig::default().max_loras(2).max_model_len(32).kv(kv(16, 4, true));
    let p = prompt(1, 10);
    let trace = Trace::new(config)
        .show_blocks()
        .arrive(1, Request::new(1, p.clone(), 1))
        // Same prompt, base model: two full blocks hit.
        .arrive(3, Request::new(2, p.clone(), 1))
        // Same prompt, an adapter: nothing is shared.
        .arrive(3, Request::new(3, p.clone(), 1).adapter(lora(1)))
        // Prompt logprobs: every position is computed.
        .arrive(3, Request::new(4, p.clone(), 1).prompt_logprobs(true))
        // A prompt that is exactly the two cached blocks: the last block is recomputed.
        .arrive(5, Request::new(5, p[..8].to_vec(), 1))
        // Another tenant's salt: no hit.
        .arrive(5, Request::new(6, p.clone(), 1).cache_salt(b"tenant-b".to_vec()))
        .run(20);
    check(
        &trace,
        "
         1: 1[0..10]L[0, 1, 2] | done 1 length(1)
         2: idle
         3: 2[8..10]L[0, 1, 2] 3a1[0..10]L[3, 4, 5] 4[0..10]A[6, 7, 8] | done 2 length(1) | done 3 length(1) | done 4 length(1)
         4: idle
         5: 5[4..8]L[0, 6] 6[0..10]L[7, 8, 5] | done 5 length(1) | done 6 length(1)
        ",
    );
}

#[test]
fn max_loras_skips_without_blocking() {
    let config = SchedulerConfig::default().max_loras(1).policy(Policy::Fcfs).max_model_len(32);
    let trace = Trace::new(config)
        .arrive(1, Request::new(1, prompt(1, 2), 2).adapter(lora(1)))
        .arrive(1, Request::new(2, prompt(10, 2), 2).adapter(lora(2)))
        .arrive(1, Request::new(3, prompt(20, 2), 1).adapter(lora(1)))
        .arrive(1, Request::new(4, prompt(30, 2), 1))
        .arrive(1, Request::new(5, prompt(40, 2), 1).adapter(lora(2)))
        .arrive(2, Request::new(6, prompt(50, 2), 1).adapter(lora(1)))
        .run(20);
    check(
        &trace,
        "
         1: 1a1[0..2]L 3a1[0..2]L 4[0..2]L | skipped [2, 5] | done 3 length(1) | done 4 length(1)
         2: 1a1[2..3]L 6a1[0..2]L | skipped [2, 5] | done 1 length(2) | done 6 length(1)
         3: 2a2[0..2]L 5a2[0..2]L | done 5 length(1)
         4: 2a2[2..3]L | done 2 length(2)
        ",
    );
}

#[test]
fn aging_drains_a_slot_for_a_starved_adapter() {
    let config = SchedulerConfig::default().max_loras(1).policy(Policy::aging(2)).max_model_len(32);
    // A steady stream for adapter 1, one request per step; adapter 2 arrives at step 2.
    let mut trace = Trace::new(config).arrive(2, Request::new(100, prompt(1, 1), 2).adapter(lora(2)));
    for step in 1..=10 {
        trace = trace.arrive(step, Request::new(step, prompt(10 * step as u32, 1), 3).adapter(lora(1)));
    }
    check(
        &trace.run(30),
        "
         1: 1a1[0..1]L
         2: 1a1[1..2]L 2a1[0..1]L | skipped [100]
         3: 1a1[2..3]L 2a1[1..2]L 3a1[0..1]L | skipped [100] | done 1 length(3)
         4: 2a1[2..3]L 3a1[1..2]L 4a1[0..1]L | skipped [100] | done 2 length(3)
         5: 3a1[2..3]L 4a1[1..2]L | skipped [100, 5] | done 3 length(3)
         6: 4a1[2..3]L | skipped [100, 5, 6] | done 4 length(3)
         7: 100a2[0..1]L | skipped [5, 6, 7]
         8: 100a2[1..2]L | skipped [5, 6, 7, 8] | done 100 length(2)
         9: 5a1[0..1]L 6a1[0..1]L 7a1[0..1]L 8a1[0..1]L 9a1[0..1]L
        10: 5a1[1..2]L 6a1[1..2]L 7a1[1..2]L 8a1[1..2]L 9a1[1..2]L 10a1[0..1]L
        11: 5a1[2..3]L 6a1[2..3]L 7a1[2..3]L 8a1[2..3]L 9a1[2..3]L 10a1[1..2]L | done 5 length(3) | done 6 length(3) | done 7 length(3) | done 8 length(3) | done 9 length(3)
        12: 10a1[2..3]L | done 10 length(3)
        ",
    );
}

#[test]
fn abort_frees_everything_in_any_state() {
    let config = SchedulerConfig::default().max_num_batched_tokens(4).max_model_len(32).kv(kv(8, 4, false));
    let trace = Trace::new(config)
        .arrive(1, Request::new(1, prompt(1, 10), 3))
        .arrive(1, Request::new(2, prompt(20, 2), 3))
        .abort(2, 2)
        .abort(3, 1)
        .arrive(3, Request::new(3, prompt(40, 2), 1))
        .run(20);
    check(
        &trace,
        "
         1: 1[0..4]-
        abort 2: 0 outputs
         2: 1[4..8]-
        abort 1: 0 outputs
         3: 3[0..2]L | done 3 length(1)
        ",
    );
}

#[test]
fn prompt_logprobs_chunks_are_cut_to_the_logit_rows() {
    // Every prompt token of a prompt-logprobs request gives a row of logits: at most 4 a step.
    let config = SchedulerConfig::default()
        .max_num_batched_tokens(16)
        .max_prompt_logprob_rows(4)
        .max_model_len(64)
        .kv(kv(32, 4, true));
    let trace = Trace::new(config)
        .arrive(1, Request::new(1, prompt(1, 10), 2).prompt_logprobs(true))
        .arrive(1, Request::new(2, prompt(100, 10), 2))
        .run(20);
    check(
        &trace,
        "
         1: 1[0..4]A 2[0..10]L
         2: 1[4..8]A 2[10..11]L | done 2 length(2)
         3: 1[8..10]A
         4: 1[10..11]L | done 1 length(2)
        ",
    );
}
