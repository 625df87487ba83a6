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
//!
//! [`Shrink`] is the op, in candle's `CustomOp` shape: its operands checked once when it is made,
//! then `forward` runs `cpu_fwd` (`cpu.rs`) or `cuda_fwd` (`cuda.rs`, feature `cuda`) by the
//! input's device, or the device-generic tensor ops anywhere else.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::check_input;
use crate::slots::LoraSlots;

/// The shrink of one layer's slices over one step's mapping, its input checked once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shrink<'a> {
    pub(crate) slices: &'a [&'a LoraSlots],
    pub(crate) mapping: &'a LoraMapping,
}

impl<'a> Shrink<'a> {
    /// Checks `x: [rows, in]` against the slices and the mapping (the op's one check; `op` names
    /// it in errors).
    pub(crate) fn new(op: &str, x: &Tensor, slices: &'a [&'a LoraSlots], mapping: &'a LoraMapping) -> Result<Self> {
        check_input(op, x, slices, mapping)?;
        Ok(Shrink { slices, mapping })
    }

    /// One `[lora_rows, r_i]` f32 tensor per slice; none when the mapping has no LoRA rows.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        if self.mapping.no_lora() {
            return Ok(Vec::new());
        }
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return self.cuda_fwd(x);
        }
        if x.device().is_cpu() {
            return self.cpu_fwd(x);
        }
        let Some(xs) = self.mapping.gather_lora_rows(x)? else {
            return Ok(Vec::new());
        };
        self.tensor_ops_fwd(&xs)
    }

    /// The device-generic segmented shrink over the gathered LoRA rows `xs: [lora_rows, in]`.
    pub(crate) fn tensor_ops_fwd(&self, xs: &Tensor) -> Result<Vec<Tensor>> {
        let mapping = self.mapping;
        let n = mapping.num_lora_rows();
        // One conversion for all slices and segments; a no-op for f32.
        let xs = xs.to_dtype(DType::F32)?;
        let mut out = Vec::with_capacity(self.slices.len());
        for sl in self.slices {
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
}

/// Segmented shrink of `x: [rows, in]` through every slice: one `[lora_rows, r_i]` f32 tensor each.
///
/// Returns an empty list when the mapping has no LoRA rows.
pub fn lora_shrink(x: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Vec<Tensor>> {
    Shrink::new("lora_shrink", x, slices, mapping)?.forward(x)
}
