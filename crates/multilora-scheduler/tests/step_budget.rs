//! Traces under a step-time budget: a burst of prompts arriving while streams decode is split
//! into prefill chunks that keep each step within the budget; decode rows are in every step;
//! every admitted prompt advances every step; outputs are the same tokens as without a budget.
//!
//! Each line ends with the step's time by the cost model (decode rows at `fixed + rows · row`,
//! prefill tokens at `token` each) and, when the budget applied, the prefill tokens it allowed.

mod common;

use common::{Trace, check};
use multilora_scheduler::{KvConfig, Request, SchedulerConfig, StepCost};
use multilora_types::StepTime;

/// 10 ms a step, 1 ms a decode row, 0.5 ms a prefill token.
const COST: StepCost = StepCost { fixed_s: 0.010, per_decode_row_s: 0.001, per_prefill_token_s: 0.0005 };

fn config(step_time: StepTime) -> SchedulerConfig {
    SchedulerConfig::default().max_model_len(256).min_prefill_chunk(4).step_time(step_time).kv(KvConfig {
        num_blocks: 64,
        block_size: 16,
        ..KvConfig::default()
    })
}

fn prompt(from: u32, len: u32) -> Vec<u32> {
    (from..from + len).collect()
}

/// Two streams decode; three 40-token prompts arrive at step 3. With a 30 ms budget, each step
/// carries the decode rows (12 ms for two) and what is left in prompt tokens (36 at 0.5 ms): the
/// burst is cut into chunks, the running prefill continues first, a prompt whose last token is
/// computed decodes from the next step on, and no step goes over 30 ms.
#[test]
fn a_burst_is_split_within_the_budget() {
    let trace = Trace::new(config(StepTime::Max { seconds: 0.030 }))
        .cost(COST)
        .arrive(1, Request::new(1, prompt(1, 4), 12))
        .arrive(1, Request::new(2, prompt(10, 4), 12))
        .arrive(3, Request::new(3, prompt(100, 40), 2))
        .arrive(3, Request::new(4, prompt(200, 40), 2))
        .arrive(3, Request::new(5, prompt(300, 40), 2))
        .run(40);
    check(
        &trace,
        "
         1: 1[0..4]L 2[0..4]L | 14 ms
         2: 1[4..5]L 2[4..5]L | 12 ms (prefill budget 36)
         3: 1[5..6]L 2[5..6]L 3[0..36]- | 30 ms (prefill budget 36)
         4: 1[6..7]L 2[6..7]L 3[36..40]L 4[0..32]- | 30 ms (prefill budget 36)
         5: 1[7..8]L 2[7..8]L 3[40..41]L 4[32..40]L 5[0..25]- | 30 ms (prefill budget 33) | done 3 length(2)
         6: 1[8..9]L 2[8..9]L 4[40..41]L 5[25..40]L | 20 ms (prefill budget 33) | done 4 length(2)
         7: 1[9..10]L 2[9..10]L 5[40..41]L | 13 ms (prefill budget 33) | done 5 length(2)
         8: 1[10..11]L 2[10..11]L | 12 ms (prefill budget 36)
         9: 1[11..12]L 2[11..12]L | 12 ms (prefill budget 36)
        10: 1[12..13]L 2[12..13]L | 12 ms (prefill budget 36)
        11: 1[13..14]L 2[13..14]L | 12 ms (prefill budget 36)
        12: 1[14..15]L 2[14..15]L | 12 ms (prefill budget 36) | done 1 length(12) | done 2 length(12)
        ",
    );
}

/// The same burst with no budget: one 120-token step of 74 ms stalls both streams.
#[test]
fn without_a_budget_the_burst_takes_one_step() {
    let trace = Trace::new(config(StepTime::Unbounded))
        .cost(COST)
        .arrive(1, Request::new(1, prompt(1, 4), 3))
        .arrive(1, Request::new(2, prompt(10, 4), 3))
        .arrive(2, Request::new(3, prompt(100, 40), 1))
        .arrive(2, Request::new(4, prompt(200, 40), 1))
        .arrive(2, Request::new(5, prompt(300, 40), 1))
        .run(40);
    check(
        &trace,
        "
         1: 1[0..4]L 2[0..4]L | 14 ms
         2: 1[4..5]L 2[4..5]L 3[0..40]L 4[0..40]L 5[0..40]L | 72 ms | done 3 length(1) | done 4 length(1) | done 5 length(1)
         3: 1[5..6]L 2[5..6]L | 12 ms | done 1 length(3) | done 2 length(3)
        ",
    );
}

/// `auto`: a step may take 2.5 decode-only steps (here 27.5 ms next to one decode row: 32
/// prompt tokens), under a token cap of 24: the first prompt takes what the cap leaves, then
/// continues before the second is admitted.
#[test]
fn auto_budget_and_every_running_prefill_advances() {
    let trace = Trace::new(config(StepTime::Auto { factor: 2.5 }).max_num_batched_tokens(24))
        .cost(COST)
        .arrive(1, Request::new(1, prompt(1, 2), 6))
        .arrive(2, Request::new(2, prompt(100, 30), 1))
        .arrive(2, Request::new(3, prompt(200, 30), 1))
        .run(40);
    check(
        &trace,
        "
         1: 1[0..2]L | 11 ms
         2: 1[2..3]L 2[0..23]- | 22 ms (prefill budget 32)
         3: 1[3..4]L 2[23..30]L 3[0..16]- | 22 ms (prefill budget 32) | done 2 length(1)
         4: 1[4..5]L 3[16..30]L | 18 ms (prefill budget 32) | done 3 length(1)
         5: 1[5..6]L | 11 ms (prefill budget 32)
         6: 1[6..7]L | 11 ms (prefill budget 32) | done 1 length(6)
        ",
    );
}

/// A budget that leaves room for 4 prompt tokens a step next to the decode row: prompts still
/// advance every step, a running one first, the next admitted with what it leaves, and every
/// step stays within 13 ms.
#[test]
fn a_tight_budget_still_moves_every_prompt() {
    let trace = Trace::new(config(StepTime::Max { seconds: 0.013 }))
        .cost(COST)
        .arrive(1, Request::new(1, prompt(1, 2), 8))
        .arrive(2, Request::new(2, prompt(100, 6), 1))
        .arrive(3, Request::new(3, prompt(200, 9), 1))
        .run(40);
    check(
        &trace,
        "
         1: 1[0..2]L | 11 ms
         2: 1[2..3]L 2[0..4]- | 13 ms (prefill budget 4)
         3: 1[3..4]L 2[4..6]L 3[0..2]- | 13 ms (prefill budget 4) | done 2 length(1)
         4: 1[4..5]L 3[2..6]- | 13 ms (prefill budget 4)
         5: 1[5..6]L 3[6..9]L | 12 ms (prefill budget 4) | done 3 length(1)
         6: 1[6..7]L | 11 ms (prefill budget 4)
         7: 1[7..8]L | 11 ms (prefill budget 4)
         8: 1[8..9]L | 11 ms (prefill budget 4) | done 1 length(8)
        ",
    );
}
