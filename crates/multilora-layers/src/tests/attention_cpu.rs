//! The CPU decode attention ([`decode_attention_rows`]) against the gathered oracle
//! ([`paged_decode_attention_slow`]), and its exponential against f64's, on every instruction set
//! this CPU has.

use candle_core::{DType, Device, Tensor};

use super::{Rng, bits, rel_err};
use crate::ops::attention::cpu::decode_attention_rows_with;
use crate::ops::gemm::{Isa, exp, exp_sum, softmax};
use crate::{PagedDecodeDims, decode_attention_rows, paged_decode_attention_slow};

/// GQA groups of 1 to 4, head sizes with and without a vector tail (and past one pass of the
/// one-pass kernel's 64 columns), blocks of 16 and 5 tokens, contexts from 1 to past four blocks
/// through shuffled block tables; f32, bf16 and f16 caches; on every instruction set this CPU has
/// (AVX-512 takes the one-pass kernel where the shape allows). Each row is then run alone and
/// must give the same bits as in the batch.
#[test]
fn decode_rows_match_the_oracle_and_are_batch_invariant() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    let cases = [
        (5, 9, 3, 64, 16, DType::F32),
        (3, 4, 4, 40, 5, DType::F32),
        (4, 8, 2, 64, 16, DType::BF16),
        (2, 4, 1, 24, 16, DType::F16),
        (6, 2, 2, 128, 5, DType::F32),
        (4, 9, 3, 64, 16, DType::F16),
        (3, 6, 3, 80, 16, DType::F16),
        (3, 10, 2, 96, 4, DType::BF16),
    ];
    for (n, heads, kv_heads, hd, bs, dtype) in cases {
        let d = PagedDecodeDims { heads, kv_heads, head_dim: hd, block_size: bs };
        let num_blocks = 24;
        let (lens, tables, max_blocks) = rng.paged_contexts(n, bs, num_blocks, 70);
        let rows: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let t = &tables[s * max_blocks..];
                (0..len).map(|p| t[(p as usize) / bs] * bs as u32 + p % bs as u32).collect()
            })
            .collect();
        let q = rng.tensor(&[n, heads, hd], 0.5, DType::F32, &dev)?;
        let k = rng.tensor(&[num_blocks * bs, kv_heads * hd], 1.0, dtype, &dev)?;
        let v = rng.tensor(&[num_blocks * bs, kv_heads * hd], 1.0, dtype, &dev)?;
        let bt = Tensor::from_vec(tables.clone(), (n, max_blocks), &dev)?;
        let cl = Tensor::from_vec(lens.clone(), n, &dev)?;
        let want = paged_decode_attention_slow(
            &q.to_dtype(DType::F32)?,
            &k.to_dtype(DType::F32)?,
            &v.to_dtype(DType::F32)?,
            &bt,
            &cl,
            d,
        )?;
        for isa in Isa::all_available() {
            let got = decode_attention_rows_with(isa, &q, &k, &v, &rows, d)?.expect("f32 queries over a CPU cache");
            let err = rel_err(&got, &want)?;
            let case = format!("n {n} heads {heads}/{kv_heads} d {hd} bs {bs} {dtype:?} {isa:?}");
            anyhow::ensure!(err <= 1e-6, "{case}: relative error {err:e}");
            for (i, r) in rows.iter().enumerate() {
                let q1 = q.narrow(0, i, 1)?;
                let alone = decode_attention_rows_with(isa, &q1, &k, &v, std::slice::from_ref(r), d)?.expect("cpu");
                anyhow::ensure!(bits(&alone)? == bits(&got.narrow(0, i, 1)?)?, "{case}: row {i} differs alone");
            }
        }
        let best = decode_attention_rows(&q, &k, &v, &rows, d)?.expect("cpu");
        let on_best = decode_attention_rows_with(Isa::best(), &q, &k, &v, &rows, d)?.expect("cpu");
        anyhow::ensure!(bits(&best)? == bits(&on_best)?, "the default is the best instruction set");
    }
    Ok(())
}

/// A cache row past the end, an empty context and a query of the wrong shape are errors; a
/// query that is not f32 is left to the general path.
#[test]
fn decode_rows_refuse_bad_operands() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let d = PagedDecodeDims { heads: 4, kv_heads: 2, head_dim: 8, block_size: 4 };
    let q = Tensor::zeros((1, 4, 8), DType::F32, &dev)?;
    let c = Tensor::zeros((8, 16), DType::F32, &dev)?;
    assert!(decode_attention_rows(&q, &c, &c, &[vec![0, 8]], d).is_err(), "a row past the cache");
    assert!(decode_attention_rows(&q, &c, &c, &[vec![]], d).is_err(), "an empty context");
    assert!(decode_attention_rows(&q, &c, &c, &[vec![0], vec![1]], d).is_err(), "two rows for one query");
    let wide = Tensor::zeros((8, 12), DType::F32, &dev)?;
    assert!(decode_attention_rows(&q, &wide, &wide, &[vec![0]], d).is_err(), "a cache of the wrong width");
    let half = q.to_dtype(DType::BF16)?;
    assert!(decode_attention_rows(&half, &c, &c, &[vec![0]], d)?.is_none(), "bf16 queries");
    Ok(())
}

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
        for isa in Isa::all_available() {
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
            for isa in [Isa::Portable].into_iter().chain(Isa::all_available()) {
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
            for isa in Isa::all_available() {
                assert_eq!(row_max_with(isa, &x).to_bits(), want_max.to_bits(), "{isa:?} {len}/{case}");
                assert_eq!(argmax_with(isa, &x), first, "{isa:?} {len}/{case}");
                let mut got = vec![0f32; len];
                let sum = exp_weights_with(isa, &x, &mut got, want_max, scale, floor);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                anyhow::ensure!(same && sum.to_bits() == want_sum.to_bits(), "{isa:?} differs at {len}/{case}");
            }
        }
    }
    for isa in Isa::all_available() {
        let inf = [1.0, f32::INFINITY, f32::NAN, f32::INFINITY];
        assert_eq!((row_max_with(isa, &inf), argmax_with(isa, &inf)), (f32::INFINITY, 1));
        assert_eq!((row_max_with(isa, &[f32::NAN]), argmax_with(isa, &[f32::NAN])), (f32::NEG_INFINITY, 0));
        let low: Vec<f32> = (0..40).map(|i| if i < 20 { f32::NAN } else { f32::NEG_INFINITY }).collect();
        assert_eq!(argmax_with(isa, &low), 20, "{isa:?}: the first −∞");
        assert_eq!(argmax_with(isa, &[]), 0);
    }
    Ok(())
}
