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
    use multilora_adapter::{ModuleId, ModuleKind};

    #[test]
    fn the_cpu_is_not_staged() -> anyhow::Result<()> {
        let q = ModuleId::layer(0, ModuleKind::QProj);
        let a = crate::tests::adapter("x", &[(q, 4, 8, 6)], 1)?;
        let s = stage(&a, DType::F32, &Device::Cpu)?;
        assert_eq!(s.module(&q).unwrap().a.to_vec2::<f32>()?, a.module(&q).unwrap().a.to_vec2::<f32>()?);
        Ok(())
    }

    /// On a GPU, the staged modules are on the device, in the slot dtype, equal to the host ones.
    #[cfg(feature = "cuda")]
    #[test]
    fn staged_modules_are_views_of_one_device_buffer() -> anyhow::Result<()> {
        let Some(dev) = crate::tests::cuda_device("staged_modules_are_views_of_one_device_buffer") else {
            return Ok(());
        };
        let (q, v) = (ModuleId::layer(0, ModuleKind::QProj), ModuleId::layer(1, ModuleKind::VProj));
        let a = crate::tests::adapter("x", &[(q, 4, 8, 6), (v, 2, 8, 3)], 1)?;
        let s = stage(&a, DType::BF16, &dev)?;
        let (sq, sv) = (s.module(&q).unwrap(), s.module(&v).unwrap());
        assert!(sq.a.device().same_device(&dev) && sq.a.dtype() == DType::BF16);
        for (id, m) in [(q, sq), (v, sv)] {
            let host = a.module(&id).unwrap();
            assert_eq!(
                m.b_t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?,
                host.b_t.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.to_vec2::<f32>()?
            );
        }
        Ok(())
    }
}
