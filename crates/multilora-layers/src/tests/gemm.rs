//! The CPU linear kernel against candle's matmul, for every instruction set this CPU has, over
//! random shapes (odd sizes, `k` not a multiple of the vector width, strided inputs), and the
//! property the layers rely on: a row's output does not depend on the rest of the batch; and
//! each bf16 / f16 kernel against its f32 twin, bit for bit (a half-precision weight is widened
//! exactly, then multiplied by the same chains of FMAs).

use candle_core::{DType, Device, IndexOp, Tensor};
use proptest::prelude::*;

use super::{Rng, bits, rel_err};
use multilora_cpu::Isa;

use crate::{PackedWeight, linear, linear_with};

/// `got` against `x · wᵀ` (`x: [m, k]`, `w: [n, k]`) computed in f64, element by element, within
/// the forward error bound of an f32 dot product in any summation order:
/// `|got − x·w| ≤ γ · (|x| · |w|ᵀ)`, `γ = (k + 1)·u / (1 − (k + 1)·u)`, `u = 2⁻²⁴` (`k` roundings
/// of the sums and one of the output). A relative error over the whole output is no test of a
/// single dot product that nearly cancels (random `m = n = 1` shapes failed it), and the bound is
/// still far below one missing or doubled term (`~1/k` of the magnitude).
fn ensure_dot_bound(got: &Tensor, x: &Tensor, w: &Tensor, what: &str) -> anyhow::Result<()> {
    let (x, w) = (x.to_dtype(DType::F64)?, w.to_dtype(DType::F64)?);
    let k = x.dim(1)?;
    let want = x.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f64>()?;
    let magnitude = x.abs()?.matmul(&w.abs()?.t()?)?.flatten_all()?.to_vec1::<f64>()?;
    let got = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    anyhow::ensure!(got.len() == want.len(), "{what}: {} values, not {}", got.len(), want.len());
    let u = f64::from(f32::EPSILON) / 2.0;
    let gamma = (k + 1) as f64 * u / (1.0 - (k + 1) as f64 * u);
    for (i, ((g, w), m)) in got.iter().zip(&want).zip(&magnitude).enumerate() {
        anyhow::ensure!(
            (g - w).abs() <= gamma * m,
            "{what}: element {i}: {g} vs {w}, error {} over the bound {}",
            (g - w).abs(),
            gamma * m
        );
    }
    Ok(())
}

