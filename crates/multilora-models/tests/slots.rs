//! The model as a `SlotSink`: writing, rewriting and clearing slots changes exactly the rows of
//! that slot, and an adapter aimed at a module without slot buffers is refused before any write.

mod common;

use anyhow::Result;
use candle_core::Device;
use common::*;
use multilora_adapter::{LoadOptions, SlotSink};
use multilora_models::{Batch, Model, ModelOptions, SeqInput};
use multilora_types::{LogitsWanted, LoraLimits, ModuleKind, SlotId};

/// On a GPU the slot writes go through the one-copy staging of `multilora_layers::stage_adapter`.
fn slots_are_written_rewritten_and_cleared_through_the_trait(dev: &Device) -> Result<()> {
    let opts = ModelOptions::default().lora(LoraLimits::slots(2)).device(dev.clone());
    let mut model = Model::load_dir(&fixture().join("base"), &opts)?;
    let load = |name: &str, m: &Model| {
        multilora_adapter::load_dir(name, &fixture().join("adapters").join(name), m.shapes(), &LoadOptions::default())
    };
    let qv = load("qv_r8", &model)?;
    let all = load("all_r16", &model)?;
    let rows = rows(false)?;
    let row = |adapter: Option<&str>| {
        rows.iter().find(|r| r.batch == "shared_prefix" && r.adapter.as_deref() == adapter).cloned().expect("row")
    };
    let run = |m: &Model, ids: &[u32], slot: Option<SlotId>| -> Result<candle_core::Tensor> {
        let mut kv = cache(m, 4, 16)?;
        let seq = SeqInput::new(ids.to_vec(), 0, vec![0], slot).with_logits(LogitsWanted::AllPrompt);
        Ok(m.forward(&Batch::new(vec![seq]), &mut kv)?)
    };
    let (base, r_qv, r_all) = (row(None), row(Some("qv_r8")), row(Some("all_r16")));
    SlotSink::write_slot(&mut model, SlotId::new(1), &qv)?;
    assert!(max_abs_diff(&run(&model, &r_qv.ids, Some(SlotId::new(1)))?, &r_qv.expected)? <= TOL);
    // Rewriting the slot with an adapter of other targets zeroes what the first one left.
    SlotSink::write_slot(&mut model, SlotId::new(1), &all)?;
    assert!(max_abs_diff(&run(&model, &r_all.ids, Some(SlotId::new(1)))?, &r_all.expected)? <= TOL);
    SlotSink::clear_slot(&mut model, SlotId::new(1))?;
    assert!(max_abs_diff(&run(&model, &base.ids, Some(SlotId::new(1)))?, &base.expected)? <= TOL);
    // No slot is the base model, bit for bit, whatever the slots hold.
    SlotSink::write_slot(&mut model, SlotId::new(0), &all)?;
    assert_eq!(max_abs_diff(&run(&model, &base.ids, None)?, &run(&model, &base.ids, Some(SlotId::new(1)))?)?, 0.0);
    let err = SlotSink::write_slot(&mut model, SlotId::new(2), &qv).unwrap_err();
    assert!(err.to_string().contains("slot"), "{err}");
    Ok(())
}
test_device!(
    slots_are_written_rewritten_and_cleared_through_the_trait,
    slots_are_written_rewritten_and_cleared_through_the_trait_cpu,
    slots_are_written_rewritten_and_cleared_through_the_trait_cuda
);

#[test]
fn adapters_beyond_the_target_modules_are_refused() -> Result<()> {
    let opts = ModelOptions::default().lora(LoraLimits::new(2, 16, &[ModuleKind::QProj])?);
    let mut model = Model::load_dir(&fixture().join("base"), &opts)?;
    let qv = multilora_adapter::load_dir(
        "qv_r8",
        &fixture().join("adapters/qv_r8"),
        model.shapes(),
        &LoadOptions::default(),
    )?;
    let err = model.write_slot(SlotId::new(0), &qv).unwrap_err();
    assert_eq!(err.kind(), "not_a_target");
    assert!(err.to_string().contains("v_proj"), "{err}");
    let err = SlotSink::write_slot(&mut model, SlotId::new(0), &qv).unwrap_err();
    assert!(err.to_string().contains("qv_r8"), "{err}");
    assert!(model.lora_slot_bytes() > 0);
    Ok(())
}
