//! RMS norm, `x / sqrt(mean(x²) + eps) · alpha` along the last dimension: on the CPU over f32 rows
//! the same arithmetic as candle-nn's `rms_norm` (each row's squares summed in order, one
//! `sqrt`, a division and a product per value), so the same bits, but several rows' sums run side
//! by side and the division vectorises on the instruction set the CPU has. candle's loop is one
//! dependent chain of adds per row, compiled for baseline x86-64: 61 norms of a 16-row decode step
//! of SmolLM2 took ~0.4 ms of ~12 (docs/BENCHMARKS.md). Anything else goes to candle-nn.
//!
//! [`add_rms_norm`] is a decoder layer's residual add and the next norm in one pass over the rows
//! (the sum rounded once per value, as candle's add, then normed as above): one parallel region
//! and one output fewer per norm than the two ops.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::ops::{PARALLEL_VALUES, cpu_values};
use multilora_cpu::Isa;
use multilora_cpu::float::{NORM_ROWS, rms_rows};

/// `rms_norm(x, alpha, eps)` along `x`'s last dimension, as candle-nn's.
///
/// # Errors
/// As candle-nn's: when `alpha` is not as long as `x`'s rows.
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(norm(x, None, alpha, eps)?.1)
}

/// The residual sum `x + delta` and its RMS norm, `(x + delta, rms_norm(x + delta, alpha, eps))`,
/// as the two ops give them (the sum rounded once per value, as candle's add), in one pass over
/// the rows on the CPU (a decoder layer's residual add and the next norm).
///
/// # Errors
/// When `x` and `delta` differ in shape or dtype, or `alpha` is not as long as their rows.
pub fn add_rms_norm(x: &Tensor, delta: &Tensor, alpha: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    norm(x, Some(delta), alpha, eps)
}

/// [`add_rms_norm`], or [`rms_norm`] without `delta` (its sum then `x` itself).
fn norm(x: &Tensor, delta: Option<&Tensor>, alpha: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    // On CUDA the add and the norm are one launch (`fused.cu`).
    if let Some(d) = delta
        && let Some(both) = crate::ops::fused::add_rms_norm(x, d, alpha, eps)?
    {
        return Ok(both);
    }
    let n = x.dims().last().copied().unwrap_or(0);
    let fits = x.device().is_cpu()
        && alpha.device().is_cpu()
        && x.dtype() == DType::F32
        && alpha.dtype() == DType::F32
        && alpha.dims() == [n]
        && delta.is_none_or(|d| d.dtype() == DType::F32 && d.dims() == x.dims() && d.device().is_cpu())
        && n > 0;
    let candle = |x: &Tensor| -> Result<(Tensor, Tensor)> {
        let sum = match delta {
            Some(d) => (x + d)?,
            None => x.clone(),
        };
        let normed = candle_nn::ops::rms_norm(&sum, alpha, eps)?;
        Ok((sum, normed))
    };
    if !fits {
        return candle(x);
    }
    let x = x.contiguous()?;
    let d = delta.map(Tensor::contiguous).transpose()?;
    let Some((out, sum)) = norm_rows(&x, d.as_ref(), alpha, eps, n) else {
        return candle(&x);
    };
    let normed = Tensor::from_vec(out, x.shape(), x.device())?;
    let sum = if d.is_some() { Tensor::from_vec(sum, x.shape(), x.device())? } else { x };
    Ok((sum, normed))
}

