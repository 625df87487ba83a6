//! CUDA expand (feature `cuda`): [`Expand`]'s `cuda_fwd`, one host plan and one launch of
//! `lora_expand` of `multilora-kernels` per group of segments on the layer output, reading either
//! one reduced `[n_lora, ≥ r_i]` tensor per slice (the public `lora_expand`) or the shared shrink
//! buffer `[k_split, n_lora, s_width]` (partials summed by the kernel) of the layer's fused path
//! (`cuda_fused_fwd`: [`Shrink`]'s shrink with the plan's K split, then this expand) and of the
//! embedding. The launch is a candle in-place op (`ExpandKernel`), so candle holds the locks on
//! the tensors it reads and writes.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, InplaceOp1, Layout, Tensor};
use multilora_kernels::params::MAX_SLICES;
use multilora_kernels::{Module, kernel};

use super::Expand;
use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::bgmv::BgmvPlan;
use crate::ops::cuda::{Locked, kernel_dtype, launch, write_ptr};
use crate::ops::plan::{ExpandPtrs, SegmentedPlan};
use crate::ops::shrink::Shrink;
use crate::ops::shrink::cuda::{bgmv_meta, mapping_meta};
use crate::slots::LoraSlots;

impl Expand<'_> {
    /// The CUDA forward: `y` plus every slice's delta from the reduced shrink outputs `s`, `y`
    /// updated in place (made contiguous first if it is not).
    pub(super) fn cuda_fwd(&self, y: Tensor, s: &[Tensor]) -> Result<Tensor> {
        let plan = SegmentedPlan::for_layer(self.mapping, self.slices, Some(1))?;
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
        self.launch(&y, &plan, ShrinkRows::PerSlice(&s))?;
        Ok(y)
    }

    /// The layer's CUDA forward, `shrink`'s shrink of `x` first: `y` (the fresh base output) plus
    /// `Σ_i expand_i(shrink_i(x))`, the shrink splitting K as the step needs and the expand
    /// summing the partials, `y` updated in place.
    /// A decode-shaped step runs the BGMV kernels (launches independent of which rows use which
    /// adapter, no memset); others the segmented ones.
    pub(crate) fn cuda_fused_fwd(&self, shrink: &Shrink<'_>, x: &Tensor, y: Tensor) -> Result<Tensor> {
        if let Some(plan) = BgmvPlan::for_layer(self.mapping, self.slices) {
            let s = shrink.cuda_bgmv(x, &plan)?;
            let y = if y.is_contiguous() { y } else { y.contiguous()? };
            bgmv_expand(&y, &s, &plan, self.slices, self.mapping)?;
            return Ok(y);
        }
        let plan = SegmentedPlan::for_layer(self.mapping, self.slices, None)?;
        if !plan.has_work() {
            return Ok(y);
        }
        // The expand reads each row's columns below its rank only: no memset before the shrink.
        let s = shrink.cuda_shared(x, &plan, crate::ops::shrink::cuda::Zeroed::No)?;
        let y = if y.is_contiguous() { y } else { y.contiguous()? };
        self.launch(&y, &plan, ShrinkRows::Shared(&s))?;
        Ok(y)
    }

    /// `y += expand(s)` in place over `plan`, from the shared buffer `s` (the embedding's gather).
    pub(crate) fn cuda_shared_fwd(&self, y: Tensor, plan: &SegmentedPlan, s: &Tensor) -> Result<Tensor> {
        let y = if y.is_contiguous() { y } else { y.contiguous()? };
        self.launch(&y, plan, ShrinkRows::Shared(s))?;
        Ok(y)
    }

    fn launch(&self, y: &Tensor, plan: &SegmentedPlan, s: ShrinkRows<'_>) -> Result<()> {
        let kernel = ExpandKernel { plan, slices: self.slices, mapping: self.mapping, s };
        Ok(y.inplace_op1(&kernel)?)
    }
}

/// Where the expand reads its shrink rows from.
#[derive(Clone, Copy, Debug)]
enum ShrinkRows<'a> {
    /// The fused path's shared buffer.
    Shared(&'a Tensor),
    /// One row-major tensor per slice (inner stride 1).
    PerSlice(&'a [Tensor]),
}

/// The launch of [`Expand::cuda_fwd`]: `y += expand(s)` in place for every slice of a layer.
struct ExpandKernel<'a> {
    plan: &'a SegmentedPlan,
    slices: &'a [&'a LoraSlots],
    mapping: &'a LoraMapping,
    s: ShrinkRows<'a>,
}

impl InplaceOp1 for ExpandKernel<'_> {
    fn name(&self) -> &'static str {
        "multilora-lora-expand"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("multilora-lora-expand is the CUDA launch; the CPU runs Expand::cpu_fwd")
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

/// `y += expand(s)` in place (`y` contiguous) with the decode-shaped expand, from `plan`'s shrink
/// buffer `s`.
pub(crate) fn bgmv_expand(
    y: &Tensor,
    s: &Tensor,
    plan: &BgmvPlan,
    slices: &[&LoraSlots],
    mapping: &LoraMapping,
) -> Result<()> {
    Ok(y.inplace_op1(&BgmvExpandKernel { plan, slices, mapping, s })?)
}

/// The launch of the decode-shaped expand: `y += expand(s)` in place from the BGMV shrink's buffer.
struct BgmvExpandKernel<'a> {
    plan: &'a BgmvPlan,
    slices: &'a [&'a LoraSlots],
    mapping: &'a LoraMapping,
    s: &'a Tensor,
}

impl InplaceOp1 for BgmvExpandKernel<'_> {
    fn name(&self) -> &'static str {
        "multilora-lora-expand-bgmv"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("multilora-lora-expand-bgmv is the CUDA launch; the CPU runs Expand::cpu_fwd")
    }

    fn cuda_fwd(&self, y: &mut CudaStorage, yl: &Layout) -> candle_core::Result<()> {
        let dev = y.device.clone();
        let stream = dev.cuda_stream();
        let (rows, table) = bgmv_meta(self.mapping)?;
        let n = self.mapping.num_lora_rows();
        let k = self.slices.len();
        let mut read: Vec<&Tensor> = self.slices.iter().map(|s| s.b()).collect();
        read.extend([rows, table, self.s]);
        let locked = Locked::new(&read);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let mut col_off = Vec::with_capacity(k);
        let mut at = 0;
        for s in self.slices {
            col_off.push(at);
            at += s.out_features();
        }
        let y_stride = yl.stride()[0];
        let tx = kernel_dtype(y.dtype())?;
        let (yp, _ys) = write_ptr(y, yl, &stream)?;
        let l = self
            .plan
            .expand((yp, y_stride), (ptrs[k], ptrs[k + 1]), &ptrs[..k], ptrs[k + 2], n, &col_off)
            .map_err(candle_core::Error::wrap)?;
        let name = kernel::lora_expand_bgmv(tx, kernel_dtype(self.slices[0].dtype())?, self.plan.rank);
        launch(&dev, Module::LoraBgmv, &name, &l)?;
        drop((_ys, _syncs));
        Ok(())
    }
}
