//! A step's small integer tables on their way to the device: [`StepMeta`] gathers them on the host
//! (token ids, positions, cache rows, block tables, the LoRA mappings' indexes: all `u32`), each
//! [`MetaPart`] saying where one table lies; [`MetaToDevice::upload`] puts the whole of it on the
//! device in one copy, and [`Uploaded::part`] hands each table back as a view of that one tensor.
//!
//! On CUDA the copy goes from a page-locked staging buffer that the uploader keeps (grown when a
//! step needs more, never shrunk, released on `Drop`): one asynchronous DMA a step, where a copy
//! from pageable memory is staged by the driver and waits for the host. The buffer is rewritten
//! only once the previous step's copy out of it has completed (an event recorded after each copy
//! and waited on before the next write). Elsewhere the upload is one `Tensor::from_vec`.

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// Where one table lies in a [`StepMeta`]: `len` values from `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaPart {
    start: usize,
    len: usize,
}

impl MetaPart {
    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A step's `u32` tables gathered on the host, one after the other.
#[derive(Clone, Debug, Default)]
pub struct StepMeta {
    host: Vec<u32>,
}

impl StepMeta {
    /// No table yet.
    pub fn new() -> StepMeta {
        StepMeta::default()
    }

    /// Appends one table; returns where it lies.
    pub fn push(&mut self, values: impl IntoIterator<Item = u32>) -> MetaPart {
        let start = self.host.len();
        self.host.extend(values);
        MetaPart { start, len: self.host.len() - start }
    }

    /// The values of every table, in order.
    pub fn values(&self) -> &[u32] {
        &self.host
    }

    /// The values of one table.
    pub fn part(&self, p: MetaPart) -> &[u32] {
        &self.host[p.start..p.start + p.len]
    }
}

/// A [`StepMeta`] on its device: one `u32` tensor, handed out as views.
#[derive(Clone, Debug)]
pub struct Uploaded {
    all: Option<Tensor>,
    device: Device,
}

impl Uploaded {
    /// The tables of `meta` on `device` through plain memory: `Tensor::from_vec` (for a mapping
    /// built on its own, outside a step; a step goes through [`MetaToDevice`]).
    pub fn plain(meta: StepMeta, device: &Device) -> Result<Uploaded> {
        let n = meta.host.len();
        let all = if n == 0 { None } else { Some(Tensor::from_vec(meta.host, n, device)?) };
        Ok(Uploaded { all, device: device.clone() })
    }

    /// One table as a view of the uploaded tensor (`u32 [len]`; an empty table, an empty tensor).
    pub fn part(&self, p: MetaPart) -> Result<Tensor> {
        let n = self.all.as_ref().map_or(Ok(0), |t| t.dim(0))?;
        match &self.all {
            _ if p.start + p.len > n => Err(Error::InvalidLayer {
                module: "step metadata".to_string(),
                reason: format!("table of {} values at {} is not in the upload of {n}", p.len, p.start),
            }),
            Some(t) if p.len > 0 => Ok(t.narrow(0, p.start, p.len)?),
            _ => Ok(Tensor::zeros(0, candle_core::DType::U32, &self.device)?),
        }
    }
}

/// Puts each step's [`StepMeta`] on the model's device in one copy; one per model.
#[derive(Debug, Default)]
pub struct MetaToDevice {
    #[cfg(feature = "cuda")]
    staging: std::sync::Mutex<cuda::Staging>,
}

impl MetaToDevice {
    /// An uploader with no staging buffer yet (the first CUDA upload allocates it).
    pub fn new() -> MetaToDevice {
        MetaToDevice::default()
    }

    /// `meta` on `device`, in one host-to-device copy.
    pub fn upload(&self, meta: StepMeta, device: &Device) -> Result<Uploaded> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device
            && !meta.host.is_empty()
        {
            let mut guard = self.staging.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let all = cuda::upload(&mut guard, &meta.host, dev)?;
            return Ok(Uploaded { all: Some(all), device: device.clone() });
        }
        Uploaded::plain(meta, device)
    }
}

