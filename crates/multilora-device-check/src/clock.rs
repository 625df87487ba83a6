//! Timing on the GPU: CUDA events recorded on the device's stream around back-to-back calls (the
//! device's own time, launches queued one after another with no sync between them), beside the
//! host's wall time to enqueue those calls; and the same work captured once into a CUDA graph and
//! replayed, which takes the host out (one graph launch a call, the kernels and the allocations
//! it made queued by the driver): the kernel's own time.
//!
//! When the host's time per call is above the device's, the device waited on the host: the call
//! is launch-bound, its device time says more about the host than about the kernel, and the
//! replayed figure is the kernel's.

use anyhow::Result;
use candle_core::Device;

/// Seconds per call of one timed operation.
#[derive(Clone, Debug)]
pub(crate) struct Timed {
    /// Between the events around the calls, per call.
    pub(crate) device: f64,
    /// The host's wall time to enqueue the calls, per call.
    pub(crate) host: f64,
    /// The call's device work captured into a CUDA graph, per replay.
    pub(crate) replay: Replay,
}

/// A graph replay's figure, or why there is none.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Replay {
    /// Between the events around the replays, per replay.
    Device(f64),
    /// The capture, instantiation or a replay failed (the calls' figures stand alone).
    Failed(String),
    /// Not captured (a whole step: its uploads from pageable memory cannot be captured).
    NotAsked,
}

impl Timed {
    /// The device time that best says what the kernels take: the replays' where measured.
    pub(crate) fn kernel(&self) -> f64 {
        match self.replay {
            Replay::Device(s) => s,
            _ => self.device,
        }
    }
}

/// [`Timed`] of `f` over `iters` back-to-back calls, after one warm-up call and a sync (no
/// replay).
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
    Ok(Timed { device: device / iters as f64, host: host / iters as f64, replay: Replay::NotAsked })
}

/// [`events`], and then `f`'s device work captured once into a CUDA graph and replayed `iters`
/// times between two events. A capture that fails is reported in [`Replay::Failed`], never
/// hidden: the calls' figures are still measured.
pub(crate) fn measured(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<Timed> {
    let mut t = events(dev, iters, &mut f)?;
    t.replay = match replayed(dev, iters.max(1), f) {
        Ok(s) => Replay::Device(s),
        // The first line: candle's errors carry a backtrace on the next ones.
        Err(e) => Replay::Failed(format!("{e:#}").lines().next().unwrap_or_default().to_string()),
    };
    Ok(t)
}

/// Device seconds per replay of `f` captured into a graph (see [`measured`]).
#[cfg(feature = "cuda")]
fn replayed(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    use candle_core::cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let stream = dev.as_cuda_device()?.cuda_stream();
    dev.synchronize()?;
    // Thread-local: only this thread's calls are captured, and only its unsafe calls (a
    // synchronous allocation, say) break the capture.
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let called = f();
    // Always ended, so that the stream leaves capture mode whatever `f` did.
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    called.map_err(|e| e.context("the call failed while captured"))?;
    let graph = ended?.ok_or_else(|| anyhow::anyhow!("the capture made no graph"))?;
    graph.upload()?;
    graph.launch()?;
    dev.synchronize()?;
    let (device, _) = timed_loop(dev, || {
        for _ in 0..iters {
            graph.launch()?;
        }
        Ok(())
    })?;
    Ok(device / iters as f64)
}

#[cfg(not(feature = "cuda"))]
fn replayed(_dev: &Device, _iters: usize, _f: impl FnMut() -> Result<()>) -> Result<f64> {
    anyhow::bail!("CUDA graphs need a CUDA build (`--features cuda`)")
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
