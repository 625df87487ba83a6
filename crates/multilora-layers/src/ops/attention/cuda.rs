//! CUDA decode attention (feature `cuda`): a candle custom op on `q` whose `cuda_fwd` launches,
//! over the caches, block tables and context lengths, the split kernel
//! (`paged_decode_split_<t>_d<head_dim>`, then `paged_decode_reduce_…` when the context has more
//! than one partition) for the head sizes it is built for, `paged_decode_<t>_d<head_dim>`
//! otherwise.

use candle_core::DType;
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, CustomOp1, Layout, Shape, Tensor};
use multilora_kernels::{Module, kernel};

use super::split::split_plan;
use super::{PagedDecodeDims, decode_params};
use crate::error::Result;
use crate::ops::cuda::{Locked, alloc_written, kernel_dtype, launch, read_ptr, write_ptr};
use crate::ops::plan::Launch;

struct DecodeOp<'a> {
    k: &'a Tensor,
    v: &'a Tensor,
    block_tables: &'a Tensor,
    ctx_lens: &'a Tensor,
    n: usize,
    max_blocks: usize,
    dims: PagedDecodeDims,
}

impl CustomOp1 for DecodeOp<'_> {
    fn name(&self) -> &'static str {
        "multilora-paged-decode"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-paged-decode is the CUDA op; the CPU attends in multilora-models")
    }

    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = q.device.clone();
        let stream = dev.cuda_stream();
        let d = self.dims;
        let shape = Shape::from((self.n, d.heads * d.head_dim));
        let t = kernel_dtype(q.dtype())?;
        // Both kernels write every head of every sequence: no memset first.
        let mut out = alloc_written(&dev, shape.elem_count(), q.dtype())?;
        let locked = Locked::new(&[self.k, self.v, self.block_tables, self.ctx_lens]);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (qp, _qs) = read_ptr(q, ql, &stream)?;
        // The split kernel reads q, K and V 16 bytes at a time: their first elements must be
        // 16-byte aligned (fresh tensors are; a view starting elsewhere takes the other kernel).
        let aligned = [qp, ptrs[0], ptrs[1]].iter().all(|p| p.is_multiple_of(16)) && ql.stride()[0].is_multiple_of(8);
        // The operands both kernels' parameters name alike (two C structs, the same fields).
        macro_rules! operands {
            ($p:expr) => {
                $p.q = qp;
                $p.k_cache = ptrs[0];
                $p.v_cache = ptrs[1];
                $p.block_tables = ptrs[2];
                $p.ctx_lens = ptrs[3];
                $p.q_stride = ql.stride()[0] as u32;
            };
        }
        let plan = split_plan(self.n, self.max_blocks, d);
        let names = plan.and_then(|p| kernel::paged_decode_split(t, d.head_dim, p.heads_per_block));
        if let (true, Some(mut plan), Some((split, reduce))) = (aligned, plan, names) {
            // Scratch for the partitions' results: every element the reduce reads is written by
            // the split kernel first (a partition the context reaches writes all of its own).
            let mut acc = alloc_written(&dev, plan.acc_len.max(1), DType::F32)?;
            let mut ml = alloc_written(&dev, plan.ml_len.max(1), DType::F32)?;
            let (ap, _as) = write_ptr(&mut acc, &Layout::contiguous(plan.acc_len.max(1)), &stream)?;
            let (mp, _ms) = write_ptr(&mut ml, &Layout::contiguous(plan.ml_len.max(1)), &stream)?;
            let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
            for p in std::iter::once(&mut plan.split.params).chain(plan.reduce.as_mut().map(|r| &mut r.params)) {
                operands!(p);
                p.out = op;
                p.part_acc = ap;
                p.part_ml = mp;
            }
            launch(&dev, Module::PagedDecodeSplit, &split, &plan.split)?;
            if let Some(r) = &plan.reduce {
                launch(&dev, Module::PagedDecodeSplit, &reduce, r)?;
            }
            drop((_os, _ms, _as));
            drop((_qs, _syncs));
            return Ok((out, shape));
        }
        let (grid, block, mut params) = decode_params(self.n, self.max_blocks, d);
        operands!(params);
        let name = kernel::paged_decode(t, d.head_dim)
            .ok_or_else(|| candle_core::Error::Msg(format!("no decode kernel for head_dim {}", d.head_dim)))?;
        {
            let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
            params.out = op;
            launch(&dev, Module::PagedAttention, &name, &Launch { grid, block, params })?;
        }
        drop((_qs, _syncs));
        Ok((out, shape))
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    block_tables: &Tensor,
    ctx_lens: &Tensor,
    n: usize,
    max_blocks: usize,
    dims: PagedDecodeDims,
) -> Result<Tensor> {
    let q = q.contiguous()?;
    let (block_tables, ctx_lens) = (block_tables.contiguous()?, ctx_lens.contiguous()?);
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let op = DecodeOp { k: &k, v: &v, block_tables: &block_tables, ctx_lens: &ctx_lens, n, max_blocks, dims };
    Ok(q.apply_op1_no_bwd(&op)?)
}
