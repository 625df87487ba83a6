//! `lora_expand`: the second GEMM of a LoRA delta, added into the layer's output at each slice's
//! column offset (Punica's SGMV expand).
//!
//! For every slice `i` with output width `out_i` at column offset `off_i = Σ_{i' < i} out_i'`,
//! every adapter segment (slot `k`, real rank `r = ranks_i[k]`) and every row `j` of it:
//!
//! ```text
//! y[row_j, off_i .. off_i + out_i] += s_i[j, 0..r] · B_i[k, :, 0..r]ᵀ
//!     y: [rows, Σ out_i], s_i: [lora_rows, ≥ r] f32 (from `lora_shrink`), B_i: [max_loras, out_i, max_rank]
//! ```
//!
//! Fused layouts (qkv with GQA widths, gate_up) are just several slices of different widths.
//! The delta is computed in f32 and rounded once into `y`'s dtype. Base-model rows, and slots
//! whose rank is 0 for a slice, are not touched, so they keep the base output bit for bit.
//!
//! On the CPU and on CUDA `y` is updated in place (no copy of the whole output: each segment's `[n, out_i]`
//! product is added straight into its rows); elsewhere the deltas are packed and added with one
//! `index_add`.
//!
//! [`Expand`] is the op, in candle's `CustomOp` shape: its operands checked once when it is made,
//! then `forward` runs `cpu_fwd` (`cpu.rs`) or `cuda_fwd` (`cuda.rs`, feature `cuda`) by the
//! output's device, or the device-generic tensor ops anywhere else.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::shrink::Shrink;
use crate::ops::{check_output, check_y};
use crate::slots::LoraSlots;

/// The expand of one layer's slices over one step's mapping, its operands checked once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expand<'a> {
    pub(crate) slices: &'a [&'a LoraSlots],
    pub(crate) mapping: &'a LoraMapping,
}

impl<'a> Expand<'a> {
    /// Checks `y: [rows, Σ out]` and the shrink outputs `s` against the slices and the mapping
    /// (the op's one check; `op` names it in errors).
    pub(crate) fn new(
        op: &str,
        y: &Tensor,
        s: &[Tensor],
        slices: &'a [&'a LoraSlots],
        mapping: &'a LoraMapping,
    ) -> Result<Self> {
        check_output(op, y, s, slices, mapping, true, true)?;
        Ok(Expand { slices, mapping })
    }

    /// The expand after `shrink`, whose check covered the slices: checks `y` and `s` only.
    pub(crate) fn after(shrink: &Shrink<'a>, op: &str, y: &Tensor, s: &[Tensor]) -> Result<Self> {
        check_output(op, y, s, shrink.slices, shrink.mapping, true, false)?;
        Ok(Expand { slices: shrink.slices, mapping: shrink.mapping })
    }

    /// The expand that `shrink`'s fused path folds the shrink into: checks `y` only (no shrink
    /// output exists outside its tasks and kernels).
    pub(crate) fn fused(shrink: &Shrink<'a>, op: &str, y: &Tensor) -> Result<Self> {
        check_y(op, y, shrink.slices, shrink.mapping)?;
        Ok(Expand { slices: shrink.slices, mapping: shrink.mapping })
    }

    /// `y` plus every slice's delta; on the CPU (contiguous `y`) and CUDA, `y`'s storage is
    /// updated in place and returned.
    pub(crate) fn forward(&self, y: Tensor, s: &[Tensor]) -> Result<Tensor> {
        if y.device().is_cpu() && y.is_contiguous() {
            self.cpu_fwd(&y, s)?;
            return Ok(y);
        }
        #[cfg(feature = "cuda")]
        if y.device().is_cuda() {
            return self.cuda_fwd(y, s);
        }
        self.tensor_ops_fwd(&y, s)
    }

    /// The device-generic expand: deltas packed into `[lora_rows, Σ out]`, then one `index_add`.
    pub(crate) fn tensor_ops_fwd(&self, y: &Tensor, s: &[Tensor]) -> Result<Tensor> {
        let (slices, mapping) = (self.slices, self.mapping);
        let Some(index) = mapping.lora_index() else { return Ok(y.clone()) };
        let total: usize = slices.iter().map(|s| s.out_features()).sum();
        let delta = Tensor::zeros((mapping.num_lora_rows(), total), DType::F32, y.device())?;
        let mut offset = 0;
        for (t, sl) in s.iter().zip(slices) {
            for seg in mapping.lora_segments() {
                let p = mapping.packed_start(seg);
                if let Some(d) = segment_delta(t, sl, seg.slot.index(), p, seg.len, true)? {
                    delta.narrow(0, p, seg.len)?.slice_set(&d, 1, offset)?;
                }
            }
            offset += sl.out_features();
        }
        if y.dtype() == DType::F32 {
            return Ok(y.index_add(index, &delta, 0)?);
        }
        // Add in f32 and round once, as the in-place CPU path does.
        Ok(y.to_dtype(DType::F32)?.index_add(index, &delta, 0)?.to_dtype(y.dtype())?)
    }
}

/// Segmented expand: `y` plus every slice's delta, rows and columns as in the module docs.
///
/// `s` is what [`crate::lora_shrink`] returned for the same slices and mapping. On the CPU and CUDA the
/// storage of `y` is updated in place and returned, so pass a tensor nothing else reads, such as
/// the fresh base output of the layer.
pub fn lora_expand(y: Tensor, s: &[Tensor], slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Tensor> {
    if mapping.no_lora() {
        return Ok(y);
    }
    Expand::new("lora_expand", &y, s, slices, mapping)?.forward(y, s)
}

/// One segment's `s_seg · B_slotᵀ`: `[len, out_i]` f32, or `None` when the slot's rank is 0.
pub(crate) fn segment_delta(
    s: &Tensor,
    sl: &LoraSlots,
    slot: usize,
    packed_start: usize,
    len: usize,
    contiguous: bool,
) -> Result<Option<Tensor>> {
    let Some((_, b)) = sl.slot_ab(slot)? else { return Ok(None) };
    let r = b.dim(1)?;
    let s_seg = s.narrow(0, packed_start, len)?.narrow(1, 0, r)?;
    let b_t = b.to_dtype(DType::F32)?.t()?;
    // The CPU GEMM takes any strides; cuBLAS wants a contiguous leading dimension.
    let (s_seg, b_t) = if contiguous { (s_seg.contiguous()?, b_t.contiguous()?) } else { (s_seg, b_t) };
    Ok(Some(s_seg.matmul(&b_t)?))
}