/// [`norm`]'s CPU pass over contiguous f32 `x` (and `d`): the normed rows, and the sums when
/// there is a `d` (else empty); `None` when the storages are not the CPU's f32 values.
fn norm_rows(x: &Tensor, d: Option<&Tensor>, alpha: &Tensor, eps: f32, n: usize) -> Option<(Vec<f32>, Vec<f32>)> {
    let (xs, xl) = x.storage_and_layout();
    let (al, all) = alpha.storage_and_layout();
    let ds = d.map(|d| d.storage_and_layout());
    let src = cpu_values::<f32>(&xs, xl)?;
    let a = cpu_values::<f32>(&al, all)?;
    let dv = match &ds {
        Some((s, l)) => Some(cpu_values::<f32>(s, l)?.get(..x.elem_count())?),
        None => None,
    };
    let len = x.elem_count();
    let mut out = vec![0f32; len];
    let mut sum = if dv.is_some() { vec![0f32; len] } else { Vec::new() };
    let (isa, group) = (Isa::best(), NORM_ROWS * n);
    let (src, a) = (src.get(..len)?, a.get(..n)?);
    // One group of rows (the `i`-th): the sum (when there is a delta), then its norm.
    let rows = |i: usize, o: &mut [f32], s: &mut [f32]| {
        let x = &src[i * group..][..o.len()];
        match dv {
            Some(dv) => {
                for ((s, &x), &d) in s.iter_mut().zip(x).zip(&dv[i * group..]) {
                    *s = x + d;
                }
                rms_rows(isa, s, a, eps, o);
            }
            None => rms_rows(isa, x, a, eps, o),
        }
    };
    if len >= PARALLEL_VALUES && len > group {
        // The kernel's group of rows at a time, each row's bits the same wherever it falls.
        let parts: Vec<(&mut [f32], &mut [f32])> = match dv {
            Some(_) => out.chunks_mut(group).zip(sum.chunks_mut(group)).collect(),
            None => out.chunks_mut(group).map(|o| (o, &mut [][..])).collect(),
        };
        multilora_cpu::pool::for_each_part(parts, |i, (o, s)| rows(i, o, s));
    } else {
        rows(0, &mut out, &mut sum);
    }
    Some((out, sum))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// Bit for bit candle-nn's, at row counts around the side-by-side width and on every
    /// instruction set this CPU has (and the portable body).
    #[test]
    fn rms_norm_is_candles_bit_for_bit() -> Result<()> {
        for (rows_n, n) in [(1, 64), (7, 576), (8, 576), (17, 96), (33, 40)] {
            let x = Tensor::randn(0f32, 3.0, (rows_n, n), &Device::Cpu)?;
            let alpha = Tensor::randn(1f32, 0.2, n, &Device::Cpu)?;
            let want: Vec<u32> = candle_nn::ops::rms_norm(&x, &alpha, 1e-5)?
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let got: Vec<u32> =
                rms_norm(&x, &alpha, 1e-5)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{rows_n} rows of {n}");
            let (xs, a) = (x.flatten_all()?.to_vec1::<f32>()?, alpha.to_vec1::<f32>()?);
            for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
                let mut out = vec![0f32; xs.len()];
                rms_rows(isa, &xs, &a, 1e-5, &mut out);
                assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{isa:?}, {rows_n} × {n}");
            }
        }
        Ok(())
    }

    /// The residual sum and its norm bit for bit candle's add followed by candle-nn's norm, serial
    /// and in parallel groups, and through candle for other dtypes; shapes that differ are
    /// refused.
    #[test]
    fn add_rms_norm_is_the_add_then_the_norm() -> Result<()> {
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
        };
        for (rows_n, n) in [(1, 64), (7, 576), (16, 576), (17, 96), (33, 40)] {
            let x = Tensor::randn(0f32, 3.0, (rows_n, n), &Device::Cpu)?;
            let d = Tensor::randn(0f32, 0.7, (rows_n, n), &Device::Cpu)?;
            let alpha = Tensor::randn(1f32, 0.2, n, &Device::Cpu)?;
            let sum = (&x + &d)?;
            let want = candle_nn::ops::rms_norm(&sum, &alpha, 1e-5)?;
            let (s, h) = add_rms_norm(&x, &d, &alpha, 1e-5)?;
            assert_eq!(bits(&s)?, bits(&sum)?, "{rows_n} rows of {n}: the sum");
            assert_eq!(bits(&h)?, bits(&want)?, "{rows_n} rows of {n}: the norm");
            let (xb, db, ab) = (x.to_dtype(DType::BF16)?, d.to_dtype(DType::BF16)?, alpha.to_dtype(DType::BF16)?);
            let want = candle_nn::ops::rms_norm(&(&xb + &db)?, &ab, 1e-5)?;
            assert_eq!(bits(&add_rms_norm(&xb, &db, &ab, 1e-5)?.1)?, bits(&want)?, "bf16 through candle");
        }
        let x = Tensor::ones((2, 8), DType::F32, &Device::Cpu)?;
        let alpha = Tensor::ones(8, DType::F32, &Device::Cpu)?;
        assert!(add_rms_norm(&x, &Tensor::ones((3, 8), DType::F32, &Device::Cpu)?, &alpha, 1e-6).is_err());
        Ok(())
    }

    #[test]
    fn other_shapes_and_dtypes_take_candles_path() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (2, 3, 8), &Device::Cpu)?;
        let alpha = Tensor::ones(8, DType::F32, &Device::Cpu)?;
        let want = candle_nn::ops::rms_norm(&x, &alpha, 1e-6)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(rms_norm(&x, &alpha, 1e-6)?.flatten_all()?.to_vec1::<f32>()?, want, "3-d input, own path");
        let xb = x.to_dtype(DType::BF16)?;
        let ab = alpha.to_dtype(DType::BF16)?;
        let want = candle_nn::ops::rms_norm(&xb, &ab, 1e-6)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let got = rms_norm(&xb, &ab, 1e-6)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(got, want, "bf16 through candle");
        let bad = Tensor::ones(7, DType::F32, &Device::Cpu)?;
        assert!(rms_norm(&x, &bad, 1e-6).is_err(), "alpha of the wrong length is refused, as by candle");
        Ok(())
    }
}
