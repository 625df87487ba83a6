//! [`stage`]: an adapter's matrices put on the model's device in **one** host-to-device copy,
//! before they are written into slots.
//!
//! An adapter held in host memory has an `A` and a `Bᵀ` per module (448 tensors for the seven
//! projections of a 32-layer model). Written one by one, each would be its own small transfer.
//! Staged, they are converted to the slot dtype and concatenated on the host, copied to the
//! device once, and the staged adapter's modules are views into that one device buffer; the slot
//! writes are then device-to-device copies. On the CPU nothing is staged: the slots read the
//! host tensors directly.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{LoraAdapter, LoraModule};

use crate::error::Result;

/// `adapter` with every module's `A` and `Bᵀ` in `dtype` on `device`, as views of one buffer
/// uploaded in one copy (the same adapter back when `device` is the CPU).
pub fn stage(adapter: &LoraAdapter, dtype: DType, device: &Device) -> Result<LoraAdapter> {
    if device.is_cpu() {
        return Ok(adapter.clone());
    }
    let mut parts = Vec::with_capacity(2 * adapter.modules().len());
    let mut spans = Vec::with_capacity(adapter.modules().len());
    let mut at = 0;
    for (id, m) in adapter.modules() {
        let (a, b) = (m.a.to_dtype(dtype)?.flatten_all()?, m.b_t.to_dtype(dtype)?.flatten_all()?);
        let (na, nb) = (a.elem_count(), b.elem_count());
        spans.push((*id, at, na, nb));
        at += na + nb;
        parts.extend([a, b]);
    }
    if parts.is_empty() {
        return Ok(adapter.clone());
    }
    // The one transfer: the host concatenation goes to the device as a single buffer.
    let staged = Tensor::cat(&parts, 0)?.to_device(device)?;
    drop(parts);
    let mut modules = BTreeMap::new();
    for (id, start, na, nb) in spans {
        let m = &adapter.modules()[&id];
        let a = staged.narrow(0, start, na)?.reshape(m.a.dims())?;
        let b_t = staged.narrow(0, start + na, nb)?.reshape(m.b_t.dims())?;
        modules.insert(id, LoraModule { a, b_t, rank: m.rank, alpha: m.alpha, scaling: m.scaling });
    }
    Ok(LoraAdapter::new(adapter.name(), adapter.config().clone(), modules, adapter.fingerprint()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::test_device;
    use multilora_adapter::ModuleId;
    use multilora_types::ModuleKind;

    /// On the CPU nothing is staged (the host modules back, in f32); on a GPU the staged modules are
    /// on the device, in the slot dtype (bf16), equal to the host ones rounded to it.
    fn staged_modules_equal_the_host_ones(dev: &Device) -> anyhow::Result<()> {
        let dtype = if dev.is_cpu() { DType::F32 } else { DType::BF16 };
        let (q, v) = (ModuleId::layer(0, ModuleKind::QProj), ModuleId::layer(1, ModuleKind::VProj));
        let a = crate::tests::adapter("x", &[(q, 4, 8, 6), (v, 2, 8, 3)], 1)?;
        let s = stage(&a, dtype, dev)?;
        for id in [q, v] {
            let (m, host) = (s.module(&id).unwrap(), a.module(&id).unwrap());
            assert!(m.a.device().same_device(dev) && m.a.dtype() == dtype && m.b_t.dtype() == dtype);
            let round = |t: &Tensor| -> anyhow::Result<Vec<Vec<f32>>> {
                Ok(t.to_dtype(dtype)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
            };
            assert_eq!(round(&m.a)?, round(&host.a)?);
            assert_eq!(round(&m.b_t)?, round(&host.b_t)?);
        }
        Ok(())
    }
    test_device!(
        staged_modules_equal_the_host_ones,
        staged_modules_equal_the_host_ones_cpu,
        staged_modules_equal_the_host_ones_cuda
    );
}
