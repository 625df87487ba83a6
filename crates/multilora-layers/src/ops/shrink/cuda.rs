//! CUDA shrink (feature `cuda`): [`Shrink`]'s `cuda_fwd`, one host plan and one launch of
//! `lora_shrink` of `multilora-kernels` per group of segments, into one f32 buffer
//! `[k_split, n_lora, s_width]` shared by the slices (slice `i` at column `plan.s_offsets[i]`;
//! zeroed first for the op's own output, not for the layer's fused path, whose expand reads only
//! what the shrink writes: each row's columns below its adapter's rank);
//! and the embedding's gather (`lora_embed_shrink`), into the same kind of buffer. The launches
//! are candle custom ops (`ShrinkKernel`, `EmbedShrinkKernel`), so candle holds the locks on the
//! tensors they read and write.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, CustomOp1, DType, Layout, Shape, Tensor};
use multilora_kernels::params::{EmbedShrinkParams, MAX_SEGS};
use multilora_kernels::{Module, kernel};

use super::Shrink;
use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::bgmv::BgmvPlan;
use crate::ops::cuda::{Locked, alloc_written, kernel_dtype, launch, read_ptr, write_ptr};
use crate::ops::plan::{Launch, SegmentedPlan, ShrinkPtrs};
use crate::slots::LoraSlots;

impl Shrink<'_> {
    /// The CUDA forward: one `[lora_rows, r_i]` f32 tensor per slice, views of one buffer.
    pub(super) fn cuda_fwd(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let plan = SegmentedPlan::for_layer(self.mapping, self.slices, Some(1))?;
        let n = self.mapping.num_lora_rows();
        if !plan.has_work() {
            return self.slices.iter().map(|_| Ok(Tensor::zeros((n, 0), DType::F32, x.device())?)).collect();
        }
        let s = self.cuda_shared(x, &plan, Zeroed::Yes)?.squeeze(0)?;
        (0..self.slices.len()).map(|i| Ok(s.narrow(1, plan.s_offsets[i], plan.active[i])?)).collect()
    }

    /// The shrink into `plan`'s shared buffer `[k_split, n_lora, s_width]` (partial sums over the
    /// K split, which the expand adds up): what the layer's fused path expands from. With
    /// [`Zeroed::No`] the columns of a row past its adapter's rank in a slice are left as the
    /// allocation had them: only the segmented expand, which never reads them, may take it.
    pub(crate) fn cuda_shared(&self, x: &Tensor, plan: &SegmentedPlan, zeroed: Zeroed) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(x.apply_op1_no_bwd(&ShrinkKernel { plan, slices: self.slices, mapping: self.mapping, zeroed })?)
    }
}

impl Shrink<'_> {
    /// The decode-shaped shrink into `plan`'s buffer `[k_split, n_lora, s_width]`, every element
    /// written by the kernel (no memset).
    pub(crate) fn cuda_bgmv(&self, x: &Tensor, plan: &BgmvPlan) -> Result<Tensor> {
        let x = if x.stride().get(1) == Some(&1) { x.clone() } else { x.contiguous()? };
        Ok(x.apply_op1_no_bwd(&BgmvShrinkKernel { plan, slices: self.slices, mapping: self.mapping })?)
    }
}

/// The launch of [`Shrink::cuda_bgmv`].
struct BgmvShrinkKernel<'a> {
    plan: &'a BgmvPlan,
    slices: &'a [&'a LoraSlots],
    mapping: &'a LoraMapping,
}

/// The mapping's device row index and slot table.
pub(crate) fn bgmv_meta(mapping: &LoraMapping) -> candle_core::Result<(&Tensor, &Tensor)> {
    match (mapping.lora_index(), mapping.slot_index()) {
        (Some(r), Some(t)) => Ok((r, t)),
        _ => candle_core::bail!("decode lora kernels called for a mapping without lora rows or slot table"),
    }
}

impl CustomOp1 for BgmvShrinkKernel<'_> {
    fn name(&self) -> &'static str {
        "multilora-lora-shrink-bgmv"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-lora-shrink-bgmv is the CUDA launch; the CPU runs Shrink::cpu_fwd")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = &x.device;
        let stream = dev.cuda_stream();
        let (rows, table) = bgmv_meta(self.mapping)?;
        let n = self.mapping.num_lora_rows();
        let shape = Shape::from((self.plan.k_split, n, self.plan.s_width));
        let mut out = alloc_written(dev, shape.elem_count(), DType::F32)?;
        let mut a: Vec<&Tensor> = self.slices.iter().map(|s| s.a()).collect();
        a.extend([rows, table]);
        let locked = Locked::new(&a);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let k = self.slices.len();
        let (xp, _xs) = read_ptr(x, xl, &stream)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        let l = self
            .plan
            .shrink((xp, xl.stride()[0]), (ptrs[k], ptrs[k + 1]), &ptrs[..k], op, n)
            .map_err(candle_core::Error::wrap)?;
        let name =
            kernel::lora_shrink_bgmv(kernel_dtype(x.dtype())?, kernel_dtype(self.slices[0].dtype())?, self.plan.rank);
        launch(dev, Module::LoraBgmv, &name, &l)?;
        drop((_os, _xs, _syncs));
        Ok((out, shape))
    }
}

