//! CUDA KV write (feature `cuda`): an in-place candle op on each cache (`KvWriteOp`) whose
//! `cuda_fwd` launches `paged_kv_write` with the step's new rows and slot mapping; candle holds the
//! write lock on the cache and read locks on the rows and the slots for the launch.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, InplaceOp3, Layout, Tensor};
use multilora_kernels::{Module, kernel};

use super::kv_write_launch;
use crate::error::Result;
use crate::ops::cuda::{launch, read_ptr, row_major, write_ptr};

/// `cache[slots[t]] = src[t]`: the cache is the op's in-place operand, then `src`, then `slots`.
struct KvWriteOp;

impl InplaceOp3 for KvWriteOp {
    fn name(&self) -> &'static str {
        "multilora-paged-kv-write"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("multilora-paged-kv-write is the CUDA op; the CPU scatters with tensor ops")
    }

    fn cuda_fwd(
        &self,
        cache: &mut CudaStorage,
        cl: &Layout,
        src: &CudaStorage,
        sl: &Layout,
        slots: &CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<()> {
        if !cl.is_contiguous() || sl.stride().get(1) != Some(&1) || !tl.is_contiguous() {
            candle_core::bail!("paged_kv_write: the cache and the slots must be contiguous, the rows' elements too");
        }
        let (rows, width) = cl.shape().dims2()?;
        let tokens = tl.shape().dims1()?;
        let mut l =
            kv_write_launch(tokens, width, sl.stride()[0], cache.dtype(), rows).map_err(candle_core::Error::wrap)?;
        let dev = cache.device.clone();
        let stream = dev.cuda_stream();
        let (sp, _ss) = read_ptr(src, sl, &stream)?;
        let (tp, _ts) = read_ptr(slots, tl, &stream)?;
        let (cp, _cs) = write_ptr(cache, cl, &stream)?;
        l.params.src = sp;
        l.params.slots = tp;
        l.params.cache = cp;
        launch(&dev, Module::KvWrite, kernel::PAGED_KV_WRITE, &l)
    }
}

/// [`super::paged_kv_write`] on CUDA: one launch for K, one for V.
pub(crate) fn kv_write(cache_k: &Tensor, cache_v: &Tensor, k: &Tensor, v: &Tensor, slots: &Tensor) -> Result<()> {
    let slots = slots.contiguous()?;
    cache_k.inplace_op3(&row_major(k)?, &slots, &KvWriteOp)?;
    cache_v.inplace_op3(&row_major(v)?, &slots, &KvWriteOp)?;
    Ok(())
}
