//! The layers: base rows bit for bit, LoRA == merged weight, fused qkv, embedding, slot writes.

use candle_core::{DType, Device, IndexOp, Tensor};
use multilora_adapter::{LoraAdapter, ModuleId};
use multilora_types::ModuleKind;

use super::{Rng, adapter, bits, rel_err, slot_map, test_device};
use crate::{LoraEmbedding, LoraLinear, LoraMapping, SlotConfig};

fn q() -> ModuleId {
    ModuleId::layer(0, ModuleKind::QProj)
}

/// `x · (W + B·A)ᵀ` for one row, from the adapter's own tensors: the merged-weight reference.
fn merged_row(x: &Tensor, w: &Tensor, a: &LoraAdapter, id: ModuleId) -> anyhow::Result<Tensor> {
    let w = w.to_dtype(DType::F64)?;
    let w = match a.module(&id) {
        Some(m) => (w + m.b()?.to_dtype(DType::F64)?.matmul(&m.a.to_dtype(DType::F64)?)?.to_device(x.device())?)?,
        None => w,
    };
    Ok(x.to_dtype(DType::F64)?.matmul(&w.t()?)?)
}

/// The seed's example: six tokens, slots [2, 0, -1, 2, 3, 0].
fn seed_example(dev: &Device) -> anyhow::Result<()> {
    let (inp, out) = (48, 40);
    let mut rng = Rng::new(11);
    let w = rng.tensor(&[out, inp], 0.2, DType::F32, dev)?;
    let cfg = SlotConfig::new(4, 16, DType::F32, dev);
    let mut layer = LoraLinear::new(w.clone(), None, vec![(q(), out)], Some(&cfg))?;
    let adapters: Vec<LoraAdapter> = [(0, 8), (2, 16), (3, 4)]
        .iter()
        .map(|&(slot, rank)| adapter(&format!("a{slot}"), &[(q(), rank, inp, out)], slot as u64 + 1))
        .collect::<anyhow::Result<_>>()?;
    for (slot, a) in [0, 2, 3].into_iter().zip(&adapters) {
        layer.write_slot(slot, a)?;
    }
    let slots = [2, 0, -1, 2, 3, 0];
    let mapping = slot_map(&slots, 4, dev)?;
    let segs: Vec<(usize, usize)> = mapping.lora_segments().map(|s| (s.slot.index(), s.len)).collect();
    assert_eq!(mapping.num_base_rows(), 1);
    assert_eq!(segs, vec![(0, 2), (2, 2), (3, 1)]);

    let x = rng.tensor(&[6, inp], 1.0, DType::F32, dev)?;
    let y = layer.forward(&x, &mapping)?;
    for (row, &slot) in slots.iter().enumerate() {
        let xr = x.i(row..row + 1)?;
        let want = match slot {
            -1 => xr.matmul(&w.t()?)?,
            s => merged_row(&xr, &w, &adapters[[0, 0, 1, 2][s as usize]], q())?,
        };
        let err = rel_err(&y.i(row..row + 1)?, &want)?;
        assert!(err < 1e-5, "row {row} slot {slot}: relative error {err:e}");
    }
    // The base row is the layer's base product bit for bit (of the same batch: cuBLAS may sum a
    // one-row product in another order than a six-row one).
    assert_eq!(bits(&y.i(2..3)?)?, bits(&base_product(&layer, &x)?.i(2..3)?)?);
    Ok(())
}
test_device!(seed_example, seed_example_cpu, seed_example_cuda);

fn random_layer(rng: &mut Rng, dev: &Device, dtype: DType) -> anyhow::Result<(LoraLinear, Vec<LoraAdapter>, Tensor)> {
    let (inp, out, max_loras) = (64, 72, 6);
    let w = rng.tensor(&[out, inp], 0.2, dtype, dev)?;
    let bias = rng.tensor(&[out], 0.2, dtype, dev)?;
    let cfg = SlotConfig::new(max_loras, 32, dtype, dev);
    let mut layer = LoraLinear::new(w, Some(bias), vec![(q(), out)], Some(&cfg))?;
    let mut adapters = Vec::new();
    for slot in 0..max_loras {
        let a = adapter("r", &[(q(), [1, 8, 32, 5, 16, 2][slot], inp, out)], 100 + slot as u64)?;
        layer.write_slot(slot, &a)?;
        adapters.push(a);
    }
    let x = rng.tensor(&[40, inp], 1.0, dtype, dev)?;
    Ok((layer, adapters, x))
}

