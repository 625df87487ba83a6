//! Greedy rows picked on the device, counted on a machine without a GPU (feature `cuda`): the
//! engine serves the PEFT fixture's tiny model on the counting fake driver (`fakecuda/`) in a
//! child process of this test, which writes a mark into the fake's event log before each
//! workload; the parent reads what each workload's steps copied back. A greedy request's steps
//! bring back its pick alone (8 bytes: the token and its logprob); a request that needs its whole
//! row (top logprobs, a temperature) still reads the row (4 bytes a logit) and no more; side by
//! side in one step, each gets its own.
//!
//! The fake is built by `.ci/cuda-env.sh` (`MULTILORA_FAKE_CUDA`); CI requires it
//! (`MULTILORA_REQUIRE_FAKE_CUDA=1`), elsewhere the test says it skipped. The fake runs no
//! kernel: the tokens are whatever its memory held, and only the copies are checked.

#![cfg(feature = "cuda")]

#[path = "common/child.rs"]
mod child;
mod common;

use std::collections::BTreeMap;

use multilora::{DType, Device, Engine, GenerateRequest, SamplingParams};

/// The child test, run only under the fake.
const CHILD: &str = "workloads_under_the_counting_driver";
/// Where the child writes its marks (the fake's `FAKE_CUDA_LOG`).
const LOG_VAR: &str = "MULTILORA_SAMPLING_LOG";
/// The fixture model's vocabulary, and the tokens each request generates.
const VOCAB: usize = 512;
const NEW: usize = 4;

#[test]
fn greedy_rows_bring_back_their_pick_alone() {
    let Some(path) = common::fake_library_path("the device sampling count") else {
        return;
    };
    let text = child::run_child(CHILD, LOG_VAR, &path);
    let mut copies: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut at = None;
    for line in text.lines() {
        if let Some(m) = line.strip_prefix("mark ") {
            at = Some(m.to_string());
            copies.entry(m.to_string()).or_default();
        } else if let (Some(m), Some(n)) = (&at, line.strip_prefix("dtoh ")) {
            copies.get_mut(m).expect("marked").push(n.parse().expect("a size"));
        }
    }
    let row = 4 * VOCAB;
    println!("copies back per workload (bytes): {copies:?}");
    // One step of prefill and NEW - 1 of decode each.
    assert_eq!(copies["greedy"], vec![8; NEW], "a greedy request reads back its picks alone");
    assert_eq!(copies["greedy, its logprob"], vec![8; NEW], "the pick's own logprob comes with it");
    assert_eq!(copies["top logprobs"], vec![row; NEW], "top logprobs need the row");
    // The row and no more: a copy into the reader's kept page-locked buffer once moved the whole
    // buffer (16 KiB here), reading past the logits on the device.
    assert_eq!(copies["sampled"], vec![row; NEW], "a temperature needs the row");
    // Side by side (prefilled in one step, then decoded together): the greedy one's pick and the
    // sampled one's row, in each step.
    let mut mixed = copies["greedy beside sampled"].clone();
    mixed.sort_unstable();
    assert_eq!(mixed, [vec![8; NEW], vec![row; NEW]].concat(), "each request its own copy");
}

#[test]
#[ignore = "runs under the counting fake driver only, as greedy_rows_bring_back_their_pick_alone's child"]
fn workloads_under_the_counting_driver() {
    let Some(log) = std::env::var_os(LOG_VAR) else { return };
    let mark = |name: &str| child::mark(&log, name);
    let base = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/peft-tiny/base");
    let engine = Engine::builder(base)
        .served_model_name("base")
        .device(Device::Cuda(0))
        .dtype(DType::F32)
        .kv_cache_bytes(64 << 20)
        .build()
        .expect("the engine on the fake device");
    let vocab = engine.config().vocab_size;
    assert_eq!(vocab, VOCAB);
    // Greedy, then `f`'s changes.
    let params = |f: &dyn Fn(&mut SamplingParams)| {
        let mut p = SamplingParams::greedy(NEW);
        p.ignore_eos = true;
        f(&mut p);
        p
    };
    let greedy = || params(&|_| {});
    let sampled = || {
        params(&|p| {
            p.temperature = 0.8;
            p.seed = Some(1);
        })
    };
    let request = |p: SamplingParams, prompt: Vec<u32>| {
        let params = p.validate(vocab).expect("valid parameters");
        engine.submit(GenerateRequest::new("base", prompt).params(params)).expect("submitted")
    };
    let run = |name: &str, ps: Vec<SamplingParams>| {
        mark(name);
        let streams: Vec<_> = ps.into_iter().enumerate().map(|(i, p)| request(p, vec![5 + i as u32, 9, 11])).collect();
        for s in streams {
            let c = s.collect_blocking().expect("a completion");
            assert_eq!(c.token_ids.len(), NEW, "{name}");
        }
    };
    // The engine's warm-up steps run on its loop's thread, before the first request's.
    run("first", vec![greedy()]);
    run("greedy", vec![greedy()]);
    run("greedy, its logprob", vec![params(&|p| p.logprobs = Some(0))]);
    run("top logprobs", vec![params(&|p| p.logprobs = Some(2))]);
    run("sampled", vec![sampled()]);
    run("greedy beside sampled", vec![greedy(), sampled()]);
    mark("end");
}
