//! The public API's contracts: typed rejections, finishes, update errors, abort and counts.

mod common;

use common::lora;
use multilora_scheduler::{Error, KvConfig, Policy, Request, RequestResult, Scheduler, SchedulerConfig};
use multilora_types::{AdapterGen, FinishReason, LogitsWanted};

fn small() -> SchedulerConfig {
    SchedulerConfig::default().max_loras(2).max_model_len(16).kv(KvConfig {
        num_blocks: 16,
        block_size: 4,
        ..KvConfig::default()
    })
}

/// Runs steps with every sampling request getting `token` until `id` finishes.
fn run_until_finished(s: &mut Scheduler, token: u32) -> Vec<multilora_scheduler::FinishedRequest> {
    let mut all = Vec::new();
    for _ in 0..100 {
        if !s.has_unfinished() {
            break;
        }
        let out = s.schedule();
        let results: Vec<_> =
            out.scheduled.iter().filter(|r| r.sample).map(|r| RequestResult::token(r.id, token)).collect();
        all.extend(s.update(&results).unwrap());
    }
    all
}

#[test]
fn bad_requests_get_typed_rejections_and_nothing_sticks() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small())?;
    let cases = [
        (Request::new(1, vec![], 4), "empty_prompt"),
        (Request::new(2, vec![1, 2], 0), "zero_max_tokens"),
        (Request::new(3, (0..16).collect(), 4), "prompt_too_long"),
        (Request::new(4, vec![1], 4), "ok"),
        (Request::new(4, vec![1], 4), "duplicate_request"),
    ];
    for (request, kind) in cases {
        match s.add_request(request) {
            Ok(()) => assert_eq!(kind, "ok"),
            Err(e) => assert_eq!(e.kind(), kind, "{e}"),
        }
    }
    // A prompt of max_model_len - 1 tokens leaves room for exactly one new token.
    s.add_request(Request::new(5, (0..15).collect(), 4))?;
    let finished = run_until_finished(&mut s, 7);
    let mut summary: Vec<_> = finished.iter().map(|f| (f.id, f.reason, f.output_token_ids.len())).collect();
    summary.sort_by_key(|s| s.0);
    assert_eq!(summary, vec![(4, FinishReason::Length, 4), (5, FinishReason::Length, 1)]);

    let mut off = Scheduler::new(small().max_loras(0))?;
    let e = off.add_request(Request::new(1, vec![1], 1).adapter(lora(1))).unwrap_err();
    assert_eq!(e, Error::LoraDisabled { id: 1 });
    assert_eq!(e.to_string(), "request 1: names an adapter but lora is disabled (max_loras is 0)");
    assert!(!off.has_unfinished());
    Ok(())
}

#[test]
fn stop_tokens_max_model_len_and_engine_finishes() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small())?;
    s.add_request(Request::new(1, vec![1, 2], 10).stop_token_ids(vec![9]))?;
    s.add_request(Request::new(2, (0..13).collect(), 100))?;
    s.add_request(Request::new(3, vec![5], 100))?;
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 3);
    let finished = s.update(&[
        RequestResult::token(1, 4),
        RequestResult::token(2, 4),
        // A stop string the engine detected.
        RequestResult { id: 3, token: Some(4), forced: Vec::new(), finish: Some(FinishReason::Stop) },
    ])?;
    assert_eq!(finished.len(), 1);
    assert_eq!((finished[0].id, finished[0].reason), (3, FinishReason::Stop));
    assert_eq!(finished[0].output_token_ids, vec![4]);

    s.schedule();
    let finished = s.update(&[RequestResult::token(1, 9), RequestResult::token(2, 4)])?;
    let reasons: Vec<_> = finished.iter().map(|f| (f.id, f.reason)).collect();
    assert_eq!(reasons, vec![(1, FinishReason::Stop)]);
    assert_eq!(finished[0].output_token_ids, vec![4, 9], "the stop token is kept");

    // Request 2 reaches max_model_len (16) after 3 tokens.
    s.schedule();
    let finished = s.update(&[RequestResult::token(2, 4)])?;
    assert_eq!(finished[0].reason, FinishReason::Length);
    assert_eq!(finished[0].output_token_ids.len(), 3);
    assert_eq!(s.kv().num_free_blocks(), 16);
    Ok(())
}

