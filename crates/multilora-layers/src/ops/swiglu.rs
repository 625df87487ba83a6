//! The gated MLP's activation on the CPU: `act(gate) · up` from a fused `[rows, 2 · inter]`
//! gate/up output (gate first), in one pass over it with the dispatched exponential (candle's
//! `silu` / `gelu` and the product are two passes and a scalar `expf` / `tanhf` per value): SiLU
//! (Llama, Qwen, Phi-3) and GELU's tanh form (Gemma).

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::ops::{PARALLEL_VALUES, cpu_values};
use multilora_cpu::Isa;
use multilora_cpu::float as gemm;

/// `silu(gu[:, ..inter]) · gu[:, inter..]` → `[rows, inter]`, for an f32 `gu: [rows, 2 · inter]`
/// on the CPU, or on CUDA in one launch (`fused.cu`); `None` for any other (the caller then uses
/// tensor ops).
///
/// # Errors
/// When `gu` is not `[rows, 2 · inter]`.
pub fn silu_mul(gu: &Tensor, inter: usize) -> Result<Option<Tensor>> {
    gated(gu, inter, "silu_mul", gemm::silu_mul, crate::ops::fused::silu_mul)
}

/// `gelu_tanh(gu[:, ..inter]) · gu[:, inter..]` (`gelu_pytorch_tanh`) → `[rows, inter]`, as
/// [`silu_mul`].
///
/// # Errors
/// When `gu` is not `[rows, 2 · inter]`.
pub fn gelu_tanh_mul(gu: &Tensor, inter: usize) -> Result<Option<Tensor>> {
    gated(gu, inter, "gelu_tanh_mul", gemm::gelu_tanh_mul, |_, _| Ok(None))
}

/// One of the gated activations, `kernel(isa, gate row, up row, out row)`, over the rows on the
/// CPU; on a device, `device(gu, inter)`, its one launch where there is one (`None`: none).
fn gated(
    gu: &Tensor,
    inter: usize,
    op: &'static str,
    kernel: fn(Isa, &[f32], &[f32], &mut [f32]),
    device: fn(&Tensor, usize) -> Result<Option<Tensor>>,
) -> Result<Option<Tensor>> {
    let (rows, width) = gu.dims2().map_err(|_| Error::shape(op, "gate_up", gu.dims(), &[0, 2 * inter]))?;
    if width != 2 * inter {
        return Err(Error::shape(op, "gate_up", gu.dims(), &[rows, 2 * inter]));
    }
    if !gu.device().is_cpu() {
        return device(gu, inter);
    }
    if gu.dtype() != DType::F32 || !gu.device().is_cpu() {
        return Ok(None);
    }
    let gu = gu.contiguous()?;
    let (guard, layout) = gu.storage_and_layout();
    let Some(v) = cpu_values::<f32>(&guard, layout).and_then(|v| v.get(..rows * width)) else { return Ok(None) };
    let mut out = vec![0f32; rows * inter];
    let isa = Isa::best();
    let row = |(o, x): (&mut [f32], &[f32])| kernel(isa, &x[..inter], &x[inter..], o);
    if rows * inter >= PARALLEL_VALUES && inter > 0 {
        let min = rows.div_ceil(4 * multilora_cpu::pool::threads()).max(1);
        let parts = out.chunks_mut(inter * min).zip(v.chunks(width * min)).collect();
        multilora_cpu::pool::for_each_part(parts, |_, (o, x): (&mut [f32], &[f32])| {
            o.chunks_mut(inter).zip(x.chunks(width)).for_each(row)
        });
    } else if inter > 0 {
        out.chunks_mut(inter).zip(v.chunks(width)).for_each(row);
    }
    drop(guard);
    Ok(Some(Tensor::from_vec(out, (rows, inter), gu.device())?))
}
