//! The fused kernels' launches (feature `cuda`), as candle custom ops on the tensor each one
//! reads first, so candle holds its lock; the other operands are locked for the launch too.
//!
//! `rope_kv_write` writes the two caches through addresses taken under read locks: candle's lock
//! guards the storage object, not the device bytes, and every use of a cache runs on the device's
//! one stream (event tracking is off, `prepare_cuda_device`), which orders this write before the
//! attention that reads the rows.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, CustomOp1, Layout, Shape, Tensor};
use multilora_kernels::{Module, kernel};

use super::{GreedyPick, add_norm_launch, greedy_launch, rope_kv_launch, silu_mul_launch};
use crate::error::Result;
use crate::ops::attention::PagedDecodeDims;
use crate::ops::cuda::{Locked, alloc_written, kernel_dtype, launch, read_ptr, row_major, write_ptr};

/// [`super::rope_kv_write`]'s launch, on `qkv`.
struct RopeKv<'a> {
    cos: &'a Tensor,
    sin: &'a Tensor,
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    slots: &'a Tensor,
    d: PagedDecodeDims,
    q_scale: f32,
}

impl CustomOp1 for RopeKv<'_> {
    fn name(&self) -> &'static str {
        "multilora-rope-kv-write"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-rope-kv-write is the CUDA launch; the CPU runs kv_write::cpu::rope_write_kv")
    }

    fn cuda_fwd(&self, qkv: &CudaStorage, ql: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = qkv.device.clone();
        let stream = dev.cuda_stream();
        let d = self.d;
        let tokens = ql.shape().dims2()?.0;
        let shape = Shape::from((tokens, d.heads, d.head_dim));
        // Every query of every token is written.
        let mut out = alloc_written(&dev, shape.elem_count(), qkv.dtype())?;
        let locked = Locked::new(&[self.cos, self.sin, self.k_cache, self.v_cache, self.slots]);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (qp, _qs) = read_ptr(qkv, ql, &stream)?;
        let rows = self.k_cache.dim(0)?;
        let mut l = rope_kv_launch(tokens, d, ql.stride()[0], rows, self.q_scale).map_err(candle_core::Error::wrap)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        l.params.qkv = qp;
        (l.params.cos, l.params.sin, l.params.k_cache, l.params.v_cache, l.params.slots) =
            (ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4]);
        l.params.q_out = op;
        launch(&dev, Module::Fused, &kernel::rope_kv_write(kernel_dtype(qkv.dtype())?), &l)?;
        drop((_os, _qs, _syncs));
        Ok((out, shape))
    }
}

/// [`super::rope_kv_write`] on CUDA (operands checked there).
pub(crate) fn rope_kv_write(
    qkv: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    d: PagedDecodeDims,
    (k_cache, v_cache): (&Tensor, &Tensor),
    slots: &Tensor,
    q_scale: f32,
) -> Result<Tensor> {
    let (cos, sin, slots) = (cos.contiguous()?, sin.contiguous()?, slots.contiguous()?);
    if !k_cache.is_contiguous() || !v_cache.is_contiguous() {
        return Err(crate::error::Error::InvalidLayer {
            module: "rope_kv_write".into(),
            reason: "the caches must be contiguous".into(),
        });
    }
    let op = RopeKv { cos: &cos, sin: &sin, k_cache, v_cache, slots: &slots, d, q_scale };
    Ok(row_major(qkv)?.apply_op1_no_bwd(&op)?)
}

/// The add and norm's launch, on `x`: the sum and the normed rows as one `[2, rows, cols]` tensor.
struct AddNorm<'a> {
    delta: &'a Tensor,
    alpha: &'a Tensor,
    eps: f32,
}

impl CustomOp1 for AddNorm<'_> {
    fn name(&self) -> &'static str {
        "multilora-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-add-rms-norm is the CUDA launch; the CPU runs norm::add_rms_norm")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device.clone();
        let stream = dev.cuda_stream();
        let (rows, cols) = xl.shape().dims2()?;
        let shape = Shape::from((2, rows, cols));
        // The kernel writes every element of both halves.
        let mut out = alloc_written(&dev, shape.elem_count(), x.dtype())?;
        let locked = Locked::new(&[self.delta, self.alpha]);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (xp, _xs) = read_ptr(x, xl, &stream)?;
        let mut l = add_norm_launch(rows, cols, (xl.stride()[0], self.delta.stride()[0]), self.eps)
            .map_err(candle_core::Error::wrap)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        let half = (rows * cols * x.dtype().size_in_bytes()) as u64;
        (l.params.x, l.params.residual, l.params.weight, l.params.sum, l.params.out) =
            (xp, ptrs[0], ptrs[1], op, op + half);
        launch(&dev, Module::Fused, &kernel::add_rms_norm(kernel_dtype(x.dtype())?), &l)?;
        drop((_os, _xs, _syncs));
        Ok((out, shape))
    }
}