#[cfg(feature = "cuda")]
// The staging buffer's allocation and the uninitialized device buffer the copy fills are the
// unsafe calls; see their SAFETY notes.
#[allow(unsafe_code)]
mod cuda {
    use candle_core::cuda::cudarc::driver::sys::{CU_MEMHOSTALLOC_WRITECOMBINED, CUevent_flags};
    use candle_core::cuda::cudarc::driver::{CudaEvent, PinnedHostSlice};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, Storage, Tensor};

    use crate::error::Result;
    use crate::ops::cuda::kept_pinned;

    /// The page-locked buffer and the event recorded after the last copy out of it (none before
    /// the first upload).
    #[derive(Debug, Default)]
    pub(super) struct Staging {
        buf: Option<PinnedHostSlice<u32>>,
        copied: Option<CudaEvent>,
    }

    impl Drop for Staging {
        fn drop(&mut self) {
            // The buffer is freed after this: no copy out of it may still be in flight. An error
            // here is the context's own (a sticky fault), which every later call reports.
            if let Some(e) = &self.copied {
                let _ = e.synchronize();
            }
        }
    }

    fn wrap<T>(r: std::result::Result<T, impl std::error::Error + Send + Sync + 'static>) -> Result<T> {
        Ok(r.map_err(candle_core::Error::wrap)?)
    }

    /// `host` on `dev` through the kept staging buffer (grown to the next power of two when too
    /// small): one asynchronous copy on the device's stream, the event recorded after it.
    pub(super) fn upload(s: &mut Staging, host: &[u32], dev: &CudaDevice) -> Result<Tensor> {
        let n = host.len();
        let stream = dev.cuda_stream();
        if let Some(e) = &s.copied {
            // The last copy out of the buffer must be done before the buffer is written again.
            wrap(e.synchronize())?;
        }
        if s.copied.is_none() {
            s.copied = Some(wrap(stream.context().new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)))?);
        }
        // SAFETY: only the first `n` values are ever copied out, each written just before (below);
        // `u32` has no invalid bit patterns; the last copy out of the buffer is done (above).
        // Write-combined: the host only writes it, and the device reads it across the link.
        let buf = unsafe { kept_pinned(&mut s.buf, n, 1024, CU_MEMHOSTALLOC_WRITECOMBINED, &stream) }?;
        let pinned = wrap(buf.as_mut_slice())?;
        pinned[..n].copy_from_slice(host);
        // SAFETY: the copy below writes all `n` values before any kernel of the stream reads them.
        let mut dst = wrap(unsafe { stream.alloc::<u32>(n) })?;
        // A plain slice of page-locked memory: the driver copies it by DMA, asynchronously.
        wrap(stream.memcpy_htod(&pinned[..n], &mut dst))?;
        if let Some(e) = &s.copied {
            wrap(e.record(&stream))?;
        }
        let storage = CudaStorage::wrap_cuda_slice(dst, dev.clone());
        Ok(Tensor::from_storage(Storage::Cuda(storage), n, BackpropOp::none(), false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::test_device;
    use candle_core::DType;

    /// Each table comes back as a view of the one upload, with its own values, on every device;
    /// a second upload through the same uploader (its kept buffer reused, then grown) does not
    /// disturb the first one's tensors; an empty table is an empty tensor, one past the upload
    /// is refused.
    fn tables_come_back_as_views(dev: &Device) -> anyhow::Result<()> {
        let up = MetaToDevice::new();
        let mut meta = StepMeta::new();
        let a = meta.push([7, 8, 9]);
        let b = meta.push(0..5u32);
        let c = meta.push([]);
        let first = up.upload(meta.clone(), dev)?;
        assert_eq!(first.part(a)?.to_vec1::<u32>()?, [7, 8, 9]);
        assert_eq!(first.part(b)?.to_vec1::<u32>()?, [0, 1, 2, 3, 4]);
        assert_eq!(first.part(a)?.dtype(), DType::U32);
        assert_eq!(first.part(c)?.dims(), [0]);
        let mut again = StepMeta::new();
        let d = again.push([1, 2]);
        let big = again.push((0..5000u32).map(|v| v * 3));
        let second = up.upload(again, dev)?;
        assert_eq!(second.part(d)?.to_vec1::<u32>()?, [1, 2]);
        let got = second.part(big)?.to_vec1::<u32>()?;
        assert!(got.len() == 5000 && got.iter().enumerate().all(|(i, &v)| v == 3 * i as u32));
        assert_eq!(first.part(b)?.to_vec1::<u32>()?, [0, 1, 2, 3, 4], "the first upload's tensors kept");
        assert!(first.part(big).is_err(), "a table past the upload");
        let empty = Uploaded::plain(StepMeta::new(), dev)?;
        assert!(empty.part(a).is_err());
        assert_eq!(empty.part(StepMeta::new().push([]))?.dims(), [0]);
        Ok(())
    }
    test_device!(tables_come_back_as_views, tables_come_back_as_views_cpu, tables_come_back_as_views_cuda);
}
