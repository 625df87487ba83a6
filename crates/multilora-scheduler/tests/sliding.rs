//! A model whose sliding layers have a KV pool of their own (Gemma 3): the scheduler frees their
//! blocks behind the window as requests advance, and a pool sized for windows serves contexts many
//! times its size.

use multilora_scheduler::{KvConfig, NULL_BLOCK, Request, RequestResult, Scheduler, SchedulerConfig, SlidingKv};

const WINDOW: usize = 8;
const BLOCK: usize = 4;

fn config(sliding_blocks: usize, chunk: usize) -> SchedulerConfig {
    SchedulerConfig::default().max_model_len(64).max_num_batched_tokens(chunk).min_prefill_chunk(1).kv(KvConfig {
        num_blocks: 64,
        block_size: BLOCK,
        sliding: Some(SlidingKv { window: WINDOW, num_blocks: sliding_blocks }),
        ..KvConfig::default()
    })
}

/// Sliding blocks the pool has handed out.
fn held(s: &Scheduler) -> usize {
    let pool = s.kv().sliding_pool().expect("a sliding pool");
    pool.num_blocks() - pool.num_free_blocks()
}

/// A request of three windows (a 4-token prompt, 20 tokens generated) holds at most the window
/// and one block of sliding KV before each decode step (the blocks its next query reads), and
/// every scheduled step's sliding table covers that query's window; its full table keeps every
/// block. Two such requests in a pool of 6 sliding blocks, the least that holds both windows.
#[test]
fn a_request_of_three_windows_holds_a_window_and_a_block() -> anyhow::Result<()> {
    let mut s = Scheduler::new(config(6, 4))?;
    s.add_request(Request::new(1, vec![1, 2, 3, 4], 3 * WINDOW - 4))?;
    s.add_request(Request::new(2, vec![5, 6, 7, 8], 3 * WINDOW - 4))?;
    let mut steps = 0;
    while s.has_unfinished() {
        let out = s.schedule();
        assert!(held(&s) <= 2 * (WINDOW / BLOCK + 1), "step {steps}: {} sliding blocks held", held(&s));
        for r in &out.scheduled {
            let first = (r.num_computed_tokens + 1).saturating_sub(WINDOW) / BLOCK;
            let end = (r.num_computed_tokens + r.token_ids.len()).div_ceil(BLOCK);
            assert_eq!(r.sliding_table.len(), r.block_table.len());
            assert!(r.sliding_table[..first].iter().all(|&b| b == NULL_BLOCK), "{:?}", r.sliding_table);
            assert!(r.sliding_table[first..end].iter().all(|&b| b != NULL_BLOCK), "{:?}", r.sliding_table);
            assert_eq!(r.block_table.len(), end, "the full layers keep every block");
        }
        let results: Vec<_> =
            out.scheduled.iter().filter(|r| r.sample).map(|r| RequestResult::token(r.id, 9)).collect();
        let finished = s.update(&results)?;
        assert!(finished.iter().all(|f| f.output_token_ids.len() == 3 * WINDOW - 4 && f.num_preemptions == 0));
        steps += 1;
    }
    assert_eq!(held(&s), 0, "every sliding block back");
    assert!(steps >= 3 * WINDOW - 4);
    Ok(())
}

/// A sliding pool too small for one request's window and a step's tokens is refused when the
/// scheduler is built, naming both.
#[test]
fn a_sliding_pool_smaller_than_one_window_is_refused() {
    let Err(e) = Scheduler::new(config(3, 8)) else { panic!("a sliding pool of 3 blocks was accepted") };
    let msg = e.to_string();
    assert!(msg.contains("sliding") && msg.contains("window of 8"), "{msg}");
}
