//! CUDA expand (feature `cuda`): a candle in-place op whose `cuda_fwd` launches `lora_expand` of
//! `multilora-kernels` on the layer output, reading either the shared shrink buffer of the fused
//! path (`[k_split, n_lora, s_width]`, partials summed by the kernel) or one reduced
//! `[n_lora, ≥ r_i]` tensor per slice (the public `lora_expand`).

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, InplaceOp1, Layout, Tensor};
use multilora_kernels::params::MAX_SLICES;
use multilora_kernels::{Module, kernel};

use crate::mapping::LoraMapping;
use crate::ops::cuda::{Locked, kernel_dtype, launch, write_ptr};
use crate::ops::plan::{ExpandPtrs, SegmentedPlan};
use crate::ops::shrink::cuda::mapping_meta;
use crate::slots::LoraSlots;

/// Where the expand reads its shrink rows from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ShrinkRows<'a> {
    /// The fused path's shared buffer.
    Shared(&'a Tensor),
    /// One row-major tensor per slice (inner stride 1).
    PerSlice(&'a [Tensor]),
}

/// `y += expand(s)` in place for every slice of a layer.
pub(crate) struct ExpandOp<'a> {
    pub(crate) plan: &'a SegmentedPlan,
    pub(crate) slices: &'a [&'a LoraSlots],
    pub(crate) mapping: &'a LoraMapping,
    pub(crate) s: ShrinkRows<'a>,
}

impl InplaceOp1 for ExpandOp<'_> {
    fn name(&self) -> &'static str {
        "multilora-lora-expand"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("multilora-lora-expand is the CUDA op; the CPU runs ops/expand/cpu.rs")
    }

    fn cuda_fwd(&self, y: &mut CudaStorage, yl: &Layout) -> candle_core::Result<()> {
        let dev = y.device.clone();
        let stream = dev.cuda_stream();
        let (rows, tiles) = mapping_meta(self.mapping)?;
        let n = self.mapping.num_lora_rows();
        let k = self.slices.len();
        let mut read: Vec<&Tensor> = self.slices.iter().map(|s| s.b()).collect();
        read.extend([rows, tiles]);
        match self.s {
            ShrinkRows::Shared(t) => read.push(t),
            ShrinkRows::PerSlice(ts) => read.extend(ts.iter()),
        }
        let locked = Locked::new(&read);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (meta_rows, meta_tiles) = (ptrs[k], ptrs[k + 1]);
        let y_stride = yl.stride()[0];
        let tx = kernel_dtype(y.dtype())?;
        let (yp, _ys) = write_ptr(y, yl, &stream)?;
        let p = match self.s {
            ShrinkRows::Shared(_) => {
                ExpandPtrs::shared_input(self.plan, (yp, y_stride), (meta_rows, meta_tiles), &ptrs[..k], ptrs[k + 2], n)
            }
            ShrinkRows::PerSlice(ts) => {
                let mut p = ExpandPtrs {
                    y: yp,
                    y_stride,
                    rows: meta_rows,
                    tiles: meta_tiles,
                    k_split: 1,
                    ..Default::default()
                };
                for (i, t) in ts.iter().enumerate().take(MAX_SLICES) {
                    p.b[i] = ptrs[i];
                    p.s[i] = ptrs[k + 2 + i];
                    p.s_stride[i] = t.stride()[0];
                }
                p
            }
        };
        let mut col_off = Vec::with_capacity(k);
        let mut at = 0;
        for s in self.slices {
            col_off.push(at);
            at += s.out_features();
        }
        let name = kernel::lora_expand(tx, kernel_dtype(self.slices[0].dtype())?);
        for l in self.plan.expand(&p, &col_off).map_err(candle_core::Error::wrap)? {
            launch(&dev, Module::LoraExpand, &name, &l)?;
        }
        drop((_ys, _syncs));
        Ok(())
    }
}