/// `x · Wᵀ` the way the layer computes it: with the packed kernel when its weight packs.
fn base_product(layer: &crate::LoraLinear, x: &Tensor) -> anyhow::Result<Tensor> {
    let w = layer.weight()?;
    Ok(match crate::PackedWeight::pack(&w)? {
        Some(p) => p.forward(x)?,
        None => crate::linear(x, &w)?,
    })
}

/// All rows -1 gives the base layer bit for bit; so do the -1 rows of a mixed batch.
fn base_rows_exact(dev: &Device) -> anyhow::Result<()> {
    let mut rng = Rng::new(5);
    let (layer, _, x) = random_layer(&mut rng, dev, DType::F32)?;
    let base = base_product(&layer, &x)?.broadcast_add(layer.bias().ok_or_else(|| anyhow::anyhow!("bias"))?)?;
    let none = slot_map(&[-1; 40], 6, dev)?;
    assert_eq!(bits(&layer.forward(&x, &none)?)?, bits(&base)?);
    let slots = rng.slots(40, 6);
    let mixed = layer.forward(&x, &slot_map(&slots, 6, dev)?)?;
    for (row, &s) in slots.iter().enumerate() {
        if s < 0 {
            assert_eq!(bits(&mixed.i(row)?)?, bits(&base.i(row)?)?, "row {row}");
        }
    }
    Ok(())
}
test_device!(base_rows_exact, base_rows_exact_cpu, base_rows_exact_cuda);

/// A row's output does not depend on which other rows share the batch.
fn rows_are_independent(dev: &Device) -> anyhow::Result<()> {
    let mut rng = Rng::new(9);
    let (layer, _, x) = random_layer(&mut rng, dev, DType::F32)?;
    let slots = rng.slots(40, 6);
    let y = layer.forward(&x, &slot_map(&slots, 6, dev)?)?;
    for trial in 0..4 {
        // Same rows 0..4, different rows and slots around them, different batch sizes.
        let n = [40, 7, 64, 5][trial];
        let mut other_slots = rng.slots(n, 6);
        other_slots[..5].copy_from_slice(&slots[..5]);
        let other_x = Tensor::cat(&[x.i(0..5)?, rng.tensor(&[n - 5, 64], 1.0, DType::F32, dev)?], 0)?;
        let other = layer.forward(&other_x, &slot_map(&other_slots, 6, dev)?)?;
        let err = rel_err(&other.i(0..5)?, &y.i(0..5)?)?;
        assert!(err <= 1e-6, "trial {trial}: rows changed with their neighbours, relative error {err:e}");
    }
    Ok(())
}
test_device!(rows_are_independent, rows_are_independent_cpu, rows_are_independent_cuda);

/// LoRA output equals the merged weight's; merge / unmerge keep every row's output.
fn lora_equals_merged(dev: &Device) -> anyhow::Result<()> {
    let mut rng = Rng::new(13);
    let (mut layer, adapters, x) = random_layer(&mut rng, dev, DType::F32)?;
    let bias = layer.bias().cloned().ok_or_else(|| anyhow::anyhow!("bias"))?;
    let w0 = layer.weight()?;
    for slot in [1usize, 2] {
        let all = slot_map(&[slot as i32; 40], 6, dev)?;
        let y = layer.forward(&x, &all)?;
        let want = merged_row(&x, &w0, &adapters[slot], q())?.broadcast_add(&bias.to_dtype(DType::F64)?)?;
        let err = rel_err(&y, &want)?;
        assert!(err < 1e-5, "slot {slot}: lora vs merged weight, relative error {err:e}");
    }
    let slots = rng.slots(40, 6);
    let mixed = slot_map(&slots, 6, dev)?;
    let before = layer.forward(&x, &mixed)?;
    layer.merge(2)?;
    assert_eq!(layer.merged_slot(), Some(2));
    let merged = layer.forward(&x, &mixed)?;
    let err = rel_err(&merged, &before)?;
    assert!(err < 1e-5, "mixed batch while merged: relative error {err:e}");
    let all2 = slot_map(&[2; 40], 6, dev)?;
    let plain = base_product(&layer, &x)?.broadcast_add(&bias)?;
    assert_eq!(bits(&layer.forward(&x, &all2)?)?, bits(&plain)?, "merged slot rows cost only the base matmul");
    layer.merge(4)?;
    let err = rel_err(&layer.forward(&x, &mixed)?, &before)?;
    assert!(err < 1e-5, "after re-merge: relative error {err:e}");
    layer.unmerge()?;
    assert!(rel_err(&layer.weight()?, &w0)? < 1e-6);
    assert!(rel_err(&layer.forward(&x, &mixed)?, &before)? < 1e-5);
    // Rewriting the merged slot unmerges it first.
    layer.merge(3)?;
    layer.write_slot(3, &adapters[0])?;
    assert_eq!(layer.merged_slot(), None);
    Ok(())
}
test_device!(lora_equals_merged, lora_equals_merged_cpu, lora_equals_merged_cuda);

