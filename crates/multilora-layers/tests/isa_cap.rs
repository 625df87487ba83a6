//! The process-wide cap on the kernels' instruction sets (`Isa::set_max`), in a test binary of its
//! own: it changes what every kernel's `best` picks, which the other tests must not see.

use multilora_layers::{Isa, QuantIsa, QuantType, QuantWeight};

#[test]
fn the_cap_bounds_every_best_and_changes_no_bit() -> anyhow::Result<()> {
    assert_eq!(Isa::max(), Isa::Avx512, "no cap by default");
    let (n, k, m) = (48, 96, 5);
    let x = candle_core::Tensor::randn(0f32, 1.0, (m, k), &candle_core::Device::Cpu)?;
    let w = candle_core::Tensor::randn(0f32, 0.1, (n, k), &candle_core::Device::Cpu)?;
    let q = candle_core::quantized::QTensor::quantize(&w, candle_core::quantized::GgmlDType::Q4_1)?;
    let qw = QuantWeight::from_bytes(QuantType::Q4_1, n, k, &q.data()?)?;
    let bits = |t: candle_core::Tensor| -> anyhow::Result<Vec<u32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
    };
    let uncapped = bits(qw.forward(&x)?)?;
    for (cap, widest, widest_quant) in [
        (Isa::Avx2, Isa::Avx2, QuantIsa::Avx2),
        (Isa::Portable, Isa::Portable, QuantIsa::Portable),
        (Isa::Avx512, Isa::Avx512, QuantIsa::Avx512Vnni),
    ] {
        Isa::set_max(cap);
        assert_eq!(Isa::max(), cap);
        let (best, quant) = (Isa::best(), QuantIsa::best());
        // What the CPU has, bounded by the cap.
        let want = [widest, Isa::Avx2, Isa::Portable].into_iter().find(|i| i.available()).unwrap_or(Isa::Portable);
        assert_eq!(best, want, "{cap:?}");
        let order = [QuantIsa::Avx512Vnni, QuantIsa::AvxVnni, QuantIsa::Avx2, QuantIsa::Portable];
        let from = order.iter().position(|&i| i == widest_quant).unwrap_or(0);
        let want_q = order[from..].iter().copied().find(|i| i.available()).unwrap_or(QuantIsa::Portable);
        assert_eq!(quant, want_q, "{cap:?}");
        // The quantized products give the same bits on every set.
        assert_eq!(bits(qw.forward(&x)?)?, uncapped, "{cap:?}");
    }
    Ok(())
}
