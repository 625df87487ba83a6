//! RMS norm, `x / sqrt(mean(x²) + eps) · alpha` along the last dimension: on the CPU over f32 rows
//! the same arithmetic as candle-nn's `rms_norm` (each row's squares summed in order, one
//! `sqrt`, a division and a product per value), so the same bits, but several rows' sums run side
//! by side and the division vectorises on the instruction set the CPU has. candle's loop is one
//! dependent chain of adds per row, compiled for baseline x86-64: 61 norms of a 16-row decode step
//! of SmolLM2 took ~0.4 ms of ~12 (docs/BENCHMARKS.md). Anything else goes to candle-nn.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::Result;
use crate::ops::gemm::{Isa, NORM_ROWS, rms_rows};
use crate::ops::{PARALLEL_VALUES, cpu_values};

/// `rms_norm(x, alpha, eps)` along `x`'s last dimension, as candle-nn's.
///
/// # Errors
/// As candle-nn's: when `alpha` is not as long as `x`'s rows.
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    let n = x.dims().last().copied().unwrap_or(0);
    let fits = x.device().is_cpu()
        && alpha.device().is_cpu()
        && x.dtype() == DType::F32
        && alpha.dtype() == DType::F32
        && alpha.dims() == [n]
        && n > 0;
    if !fits {
        return Ok(candle_nn::ops::rms_norm(x, alpha, eps)?);
    }
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (al, all) = alpha.storage_and_layout();
    let (Some(src), Some(a)) = (cpu_values::<f32>(&xs, xl), cpu_values::<f32>(&al, all)) else {
        drop((xs, al));
        return Ok(candle_nn::ops::rms_norm(&x, alpha, eps)?);
    };
    let len = x.elem_count();
    let mut out = vec![0f32; len];
    let (isa, group) = (Isa::best(), NORM_ROWS * n);
    if len >= PARALLEL_VALUES && len > group {
        // The kernel's group of rows at a time, each row's bits the same wherever it falls.
        out.par_chunks_mut(group)
            .zip(src[..len].par_chunks(group))
            .for_each(|(o, s)| rms_rows(isa, s, &a[..n], eps, o));
    } else {
        rms_rows(isa, &src[..len], &a[..n], eps, &mut out);
    }
    drop((xs, al));
    Ok(Tensor::from_vec(out, x.shape(), x.device())?)
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