/// A fused qkv with GQA widths (q 64, k and v 32) equals three separate projections, including an
/// adapter that leaves k alone and one with a different rank per module.
fn fused_qkv(dev: &Device) -> anyhow::Result<()> {
    let (hidden, qw, kvw) = (64, 64, 32);
    let ids = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj].map(|k| ModuleId::layer(2, k));
    let widths = [qw, kvw, kvw];
    let mut rng = Rng::new(21);
    let cfg = SlotConfig::new(3, 16, DType::F32, dev);
    let ws: Vec<Tensor> =
        widths.iter().map(|&o| rng.tensor(&[o, hidden], 0.2, DType::F32, dev)).collect::<anyhow::Result<_>>()?;
    let mut fused = LoraLinear::new(Tensor::cat(&ws, 0)?, None, ids.iter().copied().zip(widths).collect(), Some(&cfg))?;
    let mut parts: Vec<LoraLinear> = ids
        .iter()
        .zip(&ws)
        .zip(widths)
        .map(|((&id, w), o)| LoraLinear::new(w.clone(), None, vec![(id, o)], Some(&cfg)))
        .collect::<crate::Result<_>>()?;
    let adapters = [
        adapter("qv", &[(ids[0], 8, hidden, qw), (ids[2], 8, hidden, kvw)], 1)?,
        adapter("qkv", &[(ids[0], 4, hidden, qw), (ids[1], 16, hidden, kvw), (ids[2], 2, hidden, kvw)], 2)?,
        adapter("k", &[(ids[1], 16, hidden, kvw)], 3)?,
    ];
    for (slot, a) in adapters.iter().enumerate() {
        fused.write_slot(slot, a)?;
        for p in &mut parts {
            p.write_slot(slot, a)?;
        }
    }
    assert_eq!(fused.lora_slots().map(|s| s[1].ranks().to_vec()), Some(vec![0, 16, 16]));
    let slots = rng.slots(50, 3);
    let mapping = slot_map(&slots, 3, dev)?;
    let x = rng.tensor(&[50, hidden], 1.0, DType::F32, dev)?;
    let want = Tensor::cat(&parts.iter().map(|p| p.forward(&x, &mapping)).collect::<crate::Result<Vec<_>>>()?, 1)?;
    let err = rel_err(&fused.forward(&x, &mapping)?, &want)?;
    assert!(err < 1e-6, "fused vs separate: relative error {err:e}");
    Ok(())
}
test_device!(fused_qkv, fused_qkv_cpu, fused_qkv_cuda);

/// Embedding LoRA against `E[t] + B · A[:, t]` computed from the adapter's tensors.
fn embedding_matches_reference(dev: &Device) -> anyhow::Result<()> {
    let (vocab, hidden) = (100, 24);
    let id = ModuleId::embed_tokens();
    let mut rng = Rng::new(31);
    let e = rng.tensor(&[vocab, hidden], 1.0, DType::F32, dev)?;
    let cfg = SlotConfig::new(3, 8, DType::F32, dev);
    let mut emb = LoraEmbedding::new(e.clone(), Some(&cfg))?;
    let adapters = [adapter("e4", &[(id, 4, vocab, hidden)], 1)?, adapter("e8", &[(id, 8, vocab, hidden)], 2)?];
    emb.write_slot(0, &adapters[0])?;
    emb.write_slot(2, &adapters[1])?;
    let ids: Vec<u32> = (0..30).map(|_| rng.range(0, vocab - 1) as u32).collect();
    let slots = rng.slots(30, 3);
    let mapping = slot_map(&slots, 3, dev)?;
    let y = emb.forward(&Tensor::new(ids.as_slice(), dev)?, &mapping)?;
    for (row, (&t, &s)) in ids.iter().zip(&slots).enumerate() {
        let base = e.i(t as usize)?;
        let want = match s {
            0 | 2 => {
                let m = adapters[s as usize / 2].module(&id).ok_or_else(|| anyhow::anyhow!("module"))?;
                let col = m.a.i((.., t as usize))?.to_device(dev)?;
                (base + m.b()?.to_device(dev)?.matmul(&col.unsqueeze(1)?)?.squeeze(1)?)?
            }
            _ => base,
        };
        let err = rel_err(&y.i(row)?, &want)?;
        assert!(err < 1e-6, "row {row} token {t} slot {s}: relative error {err:e}");
        if s == 1 || s < 0 {
            assert_eq!(bits(&y.i(row)?)?, bits(&e.i(t as usize)?)?, "row {row} must be the base embedding");
        }
    }
    Ok(())
}
test_device!(embedding_matches_reference, embedding_matches_reference_cpu, embedding_matches_reference_cuda);