/// Checks `linear_with` on `x: [m, k]`, `w: [n, k]` for every available ISA.
fn check(m: usize, n: usize, k: usize, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed);
    let x = rng.tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[n, k], 1.0, DType::F32, &Device::Cpu)?;
    for isa in Isa::available_of(&Isa::FLOAT) {
        let got = linear_with(&x, &w, isa)?;
        anyhow::ensure!(got.dims() == [m, n], "{isa:?}: shape {:?}", got.dims());
        ensure_dot_bound(&got, &x, &w, &format!("{isa:?} m={m} n={n} k={k}"))?;
    }
    let packed = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("an f32 cpu weight packs"))?;
    anyhow::ensure!(packed.dims() == (n, k));
    anyhow::ensure!(bits(&packed.unpack()?)? == bits(&w)?, "unpack gives the weight back");
    for isa in Isa::available_of(&Isa::FLOAT) {
        let got = packed.forward_with(&x, isa)?;
        anyhow::ensure!(got.dims() == [m, n], "packed {isa:?}: shape {:?}", got.dims());
        ensure_dot_bound(&got, &x, &w, &format!("packed {isa:?} m={m} n={n} k={k}"))?;
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
fn a_dot_product_that_nearly_cancels_is_held_to_its_error_bound() -> anyhow::Result<()> {
    // The shape and seed proptest found: one output, |x·w| ≈ 4e-5 of the terms' magnitude.
    check(1, 1, 88, 5890251435049285219)?;
    // The bound still rejects a product with one term missing.
    let mut rng = Rng::new(5);
    let x = rng.tensor(&[3, 88], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[4, 88], 1.0, DType::F32, &Device::Cpu)?;
    let short = linear(&x.narrow(1, 0, 87)?.contiguous()?, &w.narrow(1, 0, 87)?.contiguous()?)?;
    anyhow::ensure!(ensure_dot_bound(&short, &x, &w, "one term short").is_err(), "a missing term passed the bound");
    ensure_dot_bound(&linear(&x, &w)?, &x, &w, "whole")
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
    for isa in Isa::available_of(&Isa::FLOAT) {
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
    for isa in Isa::available_of(&Isa::FLOAT) {
        let all = packed.forward_with(&x, isa)?;
        for (lo, hi) in [(0, 1), (5, 6), (3, 10), (60, 64), (1, 64), (0, 65), (7, 80), (70, 150), (149, 150)] {
            let part = packed.forward_with(&x.i(lo..hi)?, isa)?;
            anyhow::ensure!(bits(&part)? == bits(&all.i(lo..hi)?)?, "{isa:?}: rows {lo}..{hi} differ");
        }
    }
    // Integer weights are not packed.
    anyhow::ensure!(PackedWeight::pack(&w.to_dtype(DType::U8)?)?.is_none());
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

/// `w` rounded to `dt` and widened back: the f32 weight a half-precision kernel must match.
fn widened(w: &Tensor, dt: DType) -> anyhow::Result<Tensor> {
    Ok(w.to_dtype(dt)?.to_dtype(DType::F32)?)
}

/// Every kernel over a bf16 / f16 weight gives the bits of its f32 twin over the same values,
/// for each instruction set of this CPU, on shapes with edges everywhere: streaming and packed
/// `linear` (up to and past 64 rows), the pre-packed weight, and the LoRA shrink and expand.
fn check_half(m: usize, n: usize, k: usize, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed);
    let x = rng.tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[n, k], 1.0, DType::F32, &Device::Cpu)?;
    for dt in [DType::BF16, DType::F16] {
        let (wh, wf) = (w.to_dtype(dt)?, widened(&w, dt)?);
        let packed = PackedWeight::pack(&wh)?.ok_or_else(|| anyhow::anyhow!("a {dt:?} cpu weight packs"))?;
        anyhow::ensure!(packed.dtype() == dt, "packed in {:?}, not {dt:?}", packed.dtype());
        anyhow::ensure!(bits(&packed.unpack()?)? == bits(&wh)?, "{dt:?}: unpack gives the weight back");
        let packed_f = PackedWeight::pack(&wf)?.ok_or_else(|| anyhow::anyhow!("packs"))?;
        for isa in Isa::available_of(&Isa::FLOAT) {
            let got = linear_with(&x, &wh, isa)?;
            anyhow::ensure!(got.dtype() == DType::F32, "{dt:?} {isa:?}: output {:?}", got.dtype());
            let want = linear_with(&x, &wf, isa)?;
            anyhow::ensure!(bits(&got)? == bits(&want)?, "linear {dt:?} {isa:?} [{m}, {n}, {k}] differs from f32");
            let got = packed.forward_with(&x, isa)?;
            let want = packed_f.forward_with(&x, isa)?;
            anyhow::ensure!(bits(&got)? == bits(&want)?, "packed {dt:?} {isa:?} [{m}, {n}, {k}] differs from f32");
        }
        // The LoRA products (best instruction set): `x · Wᵀ` over rows of `w` and `x · Wt` over
        // a `k`-major `Wt`.
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let (wh_v, wf_v) = (half_values(&wh)?, wf.flatten_all()?.to_vec1::<f32>()?);
        let (mut got, mut want) = (vec![0f32; m * n], vec![0f32; m * n]);
        half_matmul_t(&xs, k, &wh_v, k, (m, n, k), &mut got, n);
        multilora_cpu::float::matmul_t_into(&xs, k, &wf_v, k, (m, n, k), &mut want, n);
        anyhow::ensure!(got == want, "shrink {dt:?} [{m}, {n}, {k}] differs from f32");
        // `w` read as `[n, k]` = a `k`-major `[rows n, cols k]` operand of the expand: x2: [m, n].
        let x2 = rng.tensor(&[m, n], 1.0, DType::F32, &Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let (mut got, mut want) = (vec![0f32; m * k], vec![0f32; m * k]);
        half_matmul(&x2, n, &wh_v, k, (m, k, n), &mut got, k);
        multilora_cpu::float::matmul_into(&x2, n, &wf_v, k, (m, k, n), &mut want, k, false);
        anyhow::ensure!(got == want, "expand {dt:?} [{m}, {k}, {n}] differs from f32");
    }
    Ok(())
}

/// A bf16 or f16 tensor's values, as the kernels' element type.
enum Half {
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

fn half_values(t: &Tensor) -> anyhow::Result<Half> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::BF16 => Half::Bf16(t.to_vec1()?),
        _ => Half::F16(t.to_vec1()?),
    })
}

