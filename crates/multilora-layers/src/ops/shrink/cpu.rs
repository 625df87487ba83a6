//! CPU shrink: the segmented GEMMs through candle's CPU matmul (the `gemm` crate, which takes the
//! strided views of the slot buffers as they are, so nothing is copied at the true rank).

use candle_core::Tensor;

use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::slots::LoraSlots;

pub(super) fn shrink(xs: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Vec<Tensor>> {
    super::shrink_tensor_ops(xs, slices, mapping)
}
