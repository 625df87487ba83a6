//! `QuantWeight`'s layouts against candle's GGML blocks (every value dequantized bit for bit as
//! candle does it), its API (`stack`, `dequantize_rows`, `describe`) and its typed errors; the
//! helpers the kernel tests (`quant_kernels.rs`) share: seeded GGML weights and the error bound
//! a quantized product is held to.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::{Rng, bits};
use multilora_cpu::Isa;
use multilora_cpu::quant::QuantType;

use crate::{Error, QuantWeight};

/// A seeded GGML weight `[n, k]` of type `qt`, made by candle's quantizer from values with
/// per-row spreads and offsets (so the minima of Q4_1, Q5_1 and the K-quants matter): the
/// weight, candle's dequantization of it, and its GGML bytes.
pub(crate) fn ggml_weight(
    qt: QuantType,
    n: usize,
    k: usize,
    seed: u64,
) -> anyhow::Result<(QuantWeight, Tensor, Vec<u8>)> {
    let mut rng = Rng::new(seed);
    let mut v = Vec::with_capacity(n * k);
    for _ in 0..n {
        let (spread, shift) = (0.2 + rng.unit().abs(), 0.5 * rng.unit());
        v.extend((0..k).map(|_| rng.unit() * spread + shift));
    }
    let w = Tensor::from_vec(v, (n, k), &Device::Cpu)?;
    let q = QTensor::quantize(&w, crate::ggml_dtype(qt))?;
    let bytes = q.data()?.to_vec();
    let deq = q.dequantize(&Device::Cpu)?;
    Ok((QuantWeight::from_bytes(qt, n, k, &bytes)?, deq, bytes))
}

fn f16_at(b: &[u8], at: usize) -> f64 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f64()
}

/// For each column and 32-value block, the largest `|min term|` of its values (`m`, or the
/// K-quants' `dmin · min`), read from the GGML bytes (0 for the types without one): a kernel
/// adds the scale and the minimum parts of a value separately, which may nearly cancel.
pub(crate) fn min_terms(qt: QuantType, bytes: &[u8], n: usize, k: usize) -> Vec<f64> {
    let (be, bb) = (qt.block_elems(), qt.block_bytes());
    let mut out = vec![0f64; n * (k / 32)];
    for (blk, b) in bytes.chunks_exact(bb).enumerate() {
        let (j, first) = (blk / (k / be), (blk % (k / be)) * be / 32);
        for s in 0..be / 32 {
            let m = match qt {
                QuantType::Q4_1 | QuantType::Q5_1 => f16_at(b, 2).abs(),
                QuantType::Q4K | QuantType::Q5K => {
                    // GGML's 6-bit minimum `s` of the block.
                    let q = &b[4..16];
                    let mn = if s < 4 { q[s + 4] & 63 } else { (q[s + 4] >> 4) | ((q[s] >> 6) << 4) };
                    f16_at(b, 2).abs() * mn as f64
                }
                QuantType::Q2K => f16_at(b, 82).abs() * ((b[2 * s] >> 4).max(b[2 * s + 1] >> 4)) as f64,
                _ => 0.0,
            };
            out[j * (k / 32) + first + s] = m;
        }
    }
    out
}

/// The scale of each activation block, as the kernels compute it (`max|x| / (127 · 254)` in f32).
fn act_scales(x: &[f32]) -> Vec<f64> {
    x.chunks_exact(32).map(|b| (b.iter().fold(0f32, |a, v| a.max(v.abs())) / (127.0 * 254.0)) as f64).collect()
}