/// Whether the segmented shrink's buffer is zeroed before the launch writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Zeroed {
    /// Every element defined (zero past each row's rank): the op's own output.
    Yes,
    /// Only what the kernel writes: for the segmented expand, which reads nothing else.
    No,
}

/// The launch of [`Shrink::cuda_fwd`]: `x → s` for every slice of a layer.
struct ShrinkKernel<'a> {
    plan: &'a SegmentedPlan,
    slices: &'a [&'a LoraSlots],
    mapping: &'a LoraMapping,
    zeroed: Zeroed,
}

/// The mapping's device row index and tiles.
pub(crate) fn mapping_meta(mapping: &LoraMapping) -> candle_core::Result<(&Tensor, &Tensor)> {
    match (mapping.lora_index(), mapping.tile_index()) {
        (Some(r), Some(t)) => Ok((r, t)),
        _ => candle_core::bail!("lora kernels called for a mapping without lora rows"),
    }
}

impl CustomOp1 for ShrinkKernel<'_> {
    fn name(&self) -> &'static str {
        "multilora-lora-shrink"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-lora-shrink is the CUDA launch; the CPU runs Shrink::cpu_fwd")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = &x.device;
        let stream = dev.cuda_stream();
        let (rows, tiles) = mapping_meta(self.mapping)?;
        let n = self.mapping.num_lora_rows();
        let shape = Shape::from((self.plan.k_split, n, self.plan.s_width));
        let mut out = match self.zeroed {
            Zeroed::Yes => CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(shape.elem_count())?, dev.clone()),
            Zeroed::No => alloc_written(dev, shape.elem_count(), DType::F32)?,
        };
        let mut a: Vec<&Tensor> = self.slices.iter().map(|s| s.a()).collect();
        a.extend([rows, tiles]);
        let locked = Locked::new(&a);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (meta_rows, meta_tiles) = (ptrs[ptrs.len() - 2], ptrs[ptrs.len() - 1]);
        let (xp, _xs) = read_ptr(x, xl, &stream)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        let x_stride = xl.stride()[0];
        let p = ShrinkPtrs::shared_output(
            self.plan,
            (xp, x_stride),
            (meta_rows, meta_tiles),
            &ptrs[..self.slices.len()],
            op,
            n,
        );
        let name = kernel::lora_shrink(kernel_dtype(x.dtype())?, kernel_dtype(self.slices[0].dtype())?);
        for l in self.plan.shrink(&p).map_err(candle_core::Error::wrap)? {
            launch(dev, Module::LoraShrink, &name, &l)?;
        }
        drop((_os, _xs, _syncs));
        Ok((out, shape))
    }
}

/// The embedding's shrink on CUDA: `ids → s` (`[1, n_lora, s_width]`, f32), a gather from the
/// transposed A slots, for the expand to add.
pub(crate) fn embed_shrink(
    ids: &Tensor,
    slots: &LoraSlots,
    mapping: &LoraMapping,
    plan: &SegmentedPlan,
) -> Result<Tensor> {
    let ids = ids.contiguous()?;
    Ok(ids.apply_op1_no_bwd(&EmbedShrinkKernel { plan, slots, mapping })?.unsqueeze(0)?)
}

/// The launch of [`embed_shrink`].
struct EmbedShrinkKernel<'a> {
    plan: &'a SegmentedPlan,
    slots: &'a LoraSlots,
    mapping: &'a LoraMapping,
}

impl CustomOp1 for EmbedShrinkKernel<'_> {
    fn name(&self) -> &'static str {
        "multilora-lora-embed-shrink"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-lora-embed-shrink is the CUDA launch; the CPU gathers with tensor ops")
    }

    fn cuda_fwd(&self, ids: &CudaStorage, il: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = &ids.device;
        let stream = dev.cuda_stream();
        let (rows, tiles) = mapping_meta(self.mapping)?;
        let n = self.mapping.num_lora_rows();
        let shape = Shape::from((n, self.plan.s_width));
        let mut out = CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(shape.elem_count())?, dev.clone());
        let locked = Locked::new(&[self.slots.a(), rows, tiles]);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (idp, _is) = read_ptr(ids, il, &stream)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        let name = kernel::lora_embed_shrink(kernel_dtype(self.slots.dtype())?);
        for g in &self.plan.groups {
            let mut p = EmbedShrinkParams::zeroed();
            p.ids = idp;
            p.rows = ptrs[1];
            p.tiles = ptrs[2];
            p.a_t = ptrs[0];
            p.out = op;
            p.vocab = self.slots.in_features() as u32;
            p.max_rank = self.slots.max_rank() as u32;
            p.out_stride = self.plan.s_width as u32;
            p.tile_base = g.tile_base;
            p.seg_base = g.seg_base;
            p.rank = g.rank[0];
            debug_assert_eq!(p.rank.len(), MAX_SEGS);
            launch(
                dev,
                Module::LoraEmbed,
                &name,
                &Launch { grid: [g.num_tiles, 1, 1], block: [128, 1, 1], params: p },
            )?;
        }
        drop((_os, _is, _syncs));
        Ok((out, shape))
    }
}
