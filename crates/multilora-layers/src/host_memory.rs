//! Host buffers a model keeps for its whole life: zeros whose pages the system hands out on first
//! write ([`lazy_zeros`]), and the advice that lets the system back them with huge pages
//! ([`advise_huge`]; both at once, [`huge_zeros`]). The quantized weights' chunks
//! (`ops/quant/arena.rs`) take the advice, the LoRA slots' chunks (`slots.rs`) and the CPU KV
//! cache are huge zeros.
//!
//! A decode step streams its weights, its adapters' slots and its KV rows once each, tens of
//! megabytes as short streams: on 4 KiB pages far more translations than the TLBs hold, on 2 MiB
//! pages a few dozen (docs/BENCHMARKS.md, "An eighth look").

use std::ptr::NonNull;

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// The size of a huge page on x86-64 and aarch64 Linux.
pub(crate) const HUGE: usize = 2 << 20;

/// Asks the system to back `size` bytes from `ptr` with huge pages as they are first touched
/// (`madvise(MADV_HUGEPAGE)`); its answer changes nothing but speed, so it is not checked.
#[cfg(target_os = "linux")]
pub(crate) fn advise_huge(ptr: NonNull<u8>, size: usize) {
    // SAFETY: advice on a range of the caller's allocation; it changes how the range is backed,
    // not its contents or its validity.
    let _ = unsafe { libc::madvise(ptr.as_ptr().cast(), size, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_huge(_: NonNull<u8>, _: usize) {}

/// [`advise_huge`] for the whole huge pages inside `len` bytes from `addr` (an allocation that is
/// not on a huge-page boundary).
fn advise_huge_within(addr: usize, len: usize) {
    let (start, end) = (addr.next_multiple_of(HUGE), (addr + len) / HUGE * HUGE);
    if let (true, Some(p)) = (start < end, NonNull::new(start as *mut u8)) {
        advise_huge(p, end - start);
    }
}

/// [`lazy_zeros`] of `n` values in one dimension whose whole huge pages are advised
/// ([`advise_huge`]) on the CPU: for buffers read as short streams a step (the LoRA slots'
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