/// `(x + delta, rms_norm(x + delta))` on CUDA: two views of one buffer.
pub(crate) fn add_rms_norm(x: &Tensor, delta: &Tensor, alpha: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let (delta, alpha) = (row_major(delta)?, alpha.contiguous()?);
    let both = row_major(x)?.apply_op1_no_bwd(&AddNorm { delta: &delta, alpha: &alpha, eps })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// SiLU times up's launch, on `gu`.
struct SiluMul {
    inter: usize,
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "multilora-silu-mul"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-silu-mul is the CUDA launch; the CPU runs swiglu::silu_mul")
    }

    fn cuda_fwd(&self, gu: &CudaStorage, gl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = gu.device.clone();
        let stream = dev.cuda_stream();
        let rows = gl.shape().dims2()?.0;
        let shape = Shape::from((rows, self.inter));
        // Every element is written.
        let mut out = alloc_written(&dev, shape.elem_count(), gu.dtype())?;
        let (gp, _gs) = read_ptr(gu, gl, &stream)?;
        let mut l = silu_mul_launch(rows, self.inter, gl.stride()[0]).map_err(candle_core::Error::wrap)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        (l.params.gu, l.params.out) = (gp, op);
        launch(&dev, Module::Fused, &kernel::silu_mul(kernel_dtype(gu.dtype())?), &l)?;
        drop((_os, _gs));
        Ok((out, shape))
    }
}

/// `silu(gu[:, ..inter]) · gu[:, inter..]` on CUDA.
pub(crate) fn silu_mul(gu: &Tensor, inter: usize) -> Result<Tensor> {
    Ok(row_major(gu)?.apply_op1_no_bwd(&SiluMul { inter })?)
}

/// The greedy picks' launch, on the logits.
struct Greedy<'a> {
    rows: &'a Tensor,
}

impl CustomOp1 for Greedy<'_> {
    fn name(&self) -> &'static str {
        "multilora-greedy-rows"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("multilora-greedy-rows is the CUDA launch; the CPU reads the rows and picks on the host")
    }

    fn cuda_fwd(&self, logits: &CudaStorage, ll: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = logits.device.clone();
        let stream = dev.cuda_stream();
        let vocab = ll.shape().dims2()?.1;
        let count = self.rows.dim(0)?;
        let shape = Shape::from((count, 2));
        // Every selected row's two words are written.
        let mut out = alloc_written(&dev, shape.elem_count(), candle_core::DType::U32)?;
        let locked = Locked::new(&[self.rows]);
        let (ptrs, _syncs) = locked.ptrs(&stream)?;
        let (lp, _ls) = read_ptr(logits, ll, &stream)?;
        let mut l = greedy_launch(count, vocab, ll.stride()[0]).map_err(candle_core::Error::wrap)?;
        let (op, _os) = write_ptr(&mut out, &Layout::contiguous(&shape), &stream)?;
        (l.params.logits, l.params.rows, l.params.out) = (lp, ptrs[0], op);
        launch(&dev, Module::Fused, kernel::GREEDY_ROWS, &l)?;
        drop((_os, _ls, _syncs));
        Ok((out, shape))
    }
}

/// [`super::greedy_rows`] on CUDA: the rows uploaded, one launch, `count · 8` bytes back.
pub(crate) fn greedy_rows(logits: &Tensor, rows: &[usize]) -> Result<Vec<GreedyPick>> {
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let idx = Tensor::from_vec(idx, rows.len(), logits.device())?;
    let out = row_major(logits)?.apply_op1_no_bwd(&Greedy { rows: &idx })?;
    Ok(out.to_vec2::<u32>()?.into_iter().map(|w| GreedyPick { token: w[0], logprob: f32::from_bits(w[1]) }).collect())
}
