//! One `schedule()` + `update()` step at vLLM-default budgets with 4,096 waiting requests.
//!
//! `max_num_seqs` 256, `max_num_batched_tokens` 8192, `max_loras` 8; 4,096 waiting requests over
//! 64 adapters (16-token prompts). `full`: 256 running requests, so the waiting queue is not
//! scanned. `scan`: 128 running requests over 8 adapters, so the scan skips the 7 in 8 waiting
//! requests whose adapter is not running and admits 128 prefills.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use multilora_scheduler::{
    KvConfig, Request, RequestResult, Scheduler, SchedulerConfig, SchedulerOutput, sim::adapter_gen,
};

const PROMPT: u32 = 16;

fn prompt(id: u64) -> Vec<u32> {
    (0..PROMPT).map(|k| (id as u32).wrapping_mul(31) + k + 2).collect()
}

fn step(s: &mut Scheduler) -> SchedulerOutput {
    let out = s.schedule();
    let mut results = Vec::with_capacity(out.scheduled.len());
    results.extend(out.scheduled.iter().filter(|r| r.sample).map(|r| RequestResult::token(r.id, 7)));
    let finished = s.update(&results).expect("update");
    assert!(finished.is_empty());
    out
}

fn state(running: u64) -> Scheduler {
    let config = SchedulerConfig::default()
        .max_num_seqs(256)
        .max_num_batched_tokens(8192)
        .max_loras(8)
        .max_model_len(4096)
        .kv(KvConfig { num_blocks: 16_384, ..KvConfig::default() });
    let mut s = Scheduler::new(config).expect("config");
    for id in 0..running {
        let request = Request::new(id, prompt(id), 1000).adapter(adapter_gen((id % 8) as usize));
        s.add_request(request).expect("request");
    }
    let out = step(&mut s);
    assert_eq!(out.scheduled.len(), running as usize);
    for i in 0..4096u64 {
        let id = 1_000_000 + i;
        let request = Request::new(id, prompt(id), 1000).adapter(adapter_gen((i % 64) as usize));
        s.add_request(request).expect("request");
    }
    s
}

/// Runs `iters` measured steps on a long-lived scheduler, as an engine loop does. Untimed between
/// steps: in `scan`, the requests admitted by the step are aborted and queued again at the back,
/// so every measured step starts from 128 running and 4,096 waiting (and after a few steps the
/// scan crosses the whole queue: the skipped requests gather at its front). Every 32 steps the
/// state is rebuilt, before aging would change the picture (its default bound is 32 skips).
fn measure(running: u64, iters: u64) -> Duration {
    let mut s = state(running);
    let mut next_id = 10_000_000u64;
    let mut steps = 0;
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        if steps == 32 {
            s = state(running);
            steps = 0;
        }
        let t = Instant::now();
        let out = step(&mut s);
        total += t.elapsed();
        black_box(&out);
        steps += 1;
        for r in out.scheduled.iter().skip(running as usize) {
            s.abort(r.id);
            let request = Request::new(next_id, prompt(next_id), 1000).adapter(r.adapter.expect("adapter requests"));
            s.add_request(request).expect("request");
            next_id += 1;
        }
    }
    total
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_scheduler_step");
    for (name, running, admitted) in [("full_256_running", 256, 0), ("scan_128_running", 128, 128)] {
        // The step being measured, checked once.
        let out = step(&mut state(running));
        assert_eq!(out.scheduled.len(), running as usize + admitted);
        group.bench_function(name, |b| b.iter_custom(|iters| measure(running, iters)));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
