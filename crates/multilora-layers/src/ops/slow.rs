//! The slow reference ops (BGMV semantics), built only from plain candle tensor ops so they run
//! on any device: every row gathers its own slot's A and B and multiplies them, in f32.
//!
//! - shrink: `s_i[t, :] = x[t, :] · A_i[slot_t]ᵀ` over the whole padded rank, `[rows, max_rank]`
//!   f32 in row order, zero for base-model rows (no slot);
//! - expand: `y[t, off_i .. off_i + out_i] += s_i[t, :] · B_i[slot_t]ᵀ`, `off_i = Σ_{i' < i} out_i'`.
//!
//! They read the zero padding of every slot and gather `rows · max_rank · (in + out)` values, so
//! they are the oracle the segmented ops are checked against, not something to serve with.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::{check_input, check_output};
use crate::slots::LoraSlots;

/// Per-row slot indices (0 for base rows) and a `[rows, 1]` f32 mask that zeroes base rows.
fn gather_index(mapping: &LoraMapping) -> Result<(Tensor, Tensor)> {
    let rows = mapping.num_rows();
    let idx: Vec<u32> = mapping.slots().iter().map(|s| s.map_or(0, |s| s.index() as u32)).collect();
    let mask: Vec<f32> = mapping.slots().iter().map(|s| if s.is_some() { 1.0 } else { 0.0 }).collect();
    let device = mapping.device();
    Ok((Tensor::from_vec(idx, rows, device)?, Tensor::from_vec(mask, (rows, 1), device)?))
}

/// Reference shrink: one `[rows, max_rank]` f32 tensor per slice, rows in batch order.
pub fn lora_shrink_slow(x: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Vec<Tensor>> {
    check_input("lora_shrink_slow", x, slices, mapping)?;
    let (idx, mask) = gather_index(mapping)?;
    let x = x.to_dtype(DType::F32)?.unsqueeze(1)?;
    slices
        .iter()
        .map(|s| {
            // [rows, max_rank, in]: each row's own A.
            let a = s.a().index_select(&idx, 0)?.to_dtype(DType::F32)?;
            let out = x.matmul(&a.transpose(1, 2)?)?.squeeze(1)?;
            Ok(out.broadcast_mul(&mask)?)
        })
        .collect()
}

/// Reference expand: `y` plus every slice's delta at its column offset, as a new tensor.
pub fn lora_expand_slow(y: &Tensor, s: &[Tensor], slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Tensor> {
    check_output("lora_expand_slow", y, s, slices, mapping, false, true)?;
    let (idx, mask) = gather_index(mapping)?;
    let mut deltas = Vec::with_capacity(slices.len());
    for (t, sl) in s.iter().zip(slices) {
        let t = t.narrow(1, 0, sl.max_rank())?.to_dtype(DType::F32)?.unsqueeze(1)?;
        // [rows, max_rank, out]: each row's own Bᵀ.
        let b = sl.b().index_select(&idx, 0)?.to_dtype(DType::F32)?;
        deltas.push(t.matmul(&b)?.squeeze(1)?.broadcast_mul(&mask)?);
    }
    let delta = Tensor::cat(&deltas, 1)?;
    Ok((y.to_dtype(DType::F32)? + delta)?.to_dtype(y.dtype())?)
}
