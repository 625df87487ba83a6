//! The segmented ops against the slow gathered reference, over random shapes, ranks and slot maps.

use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_types::ModuleKind;

use super::{Rng, bits, rel_err, slot_map, test_device};
use crate::ops::expand::Expand;
use crate::ops::shrink::Shrink;
use crate::{LoraSlots, lora_expand, lora_expand_slow, lora_shrink, lora_shrink_slow};

/// Random slots whose padding past each slot's rank is zero, as a real slot write leaves it.
pub(super) fn random_slots(
    rng: &mut Rng,
    id: ModuleId,
    (l, r, i, o): (usize, usize, usize, usize),
    dtype: DType,
    dev: &Device,
) -> anyhow::Result<LoraSlots> {
    // A few empty slots (rank 0) and a few full-rank ones among random ranks.
    let ranks: Vec<usize> = (0..l).map(|_| if rng.range(0, 5) == 0 { 0 } else { rng.range(1, r) }).collect();
    let mask: Vec<f32> = ranks.iter().flat_map(|&k| (0..r).map(move |j| if j < k { 1.0 } else { 0.0 })).collect();
    let mask = Tensor::from_vec(mask, (l, r), dev)?;
    let a = rng.tensor(&[l, r, i], 0.5, DType::F32, dev)?.broadcast_mul(&mask.unsqueeze(2)?)?;
    let b = rng.tensor(&[l, o, r], 0.5, DType::F32, dev)?.broadcast_mul(&mask.unsqueeze(1)?)?;
    Ok(LoraSlots::from_parts(id, a.to_dtype(dtype)?, b.to_dtype(dtype)?, ranks)?)
}

struct Case {
    rows: usize,
    inp: usize,
    outs: Vec<usize>,
    max_loras: usize,
    max_rank: usize,
    dtype: DType,
    /// 0 random, 1 all -1, 2 all one slot, 3 random but sorted.
    map: usize,
}

fn check_case(rng: &mut Rng, c: &Case, dev: &Device) -> anyhow::Result<()> {
    let tol = if c.dtype == DType::F32 { 1e-5 } else { 1e-2 };
    let kinds = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj];
    let slots: Vec<LoraSlots> = c
        .outs
        .iter()
        .zip(kinds)
        .map(|(&o, k)| random_slots(rng, ModuleId::layer(0, k), (c.max_loras, c.max_rank, c.inp, o), c.dtype, dev))
        .collect::<anyhow::Result<_>>()?;
    let refs: Vec<&LoraSlots> = slots.iter().collect();
    let mut slot_list = match c.map {
        1 => vec![-1; c.rows],
        2 => vec![rng.range(0, c.max_loras - 1) as i32; c.rows],
        _ => rng.slots(c.rows, c.max_loras),
    };
    if c.map == 3 {
        slot_list.sort();
    }
    let mapping = slot_map(&slot_list, c.max_loras, dev)?;
    let x = rng.tensor(&[c.rows, c.inp], 1.0, c.dtype, dev)?;
    let total: usize = c.outs.iter().sum();
    let what = format!(
        "rows {} in {} outs {:?} slots {} rank {} {:?} map {}",
        c.rows, c.inp, c.outs, c.max_loras, c.max_rank, c.dtype, c.map
    );

    let s_slow = lora_shrink_slow(&x, &refs, &mapping)?;
    let s = lora_shrink(&x, &refs, &mapping)?;
    // The zero base output makes the compared value the delta alone.
    let y0 = Tensor::zeros((c.rows, total), c.dtype, dev)?;
    let y_slow = lora_expand_slow(&y0, &s_slow, &refs, &mapping)?;
    let y = lora_expand(y0.copy()?, &s, &refs, &mapping)?;
    let err = rel_err(&y, &y_slow)?;
    anyhow::ensure!(err <= tol, "{what}: expand relative error {err:e}");

    if let Some(index) = mapping.lora_index() {
        // Shrink outputs agree too, once the reference's rows are put in packed order.
        for ((seg, slow), sl) in s.iter().zip(&s_slow).zip(&refs) {
            anyhow::ensure!(seg.dtype() == DType::F32, "{what}: shrink output is {:?}", seg.dtype());
            let width = sl.active_rank(&mapping);
            let slow = slow.index_select(index, 0)?.narrow(1, 0, width)?;
            let err = rel_err(seg, &slow)?;
            anyhow::ensure!(err <= tol, "{what}: shrink relative error {err:e}");
        }
        // The device-generic tensor-op path (what any device without kernels runs) agrees as well.
        let xs = mapping.gather_lora_rows(&x)?.ok_or_else(|| anyhow::anyhow!("no lora rows"))?;
        let s_ops = Shrink::new("test", &x, &refs, &mapping)?.tensor_ops_fwd(&xs)?;
        let y_ops = Expand::new("test", &y0, &s_ops, &refs, &mapping)?.tensor_ops_fwd(&y0, &s_ops)?;
        let err = rel_err(&y_ops, &y_slow)?;
        anyhow::ensure!(err <= tol, "{what}: tensor-op path relative error {err:e}");
    } else {
        anyhow::ensure!(s.is_empty() && bits(&y)? == bits(&y0)?, "{what}: no-lora batch changed the output");
    }

    // Rows with slot -1 keep a non-zero base output bit for bit.
    let base = rng.tensor(&[c.rows, total], 1.0, c.dtype, dev)?;
    let y = lora_expand(base.copy()?, &s, &refs, &mapping)?;
    let (yb, bb) = (bits(&y)?, bits(&base)?);
    for (row, &slot) in slot_list.iter().enumerate() {
        if slot < 0 {
            anyhow::ensure!(
                yb[row * total..(row + 1) * total] == bb[row * total..(row + 1) * total],
                "{what}: base row {row} changed"
            );
        }
    }
    Ok(())
}