/// Holds each output of a quantized product `got: [m, n]` of `x: [m, k]` against the f64 product
/// with the dequantized weight `w: [n, k]`, to the error of quantizing `x` (each value moves by
/// at most half its block's scale `d`) plus the f32 rounding of the block sums:
///
/// `|got − x·wᵀ| ≤ Σ_b (d_b/2)·(1 + ε)·Σ_{t∈b} |w_t| + γ · Σ_b Σ_{t∈b} (|w_t| + 2·m_b)·(|x_t| + d_b/2)`
///
/// with `m_b` the block's [`min_terms`], `ε = 10⁻²` (`x / d`, up to 32,258, is rounded in f32
/// before it is rounded to an integer: by up to 0.004 of a step) and
/// `γ = (4·nb + 6)·u / (1 − (4·nb + 6)·u)`, `u = 2⁻²⁴`, for `nb` blocks (each adds a few f32
/// roundings, its integer sum's conversion to f32 among them, and the f32 values of `w` are
/// rounded GGML values).
pub(crate) fn ensure_quant_bound(got: &Tensor, x: &Tensor, w: &Tensor, mins: &[f64], what: &str) -> anyhow::Result<()> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    anyhow::ensure!(got.dims() == [m, n], "{what}: output {:?}, expected [{m}, {n}]", got.dims());
    let (got, x, w) = (got.to_vec2::<f32>()?, x.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
    let nb = k / 32;
    let u = (-24f64).exp2();
    let gamma = (4 * nb + 6) as f64 * u / (1.0 - (4 * nb + 6) as f64 * u);
    for (i, xr) in x.iter().enumerate() {
        let d = act_scales(xr);
        for (j, wr) in w.iter().enumerate() {
            let (mut exact, mut quant, mut mag) = (0f64, 0f64, 0f64);
            for (p, (&xv, &wv)) in xr.iter().zip(wr).enumerate() {
                let (b, wv, xv) = (p / 32, wv as f64, xv as f64);
                exact += wv * xv;
                quant += d[b] / 2.0 * (1.0 + 1e-2) * wv.abs();
                mag += (wv.abs() + 2.0 * mins[j * nb + b]) * (xv.abs() + d[b] / 2.0);
            }
            let bound = quant + gamma * mag;
            let g = got[i][j] as f64;
            anyhow::ensure!(
                (g - exact).abs() <= bound,
                "{what}: output ({i}, {j}): {g} vs {exact}, error {} over the bound {bound}",
                (g - exact).abs()
            );
        }
    }
    Ok(())
}

#[test]
fn every_layout_dequantizes_as_candle_does() -> anyhow::Result<()> {
    for (s, qt) in QuantType::ALL.into_iter().enumerate() {
        // 33 columns: two full tiles and one of a single column.
        let k = 2 * qt.block_elems().max(256);
        let (w, deq, _) = ggml_weight(qt, 33, k, 10 + s as u64)?;
        anyhow::ensure!(bits(&w.dequantize()?)? == bits(&deq)?, "{qt}: dequantize differs from candle's");
        let rows = [32u32, 0, 7, 32, 16];
        let want =
            Tensor::cat(&rows.iter().map(|&r| deq.get(r as usize)).collect::<candle_core::Result<Vec<_>>>()?, 0)?;
        let got = w.dequantize_rows(&rows)?;
        anyhow::ensure!(got.dims() == [5, k], "{qt}: rows of shape {:?}", got.dims());
        anyhow::ensure!(bits(&got)? == bits(&want.reshape((5, k))?)?, "{qt}: dequantize_rows differs");
        anyhow::ensure!(w.dequantize_rows(&[])?.dims() == [0, k], "{qt}: no rows");
    }
    Ok(())
}

#[test]
fn resident_bytes_are_about_the_ggml_bytes() -> anyhow::Result<()> {
    for qt in QuantType::ALL {
        let k = qt.block_elems().max(256);
        let (w, _, bytes) = ggml_weight(qt, 64, k, 3)?;
        let ratio = w.storage_bytes() as f64 / bytes.len() as f64;
        // The K-quants' packed 6-bit scales are held one per byte.
        anyhow::ensure!((1.0..=1.04).contains(&ratio), "{qt}: {} bytes for {} of GGML", w.storage_bytes(), bytes.len());
        if qt.block_elems() == 32 || matches!(qt, QuantType::Q2K | QuantType::Q6K) {
            anyhow::ensure!(w.storage_bytes() == bytes.len(), "{qt}: not the GGML bytes");
        }
    }
    Ok(())
}

