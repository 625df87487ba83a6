//! [`RowsToHost`]: a step's logits (`f32 [rows, vocab]`) brought back to the host, every step.
//!
//! On CUDA the copy goes through a page-locked buffer the reader keeps (grown when a step needs
//! more, never shrunk): a DMA at the link's speed, where a copy into pageable memory is staged by
//! the driver through its own small pinned buffer, chunk by chunk (at batch 64 and a 128k
//! vocabulary that is 33 MB a step). On the CPU it is `to_vec2`. The rows then leave the buffer
//! as the sampler's `Vec`s; the buffer is released on `Drop`; every read waits for its copy before
//! it returns, so none is in flight then.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// Reads `f32 [rows, cols]` tensors back to the host; one per model, used once per step.
#[derive(Debug, Default)]
pub struct RowsToHost {
    #[cfg(feature = "cuda")]
    pinned: std::sync::Mutex<Option<candle_core::cuda::cudarc::driver::PinnedHostSlice<f32>>>,
}

impl RowsToHost {
    /// A reader with no buffer yet (the first CUDA read allocates it).
    pub fn new() -> RowsToHost {
        RowsToHost::default()
    }

    /// The rows of `t` (`f32 [rows, cols]`) on the host.
    pub fn read(&self, t: &Tensor) -> Result<Vec<Vec<f32>>> {
        let (rows, cols) = t.dims2()?;
        if t.dtype() != DType::F32 {
            return Err(Error::InvalidLayer {
                module: "rows_to_host".to_string(),
                reason: format!("reads f32 rows, got {:?}", t.dtype()),
            });
        }
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() && rows * cols > 0 {
            return self.read_cuda(t, rows, cols);
        }
        let _ = (rows, cols);
        Ok(t.to_vec2::<f32>()?)
    }

    #[cfg(feature = "cuda")]
    // The kept pinned buffer's (re)allocation is the one unsafe call; see its SAFETY note.
    #[allow(unsafe_code)]
    fn read_cuda(&self, t: &Tensor, rows: usize, cols: usize) -> Result<Vec<Vec<f32>>> {
        use candle_core::Storage;
        use candle_core::backend::BackendStorage;

        let t = t.contiguous()?;
        let n = rows * cols;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Ok(t.to_vec2::<f32>()?);
        };
        let start = layout.start_offset();
        let src = cs.as_cuda_slice::<f32>()?.slice(start..start + n);
        let stream = cs.device().cuda_stream();
        let mut guard = self.pinned.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: the buffer's contents are only read after a copy into it has filled the first
        // `n` values (below); f32 has no invalid bit patterns; every read waits for its copy
        // before it returns, so none is in flight. Flags 0: cached page-locked memory
        // (write-combined memory is slow for the host to read).
        let buf = unsafe { crate::ops::cuda::kept_pinned(&mut guard, n, 1, 0, &stream) }?;
        // The first `n` values alone: cudarc's copy into a host slice moves the slice's length,
        // and the kept buffer may be longer than the rows (past them it would read beyond `src`
        // on the device). A plain slice of page-locked memory is still copied by DMA.
        let pinned = buf.as_mut_slice().map_err(candle_core::Error::wrap)?;
        stream.memcpy_dtoh(&src, &mut pinned[..n]).map_err(candle_core::Error::wrap)?;
        // The copy is asynchronous into page-locked memory. The buffer's own event cannot be
        // waited on: cudarc records it only while it manages stream synchronization, which the
        // model turns off (`prepare_cuda_device`). So wait for the stream itself.
        stream.synchronize().map_err(candle_core::Error::wrap)?;
        Ok(pinned[..n].chunks_exact(cols).map(<[f32]>::to_vec).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::test_device;
    use candle_core::Device;

    /// The rows come back as `to_vec2` gives them: twice with the same reader (the kept buffer
    /// reused), then a larger read (the buffer grown), then rows of a view that starts inside
    /// its storage; an empty read is empty, and other dtypes are refused.
    fn rows_come_back_as_they_are(dev: &Device) -> anyhow::Result<()> {
        let r = RowsToHost::new();
        for (rows, cols) in [(3, 5), (2, 7), (17, 33)] {
            let v: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
            let t = Tensor::from_vec(v.clone(), (rows, cols), dev)?;
            assert_eq!(r.read(&t)?, v.chunks(cols).map(<[f32]>::to_vec).collect::<Vec<_>>());
        }
        let t = Tensor::from_vec((0..40).map(|i| i as f32).collect::<Vec<_>>(), (8, 5), dev)?;
        let view = t.narrow(0, 3, 4)?;
        assert_eq!(r.read(&view)?, view.to_vec2::<f32>()?);
        assert!(r.read(&Tensor::zeros((0, 4), DType::F32, dev)?)?.is_empty());
        let err = r.read(&t.to_dtype(DType::BF16)?).unwrap_err().to_string();
        assert!(err.contains("f32"), "{err}");
        Ok(())
    }
    test_device!(rows_come_back_as_they_are, rows_come_back_as_they_are_cpu, rows_come_back_as_they_are_cuda);
}
