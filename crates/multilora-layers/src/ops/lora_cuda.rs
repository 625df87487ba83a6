//! The CUDA paths of the LoRA ops (feature `cuda`), behind the same functions the CPU path uses:
//! the public [`crate::lora_shrink`] / [`crate::lora_expand`] (reduced shrink outputs, one per
//! slice), the fused layer path of `LoraLinear` (shrink with the plan's K split into one shared
//! buffer, then expand in place summing the partials), and the embedding's gather + expand. Each
//! is one plan on the host and one launch per kernel per group of segments.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::expand::cuda::{ExpandOp, ShrinkRows};
use crate::ops::plan::SegmentedPlan;
use crate::ops::shrink::cuda::{EmbedShrinkOp, ShrinkOp};
use crate::slots::LoraSlots;

/// The public shrink: one `[lora_rows, r_i]` f32 tensor per slice (views of one buffer).
pub(crate) fn shrink(x: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Vec<Tensor>> {
    let plan = SegmentedPlan::for_layer(mapping, slices, Some(1))?;
    let n = mapping.num_lora_rows();
    if !plan.has_work() {
        return slices.iter().map(|_| Ok(Tensor::zeros((n, 0), DType::F32, x.device())?)).collect();
    }
    let x = x.contiguous()?;
    let s = x.apply_op1_no_bwd(&ShrinkOp { plan: &plan, slices, mapping })?.squeeze(0)?;
    (0..slices.len()).map(|i| Ok(s.narrow(1, plan.s_offsets[i], plan.active[i])?)).collect()
}

/// The public expand: `y` plus every slice's delta, `y` updated in place (made contiguous first
/// if it is not).
pub(crate) fn expand(y: Tensor, s: &[Tensor], slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Tensor> {
    let plan = SegmentedPlan::for_layer(mapping, slices, Some(1))?;
    if !plan.has_work() {
        return Ok(y);
    }
    let y = if y.is_contiguous() { y } else { y.contiguous()? };
    let s: Vec<Tensor> = s
        .iter()
        .map(|t| {
            let t = t.to_dtype(DType::F32)?;
            Ok(if t.stride().get(1) == Some(&1) { t } else { t.contiguous()? })
        })
        .collect::<Result<_>>()?;
    y.inplace_op1(&ExpandOp { plan: &plan, slices, mapping, s: ShrinkRows::PerSlice(&s) })?;
    Ok(y)
}

/// The fused layer path: `y += Σ_i expand_i(shrink_i(x))`, `y` (the fresh base output) updated in
/// place.
pub(crate) fn apply_lora(x: &Tensor, y: Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Tensor> {
    let plan = SegmentedPlan::for_layer(mapping, slices, None)?;
    if !plan.has_work() {
        return Ok(y);
    }
    let x = x.contiguous()?;
    let y = if y.is_contiguous() { y } else { y.contiguous()? };
    let s = x.apply_op1_no_bwd(&ShrinkOp { plan: &plan, slices, mapping })?;
    y.inplace_op1(&ExpandOp { plan: &plan, slices, mapping, s: ShrinkRows::Shared(&s) })?;
    Ok(y)
}

/// The embedding: `y` (the gathered base rows) plus `B_k · A_k[:, id]` for every LoRA row.
pub(crate) fn embed_lora(ids: &Tensor, y: Tensor, slots: &LoraSlots, mapping: &LoraMapping) -> Result<Tensor> {
    if ids.dim(0)? != mapping.num_rows() {
        return Err(crate::error::Error::RowMismatch {
            op: "lora_embedding".to_string(),
            input: ids.dim(0)?,
            mapping: mapping.num_rows(),
        });
    }
    let slices = [slots];
    let plan = SegmentedPlan::for_layer(mapping, &slices, Some(1))?;
    if !plan.has_work() {
        return Ok(y);
    }
    let ids = ids.contiguous()?;
    let s = ids.apply_op1_no_bwd(&EmbedShrinkOp { plan: &plan, slots, mapping })?.unsqueeze(0)?;
    let y = if y.is_contiguous() { y } else { y.contiguous()? };
    y.inplace_op1(&ExpandOp { plan: &plan, slices: &slices, mapping, s: ShrinkRows::Shared(&s) })?;
    Ok(y)
}