#[test]
fn update_rejects_unexpected_tokens_and_retires_silent_requests() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small().max_num_batched_tokens(4))?;
    s.add_request(Request::new(1, (0..6).collect(), 5))?;
    s.add_request(Request::new(2, vec![1], 5))?;
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 1);
    assert!(!out.scheduled[0].sample);
    // A token for a prefill chunk that does not end the prompt: rejected, nothing applied.
    let e = s.update(&[RequestResult::token(1, 3)]).unwrap_err();
    assert_eq!(e.kind(), "unexpected_token");
    // Unknown ids are ignored; the chunk is committed.
    assert!(s.update(&[RequestResult::token(99, 3)])?.is_empty());

    let out = s.schedule();
    let ids: Vec<_> = out.scheduled.iter().map(|r| (r.id, r.sample)).collect();
    assert_eq!(ids, vec![(1, true), (2, true)]);
    // The engine failed request 1 and said nothing about request 2.
    let finished = s.update(&[RequestResult::finished(1, FinishReason::Error)])?;
    let reasons: Vec<_> = finished.iter().map(|f| (f.id, f.reason)).collect();
    assert_eq!(reasons, vec![(1, FinishReason::Error), (2, FinishReason::Error)]);
    assert!(!s.has_unfinished());
    assert_eq!(s.kv().num_free_blocks(), 16);
    Ok(())
}

#[test]
fn engine_can_finish_a_waiting_request_and_abort_is_idempotent() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small().max_loras(1))?;
    s.add_request(Request::new(1, vec![1], 5).adapter(lora(1)))?;
    s.add_request(Request::new(2, vec![1], 5).adapter(lora(2)))?;
    let out = s.schedule();
    assert_eq!(out.skipped_for_adapter_limit, vec![2]);
    let finished = s.update(&[RequestResult::token(1, 3), RequestResult::finished(2, FinishReason::Aborted)])?;
    assert_eq!(finished.len(), 1);
    assert_eq!((finished[0].id, finished[0].reason), (2, FinishReason::Aborted));
    let aborted = s.abort(1).expect("live");
    assert_eq!(aborted.output_token_ids, vec![3]);
    assert!(s.abort(1).is_none());
    assert_eq!(s.counts().running, 0);
    assert_eq!(s.kv().num_free_blocks(), 16);
    Ok(())
}

#[test]
fn counts_and_reloaded_generations() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small().max_loras(1).policy(Policy::Fcfs))?;
    let old = lora(1);
    let reloaded = AdapterGen::new(old.id, multilora_types::Fingerprint([0xee; 32]));
    s.add_request(Request::new(1, vec![1], 5).adapter(old))?;
    s.add_request(Request::new(2, vec![1], 5).adapter(reloaded))?;
    s.add_request(Request::new(3, vec![1], 5))?;
    let out = s.schedule();
    assert_eq!(out.skipped_for_adapter_limit, vec![2], "a reload in place is a second adapter");
    assert_eq!(out.active_adapters, vec![old]);
    let counts = s.counts();
    assert_eq!((counts.running, counts.waiting, counts.deferred), (2, 1, 1));
    assert_eq!(counts.running_adapters, vec![old]);
    assert_eq!(counts.waiting_adapters, vec![reloaded]);
    assert_eq!(counts.kv.num_blocks, 16);
    assert_eq!(s.running_adapters(), vec![old]);
    Ok(())
}