#[test]
fn types_match_ggml() {
    for qt in QuantType::ALL {
        assert_eq!(crate::quant_type(crate::ggml_dtype(qt)), Some(qt));
        assert_eq!(qt.block_elems(), crate::ggml_dtype(qt).block_size(), "{qt}");
        assert_eq!(qt.block_bytes(), crate::ggml_dtype(qt).type_size(), "{qt}");
    }
    for t in [GgmlDType::F32, GgmlDType::F16, GgmlDType::BF16, GgmlDType::Q8_1, GgmlDType::Q8K] {
        assert_eq!(crate::quant_type(t), None, "{t:?}");
    }
    assert_eq!(QuantType::Q4K.name(), "Q4_K");
    assert_eq!(Isa::available_of(&Isa::QUANT)[0], Isa::Portable);
    assert!(Isa::available_of(&Isa::QUANT).contains(&Isa::best()));
}

#[test]
fn stacking_mixed_types_is_the_parts_side_by_side() -> anyhow::Result<()> {
    let k = 512;
    let parts =
        [(QuantType::Q4K, 40), (QuantType::Q6K, 17), (QuantType::Q8_0, 5), (QuantType::Q4K, 3), (QuantType::Q2K, 16)];
    let mut ws = Vec::new();
    for (s, &(qt, n)) in parts.iter().enumerate() {
        ws.push(ggml_weight(qt, n, k, 20 + s as u64)?.0);
    }
    let stacked = QuantWeight::stack(ws.clone())?;
    anyhow::ensure!(stacked.dims() == (81, k), "dims {:?}", stacked.dims());
    anyhow::ensure!(
        stacked.types() == [QuantType::Q4K, QuantType::Q6K, QuantType::Q8_0, QuantType::Q2K],
        "types {:?}",
        stacked.types()
    );
    anyhow::ensure!(stacked.storage_bytes() == ws.iter().map(|w| w.storage_bytes()).sum::<usize>(), "bytes");
    let deq = Tensor::cat(&ws.iter().map(|w| w.dequantize()).collect::<crate::Result<Vec<_>>>()?, 0)?;
    anyhow::ensure!(bits(&stacked.dequantize()?)? == bits(&deq)?, "stacked dequantize");
    anyhow::ensure!(
        bits(&stacked.dequantize_rows(&[80, 40, 57, 0])?)?
            == bits(&deq.index_select(&Tensor::new(&[80u32, 40, 57, 0], &Device::Cpu)?, 0)?)?,
        "stacked rows"
    );
    // Each column is computed by the same operations as in its part, on every instruction set.
    let x = Rng::new(5).tensor(&[70, k], 1.0, DType::F32, &Device::Cpu)?;
    for isa in Isa::available_of(&Isa::QUANT) {
        let side = Tensor::cat(&ws.iter().map(|w| w.forward_with(&x, isa)).collect::<crate::Result<Vec<_>>>()?, 1)?;
        anyhow::ensure!(bits(&stacked.forward_with(&x, isa)?)? == bits(&side)?, "{isa:?}: stacked forward");
    }
    // Stacks of stacks flatten.
    let again = QuantWeight::stack(vec![stacked.clone(), ws[1].clone()])?;
    anyhow::ensure!(again.dims() == (98, k) && again.types().len() == 4, "{again:?}");
    Ok(())
}