fn segmented_matches_slow(dev: &Device) -> anyhow::Result<()> {
    let mut rng = Rng::new(7);
    let mut cases = Vec::new();
    for i in 0..60 {
        let dtype = match i % 6 {
            4 => DType::BF16,
            5 => DType::F16,
            _ => DType::F32,
        };
        let slices = rng.range(1, 3);
        cases.push(Case {
            rows: if i % 5 == 0 { rng.range(128, 256) } else { rng.range(1, 40) },
            inp: rng.range(1, 96),
            outs: (0..slices).map(|_| rng.range(1, 96)).collect(),
            max_loras: rng.range(1, 32),
            max_rank: if i % 7 == 0 { 64 } else { rng.range(1, 64) },
            dtype,
            map: i % 4,
        });
    }
    // Sizes that are not a multiple of anything, as a real hidden size might not be.
    cases.push(Case { rows: 33, inp: 2049, outs: vec![2049], max_loras: 5, max_rank: 64, dtype: DType::F32, map: 0 });
    cases.push(Case {
        rows: 9,
        inp: 2049,
        outs: vec![640, 129],
        max_loras: 3,
        max_rank: 16,
        dtype: DType::BF16,
        map: 0,
    });
    for c in &cases {
        check_case(&mut rng, c, dev)?;
    }
    Ok(())
}
test_device!(segmented_matches_slow, segmented_matches_slow_cpu, segmented_matches_slow_cuda);

/// bf16 inputs, f32 accumulation: `1 + 3·2⁻⁹` is not a bf16 value, so a shrink that summed or
/// stored in bf16 would return 1 or 1.0078125.
fn bf16_shrink_accumulates_in_f32(dev: &Device) -> anyhow::Result<()> {
    let inp = 4;
    let x = Tensor::new(&[[1.0f32, 2f32.powi(-9), 2f32.powi(-9), 2f32.powi(-9)]], dev)?.to_dtype(DType::BF16)?;
    let a = Tensor::ones((1, 1, inp), DType::BF16, dev)?;
    let b = Tensor::ones((1, 1, 1), DType::BF16, dev)?;
    let slots = LoraSlots::from_parts(ModuleId::layer(0, ModuleKind::QProj), a, b, vec![1])?;
    let mapping = slot_map(&[0], 1, dev)?;
    let exact = 1.0 + 3.0 * 2f32.powi(-9);
    for s in [lora_shrink(&x, &[&slots], &mapping)?, lora_shrink_slow(&x, &[&slots], &mapping)?] {
        anyhow::ensure!(s[0].dtype() == DType::F32);
        let v = s[0].flatten_all()?.to_vec1::<f32>()?;
        anyhow::ensure!(v == [exact], "shrink gave {v:?}, want {exact}");
    }
    Ok(())
}
test_device!(bf16_shrink_accumulates_in_f32, bf16_shrink_accumulates_in_f32_cpu, bf16_shrink_accumulates_in_f32_cuda);

fn ops_reject_bad_shapes(dev: &Device) -> anyhow::Result<()> {
    let mut rng = Rng::new(3);
    let slots = random_slots(&mut rng, ModuleId::layer(1, ModuleKind::OProj), (2, 4, 8, 6), DType::F32, dev)?;
    let mapping = slot_map(&[0, 1, -1], 2, dev)?;
    let e = lora_shrink(&Tensor::zeros((3, 7), DType::F32, dev)?, &[&slots], &mapping).unwrap_err();
    assert_eq!(e.kind(), "shape_mismatch");
    assert!(
        e.to_string().contains("o_proj") && e.to_string().contains("[3, 7]") && e.to_string().contains("[3, 8]"),
        "{e}"
    );
    let e = lora_shrink(&Tensor::zeros((4, 8), DType::F32, dev)?, &[&slots], &mapping).unwrap_err();
    assert_eq!(e.kind(), "row_mismatch");
    let s = lora_shrink(&Tensor::zeros((3, 8), DType::F32, dev)?, &[&slots], &mapping)?;
    let e = lora_expand(Tensor::zeros((3, 5), DType::F32, dev)?, &s, &[&slots], &mapping).unwrap_err();
    assert_eq!(e.kind(), "shape_mismatch", "{e}");
    Ok(())
}
test_device!(ops_reject_bad_shapes, ops_reject_bad_shapes_cpu, ops_reject_bad_shapes_cuda);
