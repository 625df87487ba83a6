//! Golden tests against the PEFT + transformers fixtures (`tests/fixtures/peft-tiny`): every row
//! in one mixed flat batch, one at a time, in other compositions, as chunked prefill + decode, and
//! greedy generation, all in f32 within 1e-4 of the reference, on the CPU and (feature `cuda`) on
//! the first GPU.

mod common;

use std::collections::BTreeMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use common::*;
use multilora_models::{Batch, SeqInput};
use multilora_types::{LogitsWanted, SlotId};

fn check(label: &str, rows: &[Row], got: &[Tensor]) -> Result<()> {
    let mut per_batch: BTreeMap<String, f32> = BTreeMap::new();
    for (r, g) in rows.iter().zip(got) {
        let d = max_abs_diff(g, &r.expected)?;
        let e = per_batch.entry(r.batch.clone()).or_default();
        *e = e.max(d);
        assert!(d <= TOL, "{label}: {} {} ({:?}): max abs diff {d}", r.batch, r.tensor, r.adapter);
    }
    println!("{label}: max abs logit error per batch: {per_batch:?}");
    Ok(())
}

fn every_row_in_one_mixed_flat_batch(dev: &Device) -> Result<()> {
    let (model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let rows = rows(true)?;
    let got = run_all_positions(&model, &slots, &rows)?;
    check("one flat batch", &rows, &got)
}

test_device!(
    every_row_in_one_mixed_flat_batch,
    every_row_in_one_mixed_flat_batch_cpu,
    every_row_in_one_mixed_flat_batch_cuda
);

fn rows_one_at_a_time_and_in_other_compositions(dev: &Device) -> Result<()> {
    let (model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let rows = rows(true)?;
    let mut got = Vec::new();
    for r in &rows {
        got.extend(run_all_positions(&model, &slots, std::slice::from_ref(r))?);
    }
    check("one at a time", &rows, &got)?;
    // Reversed, and interleaved by parity: each row's neighbours and slot segments change.
    let reversed: Vec<Row> = rows.iter().rev().cloned().collect();
    let got = run_all_positions(&model, &slots, &reversed)?;
    check("reversed", &reversed, &got)?;
    let odd_even: Vec<Row> = rows.iter().step_by(2).chain(rows.iter().skip(1).step_by(2)).cloned().collect();
    let got = run_all_positions(&model, &slots, &odd_even)?;
    check("odd/even", &odd_even, &got)
}
test_device!(
    rows_one_at_a_time_and_in_other_compositions,
    rows_one_at_a_time_and_in_other_compositions_cpu,
    rows_one_at_a_time_and_in_other_compositions_cuda
);

/// Each row's first half is prefilled in chunks of `chunk` tokens, the rest decoded one token
/// per step; every sequence advances in the same steps, so prefill and decode rows mix.
fn chunked(chunk: usize, dev: &Device) -> Result<()> {
    let (model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let rows = rows(true)?;
    let bs = 4;
    let need: usize = rows.iter().map(|r| r.ids.len().div_ceil(bs)).sum();
    let mut kv = cache(&model, need, bs)?;
    let mut blocks = Blocks::default();
    let tables: Vec<Vec<u32>> = rows.iter().map(|r| blocks.table(r.ids.len(), bs)).collect();
    let mut done = vec![0usize; rows.len()];
    let mut got: Vec<Vec<Tensor>> = vec![Vec::new(); rows.len()];
    loop {
        let mut seqs = Vec::new();
        let mut which = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            let len = r.ids.len();
            if done[i] == len {
                continue;
            }
            let step = if done[i] < len.div_ceil(2) { chunk.min(len.div_ceil(2) - done[i]) } else { 1 };
            let toks = r.ids[done[i]..done[i] + step].to_vec();
            seqs.push(
                SeqInput::new(toks, done[i], tables[i].clone(), slot_of(&slots, &r.adapter))
                    .with_logits(LogitsWanted::AllPrompt),
            );
            which.push((i, step));
        }
        if seqs.is_empty() {
            break;
        }
        let logits = model.forward(&Batch::new(seqs), &mut kv)?;
        let mut at = 0;
        for (i, step) in which {
            got[i].push(logits.narrow(0, at, step)?);
            at += step;
            done[i] += step;
        }
    }
    let got = got.iter().map(|parts| Ok(Tensor::cat(parts, 0)?)).collect::<Result<Vec<_>>>()?;
    check(&format!("prefill chunks of {chunk} + decode"), &rows, &got)
}

fn prefill_chunks_then_decode(dev: &Device) -> Result<()> {
    for chunk in [1, 3, 7] {
        chunked(chunk, dev)?;
    }
    Ok(())
}
test_device!(prefill_chunks_then_decode, prefill_chunks_then_decode_cpu, prefill_chunks_then_decode_cuda);

fn greedy_generation_reproduces_exactly(dev: &Device) -> Result<()> {
    let (model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let cases = cases()?;
    let gens: Vec<_> = ["generation", "extra_generation"].iter().flat_map(|k| list(&cases, k)).collect();
    let bs = 8;
    let mut kv = cache(&model, 256, bs)?;
    let mut blocks = Blocks::default();
    // Per case: prompt, block table, slot, new tokens.
    type Case = (Vec<u32>, Vec<u32>, Option<SlotId>, usize);
    let mut seqs: Vec<Case> = Vec::new();
    for g in &gens {
        let prompt = ids(&g["input_ids"]);
        let n = g["max_new_tokens"].as_u64().expect("fixture: a case without max_new_tokens") as usize;
        let slot = slot_of(&slots, &adapter_of(g));
        seqs.push((prompt.clone(), blocks.table(prompt.len() + n, bs), slot, n));
    }
    // All cases advance together: one mixed prefill step, then mixed decode steps.
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    let mut pending: Vec<(Vec<u32>, usize)> = seqs.iter().map(|s| (s.0.clone(), 0)).collect();
    for _ in 0..seqs.iter().map(|s| s.3).max().unwrap_or(0) {
        let batch = Batch::new(
            seqs.iter()
                .zip(&pending)
                .map(|(s, (toks, start))| SeqInput::new(toks.clone(), *start, s.1.clone(), s.2))
                .collect(),
        );
        let logits = model.forward(&batch, &mut kv)?;
        for (i, p) in pending.iter_mut().enumerate() {
            let next = argmax(&logits.get(i)?)?;
            outputs[i].push(next);
            let start = p.1 + p.0.len();
            *p = (vec![next], start);
        }
    }
    for (g, out) in gens.iter().zip(&outputs) {
        let want = ids(&g["output_ids"]);
        assert_eq!(out, &want, "greedy tokens of {:?} on {:?}", g["adapter"], g["prompt"]);
    }
    Ok(())
}
test_device!(
    greedy_generation_reproduces_exactly,
    greedy_generation_reproduces_exactly_cpu,
    greedy_generation_reproduces_exactly_cuda
);

/// The fixture's rows prefilled, then decode steps of every row at
/// once (the rows' slots interleaved, a few rows without logits), in a rayon pool of `threads`:
/// each decode step's logits.
fn decode_steps_in_a_pool_of(threads: usize) -> Result<Vec<Tensor>> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    pool.install(|| {
        let (model, slots) = model_with_adapters(DType::F32)?;
        let rows = rows(true)?;
        let bs = 4;
        let need: usize = rows.iter().map(|r| (r.ids.len() + 4).div_ceil(bs)).sum();
        let mut kv = cache(&model, need, bs)?;
        let mut blocks = Blocks::default();
        let tables: Vec<Vec<u32>> = rows.iter().map(|r| blocks.table(r.ids.len() + 4, bs)).collect();
        let prompts: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
        let prefill = rows
            .iter()
            .zip(&tables)
            .map(|(r, t)| SeqInput::new(r.ids.clone(), 0, t.clone(), slot_of(&slots, &r.adapter)));
        let first = model.forward(&Batch::new(prefill.collect()), &mut kv)?;
        let mut steps = Vec::new();
        let mut next: Vec<u32> = (0..rows.len()).map(|i| argmax(&first.get(i)?)).collect::<Result<_>>()?;
        for step in 0..4 {
            let seqs = rows.iter().enumerate().map(|(i, r)| {
                let s = SeqInput::new(
                    vec![next[i]],
                    prompts[i].len() + step,
                    tables[i].clone(),
                    slot_of(&slots, &r.adapter),
                );
                if (i + step) % 5 == 0 { s.with_logits(LogitsWanted::None) } else { s }
            });
            let batch = Batch::new(seqs.collect());
            assert_eq!(model.row_groups(&batch), threads.min(2), "{threads} threads");
            let logits = model.forward(&batch, &mut kv)?;
            let mut at = 0;
            for (i, s) in batch.seqs.iter().enumerate() {
                if s.num_logit_rows() > 0 {
                    next[i] = argmax(&logits.get(at)?)?;
                    at += 1;
                }
            }
            steps.push(logits);
        }
        // A refused sequence of a step cut into row groups (planned in group order) is named by
        // its place in the batch, whichever it is.
        for bad in 0..rows.len() {
            let seqs = rows.iter().enumerate().map(|(i, r)| {
                let token = if i == bad { u32::MAX } else { next[i] };
                SeqInput::new(vec![token], prompts[i].len() + 3, tables[i].clone(), slot_of(&slots, &r.adapter))
            });
            let batch = Batch::new(seqs.collect());
            match model.forward(&batch, &mut kv) {
                Err(multilora_models::Error::InvalidBatch { seq, .. }) => assert_eq!(seq, bad, "{threads} threads"),
                other => panic!("sequence {bad}'s token out of the vocabulary: {other:?}"),
            }
        }
        Ok(steps)
    })
}

/// A decode step of enough rows runs as the row groups the pool cuts it into, side by side (each
/// thread a group's rows through every layer, `Model::forward`): on pools of 2, 3 and 4 threads
/// two groups, whose logits are, bit for bit, those of the same steps on one thread (one group),
/// rows in the batch's order.
#[test]
fn row_groups_side_by_side_give_the_bits_of_one_group() -> Result<()> {
    assert!(rows(true)?.len() >= 8, "the fixture has too few rows for two groups");
    let one = decode_steps_in_a_pool_of(1)?;
    for threads in [2, 3, 4] {
        let other = decode_steps_in_a_pool_of(threads)?;
        for (step, (a, b)) in one.iter().zip(&other).enumerate() {
            assert_eq!(a.dims(), b.dims(), "step {step}, {threads} threads");
            let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "step {step}: two row groups on {threads} threads against one group differ");
        }
    }
    Ok(())
}