#[test]
fn bad_bytes_shapes_and_rows_are_typed_errors() -> anyhow::Result<()> {
    let (w, _, bytes) = ggml_weight(QuantType::Q4_1, 3, 64, 1)?;
    let err = |r: crate::Result<QuantWeight>| r.err().map(|e| (e.kind(), e.to_string()));
    let e = err(QuantWeight::from_bytes(QuantType::Q4_1, 3, 64, &bytes[1..]));
    assert_eq!(e, Some(("quant_bytes", "Q4_1 weight [3, 64]: 119 bytes, expected 120".into())));
    let e = err(QuantWeight::from_bytes(QuantType::Q4_1, 4, 64, &bytes));
    assert_eq!(e.map(|e| e.0), Some("quant_bytes"));
    let e = err(QuantWeight::from_bytes(QuantType::Q4K, 3, 64, &bytes));
    assert_eq!(e, Some(("quant_shape", "Q4_K weight [3, 64]: k is not a multiple of the block size 256".into())));
    let e = err(QuantWeight::from_bytes(QuantType::Q8_0, 0, 64, &[]));
    assert_eq!(e.map(|e| e.0), Some("quant_shape"));
    let e = err(QuantWeight::from_bytes(QuantType::Q8_0, usize::MAX / 2, 64, &bytes));
    assert_eq!(e, Some(("quant_shape", format!("Q8_0 weight [{}, 64]: the shape is too large", usize::MAX / 2))));

    let e = w.dequantize_rows(&[0, 2, 3, 1]).err().map(|e| (e.kind(), e.to_string()));
    assert_eq!(
        e,
        Some((
            "quant_row_out_of_range",
            "quantized weight rows: index 3 at position 2 is out of range for 3 rows".into()
        ))
    );

    let x = Tensor::zeros((2, 32), DType::F32, &Device::Cpu)?;
    let e = w.forward(&x).err().map(|e| (e.kind(), e.to_string()));
    assert_eq!(e, Some(("shape_mismatch", "quantized linear: input has shape [2, 32], expected [2, 64]".into())));
    let e = w.forward(&Tensor::zeros((2, 2, 64), DType::F32, &Device::Cpu)?).err().map(|e| e.kind());
    assert_eq!(e, Some("shape_mismatch"));

    let (w2, _, _) = ggml_weight(QuantType::Q8_0, 2, 32, 1)?;
    let e = QuantWeight::stack(vec![w.clone(), w2]).err().map(|e| (e.kind(), e.to_string()));
    assert_eq!(e, Some(("quant_stack", "stacking quantized weights: part 1 has k = 32, part 0 has k = 64".into())));
    assert_eq!(QuantWeight::stack(vec![]).err().map(|e| e.kind()), Some("quant_stack"));
    Ok(())
}

#[test]
fn describe_debug_and_empty_batches() -> anyhow::Result<()> {
    let (a, _, _) = ggml_weight(QuantType::Q4_1, 16, 64, 1)?;
    let (b, _, _) = ggml_weight(QuantType::Q8_0, 8, 64, 2)?;
    let w = QuantWeight::stack(vec![a, b])?;
    let isa = match Isa::best() {
        Isa::Amx => "AMX-INT8 for products of over 64 rows, AVX-512 VNNI below",
        other => other.describe(),
    };
    assert_eq!(w.describe(), format!("Q4_1: 16-bit activations, {isa}; Q8_0: 16-bit activations, {isa}"));
    assert_eq!(format!("{w:?}"), "QuantWeight[24, 64, Q4_1+Q8_0]");
    let y = w.forward(&Tensor::zeros((0, 64), DType::F32, &Device::Cpu)?)?;
    assert_eq!(y.dims(), [0, 24]);
    // Zeros in, zeros out (a block of zeros has scale 0).
    let y = w.forward(&Tensor::zeros((3, 64), DType::F32, &Device::Cpu)?)?;
    assert!(y.flatten_all()?.to_vec1::<f32>()?.iter().all(|&v| v == 0.0));
    Ok(())
}

#[test]
fn handles_are_send_sync_and_cheap_to_clone() -> anyhow::Result<()> {
    fn send_sync<T: Send + Sync + Clone + std::fmt::Debug>() {}
    send_sync::<QuantWeight>();
    let (w, _, _) = ggml_weight(QuantType::Q4_0, 16, 32, 1)?;
    let c = w.clone();
    assert_eq!(c.storage_bytes(), w.storage_bytes());
    let _: fn(&Error) -> &'static str = Error::kind;
    Ok(())
}
