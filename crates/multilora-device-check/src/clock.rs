//! Timing on the GPU: CUDA events recorded on the device's stream around back-to-back calls (the
//! device's own time, launches queued one after another with no sync between them), beside the
//! host's wall time to enqueue those calls.
//!
//! When the host's time per call is above the device's, the device waited on the host: the call
//! is launch-bound and its device time says more about the host than about the kernel.

use anyhow::Result;
use candle_core::Device;

/// Seconds per call of one timed operation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timed {
    /// Between the events around the calls, per call.
    pub(crate) device: f64,
    /// The host's wall time to enqueue the calls, per call.
    pub(crate) host: f64,
}

/// [`Timed`] of `f` over `iters` back-to-back calls, after one warm-up call and a sync.
pub(crate) fn events(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<Timed> {
    f()?;
    dev.synchronize()?;
    let iters = iters.max(1);
    let (device, host) = timed_loop(dev, || {
        for _ in 0..iters {
            f()?;
        }
        Ok(())
    })?;
    Ok(Timed { device: device / iters as f64, host: host / iters as f64 })
}

/// `(device seconds, host seconds)` of `body`, between two events on the device's stream.
#[cfg(feature = "cuda")]
fn timed_loop(dev: &Device, body: impl FnOnce() -> Result<()>) -> Result<(f64, f64)> {
    use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
    let stream = dev.as_cuda_device()?.cuda_stream();
    // Timing events (the default flags); cudarc's own default disables timing.
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let t = std::time::Instant::now();
    body()?;
    let host = t.elapsed().as_secs_f64();
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    // Waits for both events.
    let ms = start.elapsed_ms(&end)?;
    Ok((f64::from(ms) / 1e3, host))
}

/// Without CUDA there are no events: the binary stops before any section (no device).
#[cfg(not(feature = "cuda"))]
fn timed_loop(_dev: &Device, _body: impl FnOnce() -> Result<()>) -> Result<(f64, f64)> {
    anyhow::bail!("CUDA events need a CUDA build (`--features cuda`)")
}