fn half_matmul_t(x: &[f32], ldx: usize, w: &Half, ldw: usize, mnk: (usize, usize, usize), y: &mut [f32], ldy: usize) {
    match w {
        Half::Bf16(w) => multilora_cpu::float::matmul_t_into(x, ldx, w, ldw, mnk, y, ldy),
        Half::F16(w) => multilora_cpu::float::matmul_t_into(x, ldx, w, ldw, mnk, y, ldy),
    }
}

fn half_matmul(x: &[f32], ldx: usize, w: &Half, ldw: usize, mnk: (usize, usize, usize), y: &mut [f32], ldy: usize) {
    match w {
        Half::Bf16(w) => multilora_cpu::float::matmul_into(x, ldx, w, ldw, mnk, y, ldy, false),
        Half::F16(w) => multilora_cpu::float::matmul_into(x, ldx, w, ldw, mnk, y, ldy, false),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn half_weights_match_their_f32_twin(m in 1usize..80, n in 1usize..70, k in 1usize..70, seed in any::<u64>()) {
        check_half(m, n, k, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn half_weights_match_their_f32_twin_on_threaded_shapes() -> anyhow::Result<()> {
    // Past 64 rows (the packed regime of `linear`), cut into rectangles on the pool, with edges.
    check_half(70, 301, 67, 4)?;
    check_half(131, 97, 260, 5)
}

#[test]
fn half_packed_rows_do_not_depend_on_the_batch() -> anyhow::Result<()> {
    let mut rng = Rng::new(13);
    let x = rng.tensor(&[150, 300], 1.0, DType::F32, &Device::Cpu)?;
    let w = rng.tensor(&[107, 300], 1.0, DType::BF16, &Device::Cpu)?;
    let packed = PackedWeight::pack(&w)?.ok_or_else(|| anyhow::anyhow!("packs"))?;
    for isa in Isa::available_of(&Isa::FLOAT) {
        let all = packed.forward_with(&x, isa)?;
        for (lo, hi) in [(0, 1), (5, 6), (60, 64), (0, 65), (70, 150), (149, 150)] {
            let part = packed.forward_with(&x.i(lo..hi)?, isa)?;
            anyhow::ensure!(bits(&part)? == bits(&all.i(lo..hi)?)?, "{isa:?}: rows {lo}..{hi} differ");
        }
    }
    Ok(())
}

/// A weight packed from its row parts (a fused projection's q, k, v) is the weight packed from
/// their concatenation, in every dtype; parts of different widths or dtypes are not packed.
#[test]
fn packing_from_parts_is_packing_the_concatenation() -> anyhow::Result<()> {
    let mut rng = Rng::new(21);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let parts: Vec<Tensor> =
            [37, 5, 64].iter().map(|&rows| rng.tensor(&[rows, 70], 1.0, dt, &Device::Cpu)).collect::<Result<_, _>>()?;
        let whole = Tensor::cat(&parts, 0)?;
        let from_parts = PackedWeight::pack_parts(&parts)?.ok_or_else(|| anyhow::anyhow!("{dt:?} parts pack"))?;
        anyhow::ensure!(from_parts.dims() == (106, 70) && from_parts.dtype() == dt);
        anyhow::ensure!(bits(&from_parts.unpack()?)? == bits(&whole)?, "{dt:?}: parts unpack to the concatenation");
        let x = rng.tensor(&[9, 70], 1.0, DType::F32, &Device::Cpu)?;
        let packed = PackedWeight::pack(&whole)?.ok_or_else(|| anyhow::anyhow!("packs"))?;
        anyhow::ensure!(bits(&from_parts.forward(&x)?)? == bits(&packed.forward(&x)?)?, "{dt:?}: same products");
    }
    let a = rng.tensor(&[4, 8], 1.0, DType::F32, &Device::Cpu)?;
    anyhow::ensure!(
        PackedWeight::pack_parts(&[a.clone(), rng.tensor(&[4, 9], 1.0, DType::F32, &Device::Cpu)?])?.is_none()
    );
    anyhow::ensure!(PackedWeight::pack_parts(&[a.clone(), a.to_dtype(DType::BF16)?])?.is_none());
    anyhow::ensure!(PackedWeight::pack_parts(&[])?.is_none());
    Ok(())
}