#[test]
fn prompt_logprobs_want_every_prompt_position_in_every_chunk() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small().max_num_batched_tokens(4))?;
    s.add_request(Request::new(1, (0..6).collect(), 2).prompt_logprobs(true))?;
    let mut seen = Vec::new();
    for _ in 0..5 {
        let out = s.schedule();
        let mut results = Vec::new();
        for r in &out.scheduled {
            assert!(r.block_table.len() * 4 >= r.num_computed_tokens + r.token_ids.len());
            assert_eq!(r.num_prompt_tokens, 6);
            seen.push((r.num_computed_tokens, r.token_ids.len(), r.logits, r.sample));
            if r.sample {
                results.push(RequestResult::token(r.id, 3));
            }
        }
        s.update(&results)?;
    }
    assert_eq!(
        seen,
        vec![
            (0, 4, LogitsWanted::AllPrompt, false),
            (4, 2, LogitsWanted::AllPrompt, true),
            (6, 1, LogitsWanted::Last, true),
        ]
    );
    Ok(())
}

#[test]
fn a_preempted_request_keeps_its_outputs_and_recomputes_them() -> anyhow::Result<()> {
    let config =
        small().kv(KvConfig { num_blocks: 4, block_size: 4, enable_prefix_caching: false, ..KvConfig::default() });
    let mut s = Scheduler::new(config)?;
    s.add_request(Request::new(1, (0..6).collect(), 8))?;
    s.add_request(Request::new(2, (10..16).collect(), 4))?;
    let finished = run_until_finished(&mut s, 7);
    let by_id: Vec<_> = finished.iter().map(|f| (f.id, f.output_token_ids.len(), f.num_preemptions)).collect();
    assert_eq!(by_id, vec![(1, 8, 0), (2, 4, 1)]);
    assert_eq!(s.kv().num_free_blocks(), 4);
    Ok(())
}

#[test]
fn blocks_filled_by_decodes_are_cached_too() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small())?;
    s.add_request(Request::new(1, vec![1, 2, 3], 4))?;
    // Step 1 computes the prompt (3 tokens), step 2 the first output: the first block is full.
    for _ in 0..2 {
        let out = s.schedule();
        s.update(&[RequestResult::token(out.scheduled[0].id, 9)])?;
    }
    s.add_request(Request::new(2, vec![1, 2, 3, 9, 5, 6], 1))?;
    let out = s.schedule();
    let second = out.scheduled.iter().find(|r| r.id == 2).expect("admitted");
    assert_eq!(second.num_computed_tokens, 4, "the block completed by a decode is a hit");
    assert_eq!(second.token_ids, vec![5, 6]);
    Ok(())
}

/// Tokens a result forces after its sampled one are appended together and computed as one chunk
/// in the next step, whose last position samples; they count toward `max_tokens`.
#[test]
fn forced_tokens_come_in_one_chunk_and_count() -> anyhow::Result<()> {
    let mut s = Scheduler::new(small())?;
    s.add_request(Request::new(1, vec![1, 2, 3], 6))?;
    let out = s.schedule();
    assert_eq!(out.scheduled[0].token_ids, vec![1, 2, 3]);
    s.update(&[RequestResult { id: 1, token: Some(4), forced: vec![5, 6, 7], finish: None }])?;
    let out = s.schedule();
    let chunk = &out.scheduled[0];
    assert_eq!((chunk.token_ids.clone(), chunk.num_computed_tokens, chunk.sample), (vec![4, 5, 6, 7], 3, true));
    assert_eq!(chunk.logits, LogitsWanted::Last);
    // Four of six generated: two more, then `length`.
    s.update(&[RequestResult::token(1, 8)])?;
    s.schedule();
    let finished = s.update(&[RequestResult::token(1, 9)])?;
    assert_eq!(
        (finished[0].reason, finished[0].output_token_ids.clone()),
        (FinishReason::Length, vec![4, 5, 6, 7, 8, 9])
    );
    Ok(())
}
