//! The CPU linear kernel against candle's matmul, for every instruction set this CPU has, over
//! random shapes (odd sizes, `k` not a multiple of the vector width, strided inputs), and the
//! property the layers rely on: a row's output does not depend on the rest of the batch.

use candle_core::{DType, Device, IndexOp, Tensor};
use proptest::prelude::*;

use super::{Rng, bits, rel_err};
use crate::{Isa, PackedWeight, linear, linear_with};

/// Checks `linear_with` on `x: [m, k]`, `w: [n, k]` for every available ISA.
fn check(m: usize, n: usize, k: usize, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed);
    let x = rng.tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[n, k], 1.0, DType::F32, &Device::Cpu)?;
    let want = x.to_dtype(DType::F64)?.matmul(&w.to_dtype(DType::F64)?.t()?)?;
    for isa in Isa::all_available() {
        let got = linear_with(&x, &w, isa)?;
        anyhow::ensure!(got.dims() == [m, n], "{isa:?}: shape {:?}", got.dims());
        let e = rel_err(&got, &want)?;
        anyhow::ensure!(e < 1e-5, "{isa:?} m={m} n={n} k={k}: relative error {e}");
    }
    let packed = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("an f32 cpu weight packs"))?;
    anyhow::ensure!(packed.dims() == (n, k));
    anyhow::ensure!(bits(&packed.unpack()?)? == bits(&w)?, "unpack gives the weight back");
    for isa in Isa::all_available() {
        let got = packed.forward_with(&x, isa)?;
        anyhow::ensure!(got.dims() == [m, n], "packed {isa:?}: shape {:?}", got.dims());
        let e = rel_err(&got, &want)?;
        anyhow::ensure!(e < 1e-5, "packed {isa:?} m={m} n={n} k={k}: relative error {e}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn matches_matmul_on_random_shapes(m in 1usize..90, n in 1usize..60, k in 1usize..90, seed in any::<u64>()) {
        check(m, n, k, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn matches_matmul_on_threaded_shapes() -> anyhow::Result<()> {
    // Large enough to be cut into several rectangles and run on the pool, with edges in both
    // directions (rows not a multiple of 4, columns not a multiple of any tile width).
    check(70, 301, 67, 1)?;
    check(16, 1000, 260, 2)?;
    check(131, 53, 1030, 3)
}

#[test]
fn strided_input_and_fallbacks() -> anyhow::Result<()> {
    let mut rng = Rng::new(7);
    let dev = Device::Cpu;
    let x = rng.tensor(&[40, 24], 1.0, DType::F32, &dev)?;
    let w = rng.tensor(&[18, 40], 1.0, DType::F32, &dev)?;
    // A transposed view: not contiguous, made so by `linear`.
    let xt = x.t()?;
    let want = xt.matmul(&w.t()?)?;
    anyhow::ensure!(rel_err(&linear(&xt, &w)?, &want)? < 1e-5);
    // A non-contiguous weight and a bf16 one go through candle's matmul.
    let wt = rng.tensor(&[40, 18], 1.0, DType::F32, &dev)?.t()?;
    anyhow::ensure!(rel_err(&linear(&xt, &wt)?, &xt.matmul(&wt.t()?)?)? < 1e-5);
    let (xb, wb) = (xt.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
    anyhow::ensure!(linear(&xb, &wb)?.dtype() == DType::BF16);
    // Shape errors are candle's, not a panic.
    let bad = rng.tensor(&[18, 41], 1.0, DType::F32, &dev)?;
    anyhow::ensure!(linear(&xt, &bad).is_err());
    Ok(())
}

#[test]
fn rows_do_not_depend_on_the_batch() -> anyhow::Result<()> {
    let mut rng = Rng::new(11);
    let x = rng.tensor(&[150, 300], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[150, 300], 1.0, DType::F32, &Device::Cpu)?;
    for isa in Isa::all_available() {
        // Bit for bit among batches of one regime: up to 64 rows (decode) and above (packed).
        let small = linear_with(&x.i(0..64)?, &w, isa)?;
        for (lo, hi) in [(0, 1), (5, 6), (3, 10), (60, 64), (1, 64)] {
            let part = linear_with(&x.i(lo..hi)?, &w, isa)?;
            anyhow::ensure!(bits(&part)? == bits(&small.i(lo..hi)?)?, "{isa:?}: rows {lo}..{hi} differ");
        }
        let all = linear_with(&x, &w, isa)?;
        for (lo, hi) in [(0, 65), (7, 80), (70, 150), (1, 150)] {
            let part = linear_with(&x.i(lo..hi)?, &w, isa)?;
            anyhow::ensure!(bits(&part)? == bits(&all.i(lo..hi)?)?, "{isa:?}: rows {lo}..{hi} differ");
        }
        // Across the two, within rounding.
        let e = rel_err(&small, &all.i(0..64)?)?;
        anyhow::ensure!(e < 1e-6, "{isa:?}: decode and packed rows differ by {e}");
    }
    Ok(())
}

#[test]
fn packed_rows_do_not_depend_on_the_batch() -> anyhow::Result<()> {
    // One kernel for every batch size: a row gives the same bits alone, in a decode-sized batch
    // and in a prefill-sized one, whatever the tile heights it falls in.
    let mut rng = Rng::new(12);
    let x = rng.tensor(&[150, 300], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[107, 300], 1.0, DType::F32, &Device::Cpu)?;
    let packed = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("packs"))?;
    for isa in Isa::all_available() {
        let all = packed.forward_with(&x, isa)?;
        for (lo, hi) in [(0, 1), (5, 6), (3, 10), (60, 64), (1, 64), (0, 65), (7, 80), (70, 150), (149, 150)] {
            let part = packed.forward_with(&x.i(lo..hi)?, isa)?;
            anyhow::ensure!(bits(&part)? == bits(&all.i(lo..hi)?)?, "{isa:?}: rows {lo}..{hi} differ");
        }
    }
    // Other dtypes are not packed.
    anyhow::ensure!(PackedWeight::pack(&w.to_dtype(DType::BF16)?)?.is_none());
    Ok(())
}

#[test]
fn empty_shapes() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::ones((5, 8), DType::F32, &dev)?;
    anyhow::ensure!(linear(&Tensor::zeros((0, 8), DType::F32, &dev)?, &w)?.dims() == [0, 5]);
    let y = linear(&Tensor::ones((3, 0), DType::F32, &dev)?, &Tensor::ones((5, 0), DType::F32, &dev)?)?;
    anyhow::ensure!(y.dims() == [3, 5] && y.sum_all()?.to_scalar::<f32>()? == 0.0);
    let p = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("packs"))?;
    anyhow::ensure!(p.forward(&Tensor::zeros((0, 8), DType::F32, &dev)?)?.dims() == [0, 5]);
    let p = PackedWeight::pack(&Tensor::ones((5, 0), DType::F32, &dev)?)?.ok_or_else(|| anyhow::anyhow!("packs"))?;
    let y = p.forward(&Tensor::ones((3, 0), DType::F32, &dev)?)?;
    anyhow::ensure!(y.dims() == [3, 5] && y.sum_all()?.to_scalar::<f32>()? == 0.0);
    anyhow::ensure!(p.forward(&Tensor::ones((3, 2), DType::F32, &dev)?).is_err(), "a k mismatch is an error");
    Ok(())
}

/// `matmul_into` (the LoRA expand over a `k`-major `Bᵀ`) against an f64 sum, with strided rows
/// and widths that leave a tail of columns past the last full vector pair.
fn check_outer(m: usize, n: usize, k: usize, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed);
    let (ldx, ldw, ldy) = (k + 3, n + 5, n + 2);
    let x: Vec<f32> = rng.tensor(&[m * ldx], 1.0, DType::F32, &Device::Cpu)?.to_vec1()?;
    let wt: Vec<f32> = rng.tensor(&[k.max(1) * ldw], 1.0, DType::F32, &Device::Cpu)?.to_vec1()?;
    let mut y = vec![f32::NAN; m * ldy];
    crate::ops::gemm::matmul_into(&x, ldx, &wt, ldw, (m, n, k), &mut y, ldy);
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k).map(|p| x[i * ldx + p] as f64 * wt[p * ldw + j] as f64).sum();
            let got = y[i * ldy + j] as f64;
            anyhow::ensure!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "({i}, {j}) of [{m}, {n}, {k}]: {got} vs {want}"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn outer_product_matches_a_plain_sum(m in 1usize..30, n in 1usize..100, k in 0usize..40, seed in any::<u64>()) {
        check_outer(m, n, k, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
