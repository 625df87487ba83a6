//! The float family against its definitions: exp within 2 ulp and the same bits on every set,
//! softmax and the sampler's passes bit for bit their definitions, the LoRA expand against an
//! f64 sum, and the fused LoRA kernel bit for bit the general path it stands in for.

use proptest::prelude::*;

use super::{FromF32, Rng};
use crate::Isa;
use crate::float::{Elem, exp, exp_sum, lora_rows, matmul_into, matmul_into_with, matmul_t_into_with, softmax};

/// The exponential within 2 ulp of f64's over the softmax's range, 0 below it and for NaN; the
/// sums the same bits on every instruction set.
#[test]
fn exp_is_accurate_and_the_same_on_every_isa() -> anyhow::Result<()> {
    let mut worst = 0f64;
    for i in 0..=200_000 {
        let x = -87.3 * i as f32 / 200_000.0;
        let want = (x as f64).exp();
        let got = exp(x) as f64;
        let ulp = (want as f32).next_up() as f64 - want as f32 as f64;
        worst = worst.max((got - want).abs() / ulp);
    }
    anyhow::ensure!(worst <= 2.0, "exp: {worst} ulp from f64's");
    assert_eq!(exp(-88.0), 0.0);
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp(f32::NAN), 0.0);
    assert_eq!(exp(0.0), 1.0);
    let mut rng = Rng::new(3);
    for len in [1, 15, 16, 17, 64, 100] {
        let s: Vec<f32> = (0..len).map(|_| rng.unit() * 30.0).collect();
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut portable = s.clone();
        let sum = exp_sum(Isa::Portable, &mut portable, max);
        for isa in Isa::available_of(&Isa::FLOAT) {
            let mut got = s.clone();
            let got_sum = exp_sum(isa, &mut got, max);
            let same = got.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits());
            anyhow::ensure!(same && got_sum.to_bits() == sum.to_bits(), "{isa:?} differs at {len}");
        }
    }
    Ok(())
}

/// The softmax of a row, on every instruction set, is the bits of its definition: the row's
/// maximum taken one value after the other, `exp(s - max)` with their sum, one scale by its
/// inverse; rows of every length around the partial maxima's width, with ties, zeros of both
/// signs, −∞ and a NaN among the scores.
#[test]
fn softmax_is_its_definition_on_every_isa() -> anyhow::Result<()> {
    let mut rng = Rng::new(11);
    for len in [1, 2, 15, 16, 17, 31, 33, 65, 100] {
        for case in 0..4 {
            let mut s: Vec<f32> = (0..len).map(|_| rng.unit() * 30.0).collect();
            match case {
                1 => s.iter_mut().step_by(3).for_each(|x| *x = 7.5),
                2 => s.iter_mut().enumerate().for_each(|(i, x)| *x = if i % 2 == 0 { 0.0 } else { -0.0 }),
                3 => {
                    s[len / 2] = f32::NEG_INFINITY;
                    s[len - 1] = f32::NAN;
                }
                _ => {}
            }
            let mut want = s.clone();
            let max = want.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let inv = 1.0 / exp_sum(Isa::Portable, &mut want, max);
            want.iter_mut().for_each(|p| *p *= inv);
            for isa in [Isa::Portable].into_iter().chain(Isa::available_of(&Isa::FLOAT)) {
                let mut got = s.clone();
                softmax(isa, &mut got);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                anyhow::ensure!(same, "{isa:?}: {len} scores, case {case}");
            }
        }
    }
    Ok(())
}

/// The sampler's passes: `row_max` is the maximum taken one value after the other (NaN passed
/// over, +∞ kept), `argmax` its first index (ties in other lanes, NaN, −∞), `exp_weights` each weight `exp((x − max) · scale)` with min-p's floor and
/// their sum; all the same bits on every instruction set, the weights within 4 ulp of f64's
/// exponential of the f32 argument,
/// 1 exactly at the maximum, 0 for NaN and −∞.
#[test]
fn sampler_passes_are_the_same_on_every_isa() -> anyhow::Result<()> {
    use crate::logits::{argmax_with, exp_weights_with, row_max_with};
    let mut rng = Rng::new(5);
    for len in [1, 15, 16, 17, 100, 4099] {
        for case in 0..3 {
            let mut x: Vec<f32> = (0..len).map(|_| rng.unit() * 20.0).collect();
            if case == 1 && len > 2 {
                x[len / 2] = f32::NEG_INFINITY;
                x[len - 1] = f32::NAN;
                // Ties for the maximum, in different lanes.
                let top = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                x[len / 3] = top;
                x[0] = top;
            }
            let want_max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let (scale, floor) = if case == 2 { (1.0 / 0.7, 0.05) } else { (1.0, 0.0) };
            let mut want = vec![0f32; len];
            let want_sum = exp_weights_with(Isa::Portable, &x, &mut want, want_max, scale, floor);
            for (i, (&v, &w)) in x.iter().zip(&want).enumerate() {
                let exact = (((v - want_max) * scale) as f64).exp();
                if (exact - floor as f64).abs() < 1e-6 {
                    continue; // at the floor, f32's rounding decides
                }
                let exact = if v.is_nan() || exact < floor as f64 { 0.0 } else { exact };
                let ulp = ((exact as f32).next_up() - exact as f32) as f64;
                anyhow::ensure!(
                    (w as f64 - exact).abs() <= 4.0 * ulp || (w == 0.0 && exact < 1e-6),
                    "{len}/{case} #{i}"
                );
            }
            let at_max = x.iter().position(|&v| v == want_max).expect("a maximum");
            assert_eq!(want[at_max], 1.0);
            let first = x.iter().position(|&v| v == want_max).expect("a maximum");
            for isa in Isa::available_of(&Isa::FLOAT) {
                assert_eq!(row_max_with(isa, &x).to_bits(), want_max.to_bits(), "{isa:?} {len}/{case}");
                assert_eq!(argmax_with(isa, &x), first, "{isa:?} {len}/{case}");
                let mut got = vec![0f32; len];
                let sum = exp_weights_with(isa, &x, &mut got, want_max, scale, floor);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                anyhow::ensure!(same && sum.to_bits() == want_sum.to_bits(), "{isa:?} differs at {len}/{case}");
            }
        }
    }
    for isa in Isa::available_of(&Isa::FLOAT) {
        let inf = [1.0, f32::INFINITY, f32::NAN, f32::INFINITY];
        assert_eq!((row_max_with(isa, &inf), argmax_with(isa, &inf)), (f32::INFINITY, 1));
        assert_eq!((row_max_with(isa, &[f32::NAN]), argmax_with(isa, &[f32::NAN])), (f32::NEG_INFINITY, 0));
        let low: Vec<f32> = (0..40).map(|i| if i < 20 { f32::NAN } else { f32::NEG_INFINITY }).collect();
        assert_eq!(argmax_with(isa, &low), 20, "{isa:?}: the first −∞");
        assert_eq!(argmax_with(isa, &[]), 0);
    }
    Ok(())
}

