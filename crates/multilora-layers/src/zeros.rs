//! Zeroed host tensors kept for a model's life, paged in on first write ([`lazy_zeros`]) or on
//! advised huge pages ([`huge_zeros`]: the LoRA slots' chunks and the CPU KV cache).

use candle_core::{DType, Device, Tensor};
use multilora_cpu::host_memory::advise_huge_within;

use crate::error::Result;

/// [`lazy_zeros`] of `n` values in one dimension whose whole huge pages are advised
/// (`multilora_cpu::host_memory::advise_huge`) on the CPU: for buffers read as short streams a step (the LoRA slots'
/// chunks, the KV cache).
pub fn huge_zeros(n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let t = lazy_zeros(&[n], dtype, device)?;
    if let Some(rows) = crate::HostRows::of(&t).filter(|_| device.is_cpu()) {
        advise_huge_within(rows.addr(), n * dtype.size_in_bytes());
    }
    Ok(t)
}

/// A zeroed tensor whose pages, on the CPU, the system hands out on first write, so a buffer sized
/// for the most it may hold costs memory only as far as it is used: half-precision zeros are made
/// as `u16` zeros (a zeroed allocation, as f32 zeros are; `vec![f16::ZERO; n]` writes every
/// element) and reinterpreted, bits unchanged. Elsewhere, candle's zeros.
pub fn lazy_zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    use half::vec::HalfBitsVecExt;
    let n = shape.iter().product();
    Ok(match dtype {
        DType::F16 if device.is_cpu() => {
            Tensor::from_vec(vec![0u16; n].reinterpret_into::<half::f16>(), shape, device)?
        }
        DType::BF16 if device.is_cpu() => {
            Tensor::from_vec(vec![0u16; n].reinterpret_into::<half::bf16>(), shape, device)?
        }
        _ => Tensor::zeros(shape, dtype, device)?,
    })
}
