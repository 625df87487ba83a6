//! `lora_shrink`: the first GEMM of a LoRA delta for every adapted row of a batch, grouped by slot
//! (Punica's SGMV shrink).
//!
//! For every slice `i` (a module of a possibly fused layer), every adapter segment of the mapping
//! (slot `k`, real rank `r = ranks_i[k]`) and every row `j` of that segment:
//!
//! ```text
//! s_i[j, 0..r] = x[row_j, :] · A_i[k, 0..r, :]ᵀ          x: [rows, in], A_i: [max_loras, max_rank, in]
//! ```
//!
//! `s_i` is `[lora_rows, r_i]` in f32 whatever the input dtype (Punica and vLLM accumulate the
//! rank-width intermediate in f32 too), packed in the mapping's sorted order (position `j` is
//! row [`LoraMapping::lora_rows`]`()[j]`), with `r_i` the largest real rank among the slots the
//! mapping uses; columns past a segment's own rank are zero. Each segment is one
//! `[n, in] · [in, r]` GEMM on views at the true rank, so a rank-8 adapter in a rank-64 slot costs
//! rank 8; the rows are gathered once for all slices, and not at all when already sorted.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::check_input;
use crate::slots::LoraSlots;

/// Segmented shrink of `x: [rows, in]` through every slice: one `[lora_rows, r_i]` f32 tensor each.
///
/// Returns an empty list when the mapping has no LoRA rows.
pub fn lora_shrink(x: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Vec<Tensor>> {
    check_input("lora_shrink", x, slices, mapping)?;
    if mapping.no_lora() {
        return Ok(Vec::new());
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::ops::lora_cuda::shrink(x, slices, mapping);
    }
    let Some(xs) = mapping.gather_lora_rows(x)? else {
        return Ok(Vec::new());
    };
    if x.device().is_cpu() {
        return cpu::shrink(&xs, slices, mapping);
    }
    shrink_tensor_ops(&xs, slices, mapping)
}

/// The device-generic segmented shrink over the gathered LoRA rows `xs: [lora_rows, in]`.
pub(crate) fn shrink_tensor_ops(xs: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Vec<Tensor>> {
    let n = mapping.num_lora_rows();
    // One conversion for all slices and segments; a no-op for f32.
    let xs = xs.to_dtype(DType::F32)?;
    let mut out = Vec::with_capacity(slices.len());
    for sl in slices {
        let width = sl.active_rank(mapping);
        let s = Tensor::zeros((n, width), DType::F32, xs.device())?;
        for seg in mapping.lora_segments() {
            let Some((a, _)) = sl.slot_ab(seg.slot.index())? else { continue };
            let p = mapping.packed_start(seg);
            let part = xs.narrow(0, p, seg.len)?.matmul(&a.to_dtype(DType::F32)?.t()?)?;
            s.narrow(0, p, seg.len)?.slice_set(&part, 1, 0)?;
        }
        out.push(s);
    }
    Ok(out)
}
