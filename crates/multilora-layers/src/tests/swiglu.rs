//! The fused `silu(gate) · up` ([`silu_mul`]) against f64's, and the same bits on every
//! instruction set and whatever the rows around it.

use candle_core::{DType, Device, Tensor};

use super::{Rng, bits};
use crate::silu_mul;
use multilora_cpu::Isa;

/// Within 4 ulp of the f64 value (`g / (1 + e⁻ᵍ) · u`) over gates from -100 to 100 (0 where it is
/// below 1e-35), odd widths;
/// each row alone gives its bits in the batch; NaN stays NaN; a wrong width is an error and an
/// f16 input is left to tensor ops.
#[test]
fn silu_mul_is_accurate_and_row_invariant() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(11);
    for (rows, inter) in [(1, 1), (3, 17), (16, 1536), (70, 100)] {
        let v: Vec<f32> = (0..rows * 2 * inter)
            .map(|i| if i % (2 * inter) < inter { rng.unit() * 100.0 } else { rng.unit() * 3.0 })
            .collect();
        let gu = Tensor::from_vec(v.clone(), (rows, 2 * inter), &dev)?;
        let got = silu_mul(&gu, inter)?.expect("f32 on the CPU");
        let out = got.flatten_all()?.to_vec1::<f32>()?;
        for r in 0..rows {
            for j in 0..inter {
                let (g, u) = (v[r * 2 * inter + j] as f64, v[r * 2 * inter + inter + j] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                let got = out[r * inter + j] as f64;
                let ulp = ((want as f32).abs().next_up() - (want as f32).abs()) as f64;
                // Below g = -87.3 the exponential flushes to 0: |silu(g) · u| < 1e-35 there.
                anyhow::ensure!((got - want).abs() <= (4.0 * ulp).max(1e-35), "g {g} u {u}: {got} vs {want}");
            }
            let alone = silu_mul(&gu.narrow(0, r, 1)?, inter)?.expect("cpu");
            anyhow::ensure!(bits(&alone)? == bits(&got.narrow(0, r, 1)?)?, "row {r} of {rows} differs alone");
        }
    }
    let nan = Tensor::from_vec(vec![f32::NAN, 1.0], (1, 2), &dev)?;
    assert!(silu_mul(&nan, 1)?.expect("cpu").to_vec2::<f32>()?[0][0].is_nan());
    assert!(silu_mul(&Tensor::zeros((2, 5), DType::F32, &dev)?, 2).is_err());
    assert!(silu_mul(&Tensor::zeros((2, 4), DType::F16, &dev)?, 2)?.is_none());
    Ok(())
}

/// The kernel gives the portable bits on every instruction set this CPU has.
#[test]
fn silu_mul_is_the_same_on_every_isa() {
    let mut rng = Rng::new(5);
    let g: Vec<f32> = (0..1000).map(|_| rng.unit() * 50.0).collect();
    let u: Vec<f32> = (0..1000).map(|_| rng.unit()).collect();
    let mut want = vec![0f32; 1000];
    multilora_cpu::float::silu_mul(Isa::Portable, &g, &u, &mut want);
    for isa in Isa::available_of(&Isa::FLOAT) {
        let mut got = vec![0f32; 1000];
        multilora_cpu::float::silu_mul(isa, &g, &u, &mut got);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?}");
    }
}

/// GELU's tanh form times up ([`crate::gelu_tanh_mul`]) against f64's `0.5 · g · (1 + tanh(√(2/π)
/// · (g + 0.044715 g³))) · u` over gates from -10 to 10, within 1e-5 of it relative (the
/// sigmoid's f32 argument, `|2z|` up to ~100, carries ~1.5e-7 · |2z|; torch's f32 GELU no less) or
/// 1e-30 where it underflows; the same bits on every instruction set and for a row alone.
#[test]
fn gelu_tanh_mul_is_accurate_and_the_same_on_every_isa() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(13);
    let (rows, inter) = (9, 257);
    let v: Vec<f32> = (0..rows * 2 * inter)
        .map(|i| if i % (2 * inter) < inter { rng.unit() * 10.0 } else { rng.unit() * 3.0 })
        .collect();
    let gu = Tensor::from_vec(v.clone(), (rows, 2 * inter), &dev)?;
    let got = crate::gelu_tanh_mul(&gu, inter)?.expect("f32 on the CPU");
    let out = got.flatten_all()?.to_vec1::<f32>()?;
    for r in 0..rows {
        for j in 0..inter {
            let (g, u) = (v[r * 2 * inter + j] as f64, v[r * 2 * inter + inter + j] as f64);
            let c = (2.0 / std::f64::consts::PI).sqrt();
            // `0.5 · (1 + tanh(z))` is `σ(2z)`, which f64 keeps exact where `1 + tanh` cancels.
            let want = g / (1.0 + (-2.0 * c * (g + 0.044715 * g * g * g)).exp()) * u;
            let got = out[r * inter + j] as f64;
            anyhow::ensure!((got - want).abs() <= (1e-5 * want.abs()).max(1e-30), "g {g} u {u}: {got} vs {want}");
        }
        let alone = crate::gelu_tanh_mul(&gu.narrow(0, r, 1)?, inter)?.expect("cpu");
        anyhow::ensure!(bits(&alone)? == bits(&got.narrow(0, r, 1)?)?, "row {r} of {rows} differs alone");
    }
    let (g, u) = (&v[..inter], &v[inter..2 * inter]);
    let mut want = vec![0f32; inter];
    multilora_cpu::float::gelu_tanh_mul(Isa::Portable, g, u, &mut want);
    for isa in Isa::available_of(&Isa::FLOAT) {
        let mut got = vec![0f32; inter];
        multilora_cpu::float::gelu_tanh_mul(isa, g, u, &mut got);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?}");
    }
    Ok(())
}
