//! Prefix reuse at the model level: a second sequence that shares the first one's full KV blocks
//! computes only its tail, and its logits equal a cold run (and the PEFT reference).

mod common;

use anyhow::Result;
use candle_core::{DType, Device};
use common::*;
use multilora_models::{Batch, SeqInput};
use multilora_types::LogitsWanted;

fn reused_full_blocks_give_the_cold_logits(dev: &Device) -> Result<()> {
    let (model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let rows = rows(false)?;
    // shared_prefix rows 7 and 8: all_r16 on 16 and 23 tokens sharing their first 11.
    let find = |t: &str| rows.iter().find(|r| r.batch == "shared_prefix" && r.tensor == t).cloned();
    let (first, second) = (find("row_7").expect("row_7"), find("row_8").expect("row_8"));
    let shared = first.ids.iter().zip(&second.ids).take_while(|(a, b)| a == b).count();
    assert_eq!(shared, 11);
    let bs = 4;
    let full = shared / bs; // two full blocks (8 tokens) can be shared
    let slot = slot_of(&slots, &first.adapter);
    let mut kv = cache(&model, 32, bs)?;
    let mut blocks = Blocks::default();
    let t1 = blocks.table(first.ids.len(), bs);
    let cold1 = model.forward(
        &Batch::new(vec![SeqInput::new(first.ids.clone(), 0, t1.clone(), slot).with_logits(LogitsWanted::AllPrompt)]),
        &mut kv,
    )?;
    assert!(max_abs_diff(&cold1, &first.expected)? <= TOL);
    // The second sequence: the first's full blocks, then fresh ones for its tail.
    let start = full * bs;
    let mut t2 = t1[..full].to_vec();
    t2.extend(blocks.table(second.ids.len() - start, bs));
    let warm = model.forward(
        &Batch::new(vec![
            SeqInput::new(second.ids[start..].to_vec(), start, t2, slot).with_logits(LogitsWanted::AllPrompt),
        ]),
        &mut kv,
    )?;
    // Cold run of the second sequence in its own blocks.
    let t3 = blocks.table(second.ids.len(), bs);
    let cold2 = model.forward(
        &Batch::new(vec![SeqInput::new(second.ids.clone(), 0, t3, slot).with_logits(LogitsWanted::AllPrompt)]),
        &mut kv,
    )?;
    let tail = second.ids.len() - start;
    let d_cold = max_abs_diff(&warm, &cold2.narrow(0, start, tail)?)?;
    let d_ref = max_abs_diff(&warm, &second.expected.narrow(0, start, tail)?)?;
    println!("prefix reuse: warm vs cold {d_cold}, warm vs PEFT {d_ref}");
    assert!(d_cold <= TOL && d_ref <= TOL, "warm vs cold {d_cold}, vs reference {d_ref}");
    // The blocks of the first sequence are untouched: it still decodes as before.
    let again = model.forward(&Batch::new(vec![SeqInput::new(vec![first.ids[15]], 15, t1, slot)]), &mut kv)?;
    assert!(max_abs_diff(&again, &first.expected.narrow(0, 15, 1)?)? <= TOL);
    Ok(())
}
test_device!(
    reused_full_blocks_give_the_cold_logits,
    reused_full_blocks_give_the_cold_logits_cpu,
    reused_full_blocks_give_the_cold_logits_cuda
);

fn skipped_chunks_fill_the_cache_without_logits(dev: &Device) -> Result<()> {
    let (model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let row = rows(false)?.into_iter().find(|r| r.batch == "mixed_all" && r.tensor == "row_2").expect("row");
    let slot = slot_of(&slots, &row.adapter);
    let mut kv = cache(&model, 8, 4)?;
    let table: Vec<u32> = (0..5).collect();
    let n = row.ids.len();
    // A non-final chunk wants no logits; the final one only its last row.
    let none = model.forward(
        &Batch::new(vec![
            SeqInput::new(row.ids[..10].to_vec(), 0, table.clone(), slot).with_logits(LogitsWanted::None),
        ]),
        &mut kv,
    )?;
    assert_eq!(none.dims(), &[0, 512]);
    let last = model.forward(&Batch::new(vec![SeqInput::new(row.ids[10..].to_vec(), 10, table, slot)]), &mut kv)?;
    assert_eq!(last.dims(), &[1, 512]);
    assert!(max_abs_diff(&last, &row.expected.narrow(0, n - 1, 1)?)? <= TOL);
    Ok(())
}
test_device!(
    skipped_chunks_fill_the_cache_without_logits,
    skipped_chunks_fill_the_cache_without_logits_cpu,
    skipped_chunks_fill_the_cache_without_logits_cuda
);