/// `matmul_into` (the LoRA expand over a `k`-major `Bᵀ`) against an f64 sum, with strided rows
/// and widths that leave a tail of columns past the last full vector pair.
fn check_outer(m: usize, n: usize, k: usize, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed);
    let (ldx, ldw, ldy) = (k + 3, n + 5, n + 2);
    let x: Vec<f32> = rng.vec(m * ldx, 1.0);
    let wt: Vec<f32> = rng.vec(k.max(1) * ldw, 1.0);
    let mut y = vec![f32::NAN; m * ldy];
    matmul_into(&x, ldx, &wt, ldw, (m, n, k), &mut y, ldy, false);
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

/// The decode-shaped LoRA kernel (`lora_rows`) against the general path it stands in for on a
/// small segment: per row the shrink (`matmul_t_into`), the expand into a delta (`matmul_into`),
/// the delta added into `y` — bit for bit, on each instruction set of this CPU, for 1 to 4 rows
/// lying apart in a larger input, ranks on and off the shrink's groups of four, `k` and `out`
/// with tails past the last vector.
fn check_lora_rows<E: Elem + FromF32>(
    (rows, k, rank, out): (usize, usize, usize, usize),
    seed: u64,
) -> anyhow::Result<()> {
    let dt = E::KIND;
    let mut rng = Rng::new(seed);
    let x: Vec<f32> = rng.vec(3 * rows * k, 1.0);
    let a: Vec<E> = rng.vec(rank * k, 1.0).into_iter().map(E::from_f32).collect();
    let bt: Vec<E> = rng.vec(rank * out, 1.0).into_iter().map(E::from_f32).collect();
    let y0: Vec<f32> = rng.vec(rows * out, 1.0);
    let xs: Vec<&[f32]> = (0..rows).map(|i| &x[(3 * i + 1) * k..][..k]).collect();
    for isa in Isa::available_of(&Isa::FLOAT) {
        let mut got = y0.clone();
        let mut cells: Vec<&mut [f32]> = got.chunks_mut(out).collect();
        let mut scratch = vec![f32::NAN; rows * rank];
        lora_rows(isa, &xs, (&a, &bt, rank), &mut cells, &mut scratch);
        let mut want = y0.clone();
        for (xr, yr) in xs.iter().zip(want.chunks_mut(out)) {
            let (mut s, mut d) = (vec![f32::NAN; rank], vec![f32::NAN; out]);
            matmul_t_into_with(isa, xr, k, &a, k, (1, rank, k), &mut s, rank);
            matmul_into_with(isa, &s, rank, &bt, out, (1, out, rank), &mut d, out, false);
            yr.iter_mut().zip(&d).for_each(|(o, v)| *o += v);
        }
        let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
        anyhow::ensure!(same, "lora_rows {dt:?} {isa:?} {rows} × [{k} → {rank} → {out}] differs from the general path");
    }
    Ok(())
}

fn check_lora_rows_all(shape: (usize, usize, usize, usize), seed: u64) -> anyhow::Result<()> {
    check_lora_rows::<f32>(shape, seed)?;
    check_lora_rows::<half::bf16>(shape, seed)?;
    check_lora_rows::<half::f16>(shape, seed)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn lora_rows_match_the_general_path(
        rows in 1usize..=4,
        k in 1usize..80,
        rank in 1usize..12,
        out in 1usize..100,
        seed in any::<u64>(),
    ) {
        check_lora_rows_all((rows, k, rank, out), seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

#[test]
fn lora_rows_match_the_general_path_on_model_shapes() -> anyhow::Result<()> {
    // SmolLM2's projections at rank 16 (its down projection's k = 1,536), and a rank of 5.
    check_lora_rows_all((2, 576, 16, 1536), 21)?;
    check_lora_rows_all((4, 1536, 16, 576), 22)?;
    check_lora_rows_all((3, 576, 5, 192), 23)?;
    // One and two rows take 4-vector panels, then 2-vector ones, then the scalar tail.
    check_lora_rows_all((1, 96, 7, 4 * 16 + 2 * 16 + 5), 24)?;
    check_lora_rows_all((2, 576, 16, 1536 + 32 + 3), 25)
}
