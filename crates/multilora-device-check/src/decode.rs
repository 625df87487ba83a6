//! `decode`: the decode step of a random Llama-3-8B-shaped model in bf16 with 8 rank-16 adapters
//! on all seven projections, at batch 1, 16 and 64 (context 512): base rows and LoRA rows, each
//! step's device time (CUDA events over back-to-back steps) against its floor (the weights, the
//! contexts' keys and values and the used adapters read once at the device's bandwidth), beside the host's time
//! per step; and LoRA against base at batch 64 (a speed target: ≤ 1.10).

use anyhow::Result;
use candle_core::{DType, Device};
use multilora_models::{Batch, KvCacheConfig, Model, ModelOptions, SeqInput};
use multilora_types::{LoraLimits, ModuleKind, SlotId};

use crate::clock::events;
use crate::floor::{DECODE, decode_step_bytes};
use crate::llama8b;
use crate::report::Report;

pub(crate) fn decode(report: &mut Report, dev: &Device, quick: bool) -> Result<()> {
    const SECTION: &str = "decode";
    let (adapters, rank, ctx, bs) = (DECODE.adapters, DECODE.rank, 512, 16);
    let cfg = llama8b::config(if quick { 4 } else { 32 })?;
    let dtype = DType::BF16;
    let opts = ModelOptions::default().dtype(dtype).device(dev.clone()).lora(LoraLimits::new(
        adapters,
        rank,
        &ModuleKind::PROJECTIONS,
    )?);
    let mut model = Model::from_tensors(cfg.clone(), llama8b::random_weights(&cfg, dtype, dev)?, &opts)?;
    for k in 0..adapters {
        model.write_slot(SlotId::new(k), &llama8b::random_adapter(&cfg, k, rank, dtype, dev)?)?;
    }
    report.info(
        SECTION,
        "model",
        format!("Llama-3-8B shapes, {} layers, bf16, {adapters} rank-{rank} adapters, context {ctx}", cfg.num_layers),
    );
    let blocks_per_seq = ctx / bs;
    let mut kv = model.new_kv_cache(KvCacheConfig::new(64 * blocks_per_seq, bs))?;
    let mut ratio_64 = f64::NAN;
    for batch in [1usize, 16, 64] {
        let seqs = |lora: bool| -> Batch {
            Batch::new(
                (0..batch)
                    .map(|i| {
                        let table: Vec<u32> = (0..blocks_per_seq).map(|b| (i * blocks_per_seq + b) as u32).collect();
                        let slot = lora.then(|| SlotId::new(i % adapters));
                        SeqInput::new(vec![100 + i as u32], ctx - 1, table, slot)
                    })
                    .collect(),
            )
        };
        let (base, lora) = (seqs(false), seqs(true));
        let t_base = events(dev, 20, || {
            model.forward(&base, &mut kv)?;
            Ok(())
        })?;
        let t_lora = events(dev, 20, || {
            model.forward(&lora, &mut kv)?;
            Ok(())
        })?;
        let layers = cfg.num_layers;
        let base_v = report.timed(
            SECTION,
            format!("batch {batch} base step"),
            &t_base,
            decode_step_bytes(layers, batch, ctx, None),
        );
        let lora_v = report.timed(
            SECTION,
            format!("batch {batch} LoRA step"),
            &t_lora,
            decode_step_bytes(layers, batch, ctx, Some(DECODE)),
        );
        let ratio = t_lora.device / t_base.device;
        if batch == 64 {
            ratio_64 = ratio;
        }
        report.info(SECTION, format!("batch {batch} lora/base"), format!("{ratio:.3}"));
        if batch != 16 {
            report.key(SECTION, format!("b{batch} base {base_v}"));
            report.key(SECTION, format!("b{batch} LoRA {lora_v}; lora/base {ratio:.3}"));
        }
    }
    report.target(SECTION, "lora/base at batch 64", format!("{ratio_64:.3}"), "≤ 1.10", ratio_64 <= 1.10);
    Ok(())
}
