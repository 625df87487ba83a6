//! CPU shrink: the per-segment GEMMs through candle's CPU matmul (the `gemm` crate, which takes the
//! strided views of the slot buffers as they are, so nothing is copied to work at the true rank),
//! spread over the cores.
//!
//! One `[n, in] · [in, r]` GEMM of a decode step (n ≈ 8, r ≈ 16) is below `gemm`'s own threading
//! threshold, so it runs on one core; the segments of all slices are independent, so they go to a
//! rayon pool instead, and only the tiny `[n, r]` results are copied into the packed output.

use candle_core::{DType, Tensor};

use super::Shrink;
use crate::error::Result;
use crate::ops::run_tasks;

impl Shrink<'_> {
    /// The CPU forward: the LoRA rows of `x` gathered once (not at all when already sorted), then
    /// every (slice, segment) GEMM on the rayon pool.
    pub(super) fn cpu_fwd(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let (slices, mapping) = (self.slices, self.mapping);
        let Some(xs) = mapping.gather_lora_rows(x)? else {
            return Ok(Vec::new());
        };
        let n = mapping.num_lora_rows();
        let xs = xs.to_dtype(DType::F32)?;
        let in_features = xs.dim(1)?;
        // (slice, packed start, len, A at the true rank) for every segment with a non-empty slot.
        let mut tasks = Vec::new();
        let mut work = 0;
        for (i, sl) in slices.iter().enumerate() {
            for seg in mapping.lora_segments() {
                if let Some((a, _)) = sl.slot_ab(seg.slot.index())? {
                    work += seg.len * a.dim(0)? * in_features;
                    tasks.push((i, mapping.packed_start(seg), seg.len, a));
                }
            }
        }
        let parts = run_tasks(&tasks, work, |(_, p, len, a)| {
            Ok(xs.narrow(0, *p, *len)?.matmul(&a.to_dtype(DType::F32)?.t()?)?)
        })?;
        let out: Vec<Tensor> = slices
            .iter()
            .map(|sl| Tensor::zeros((n, sl.active_rank(mapping)), DType::F32, xs.device()))
            .collect::<candle_core::Result<_>>()?;
        for ((i, p, len, _), part) in tasks.iter().zip(parts) {
            out[*i].narrow(0, *p, *len)?.slice_set(&part, 1, 0)?;
        }
        Ok(out)
    }
}