/// Bad adapters are errors naming the module and both shapes, and leave the slot untouched.
fn slot_write_errors(dev: &Device) -> anyhow::Result<()> {
    let cfg = SlotConfig::new(2, 8, DType::BF16, dev);
    let mut rng = Rng::new(41);
    let w = rng.tensor(&[16, 12], 1.0, DType::F32, dev)?;
    let mut layer = LoraLinear::new(w, None, vec![(q(), 16)], Some(&cfg))?;
    let good = adapter("good", &[(q(), 4, 12, 16)], 1)?;
    layer.write_slot(0, &good)?;
    let ranks = |l: &LoraLinear| l.lora_slots().map(|s| s[0].ranks().to_vec());
    assert_eq!(ranks(&layer), Some(vec![4, 0]));

    let e = layer.write_slot(1, &adapter("big", &[(q(), 9, 12, 16)], 2)?).unwrap_err();
    assert_eq!(e.kind(), "slot_write");
    let msg = e.to_string();
    assert!(msg.contains("\"big\"") && msg.contains("q_proj") && msg.contains("rank 9") && msg.contains("8"), "{msg}");
    let e = layer.write_slot(1, &adapter("wide", &[(q(), 4, 13, 16)], 3)?).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("lora_A") && msg.contains("[4, 13]") && msg.contains("[4, 12]"), "{msg}");
    let store_err: multilora_adapter::Error = e.into();
    assert_eq!(store_err.kind(), "slot_write");
    assert!(layer.write_slot(2, &good).is_err() && layer.clear_slot(2).is_err());
    assert_eq!(ranks(&layer), Some(vec![4, 0]));

    // bf16 slots hold the f32 adapter rounded, zero-padded past rank 4; clearing zeroes it all.
    let slots = &layer.lora_slots().ok_or_else(|| anyhow::anyhow!("slots"))?[0];
    let m = good.module(&q()).ok_or_else(|| anyhow::anyhow!("module"))?;
    let a = slots.a().i(0)?.to_dtype(DType::F32)?;
    assert!(rel_err(&a.i(0..4)?, &m.a.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.to_device(dev)?)? == 0.0);
    assert!(a.i(4..8)?.abs()?.sum_all()?.to_scalar::<f32>()? == 0.0);
    layer.clear_slot(0)?;
    let slots = &layer.lora_slots().ok_or_else(|| anyhow::anyhow!("slots"))?[0];
    assert!(slots.a().abs()?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()? == 0.0);
    assert!(slots.b().abs()?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()? == 0.0);
    assert_eq!(ranks(&layer), Some(vec![0, 0]));

    // A smaller adapter over a larger one: the larger one's extra ranks are zeroed.
    layer.write_slot(1, &adapter("r8", &[(q(), 8, 12, 16)], 5)?)?;
    layer.write_slot(1, &adapter("r3", &[(q(), 3, 12, 16)], 6)?)?;
    let slots = &layer.lora_slots().ok_or_else(|| anyhow::anyhow!("slots"))?[0];
    assert!(slots.a().i((1, 3..8))?.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()? == 0.0);
    assert!(slots.b().i((1, 3..8, ..))?.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()? == 0.0);
    assert_eq!(ranks(&layer), Some(vec![0, 3]));

    // A layer without slots.
    let mut plain = LoraLinear::new(Tensor::zeros((4, 4), DType::F32, dev)?, None, vec![(q(), 4)], None)?;
    assert!(!plain.has_lora());
    assert_eq!(plain.write_slot(0, &good).unwrap_err().kind(), "slot_write");
    assert!(LoraLinear::new(Tensor::zeros((4, 4), DType::F32, dev)?, None, vec![(q(), 3)], None).is_err());
    Ok(())
}
test_device!(slot_write_errors, slot_write_errors_cpu, slot_write_errors_cuda);

#[test]
fn handles_are_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<LoraLinear>();
    check::<LoraEmbedding>();
    check::<LoraMapping>();
    check::<crate::LoraSlots>();
    check::<crate::Error>();
}
