//! Small tools the sections share: random tensors on the device, relative errors, timing with
//! the device synchronized before every clock read, and the fixture files.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

pub(crate) use crate::llama8b::randn;

/// `‖a − b‖ / ‖b‖` computed in f32 on the device (0 when both are zero).
pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let den = b.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    Ok(if den == 0.0 { num.sqrt() } else { (num / den).sqrt() })
}

/// Seconds per call of `f`, over `iters` calls after one warm-up, the device synchronized
/// before the clock starts and before it is read.
pub(crate) fn time_per_call(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
}

/// The fixture's `cases.json`.
pub(crate) fn cases(fixtures: &Path) -> Result<Value> {
    let path = fixtures.join("cases.json");
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// A JSON array of integers as token ids.
pub(crate) fn ids(v: &Value) -> Result<Vec<u32>> {
    v.as_array()
        .ok_or_else(|| anyhow::anyhow!("expected an array of token ids, got {v}"))?
        .iter()
        .map(|x| x.as_u64().map(|x| x as u32).ok_or_else(|| anyhow::anyhow!("not a token id: {x}")))
        .collect()
}

/// The median of some measurements.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The engine's name of `dev`, the device the check runs on: the engine opens it again itself.
pub(crate) fn engine_device(dev: &Device) -> multilora::Device {
    match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => multilora::Device::Cuda(gpu_id),
        _ => multilora::Device::Cpu,
    }
}
