//! The process-wide cap on the kernels' instruction sets (`Isa::set_max`), in a test binary of its
//! own: it changes what every kernel's `best` picks, which the other tests must not see.

use multilora_cpu::Isa;
use multilora_cpu::quant::{QuantMatrix, QuantType};

/// A Q8_0 weight `[n, k]` of seeded quants and small scales.
fn q8_weight(n: usize, k: usize) -> QuantMatrix {
    let mut bytes = Vec::with_capacity(n * k / 32 * QuantType::Q8_0.block_bytes());
    let mut s = 1u32;
    for b in 0..n * k / 32 {
        bytes.extend(half::f16::from_f32(0.01 + (b % 7) as f32 * 0.003).to_le_bytes());
        for _ in 0..32 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            bytes.push((s >> 24) as u8);
        }
    }
    QuantMatrix::from_bytes(QuantType::Q8_0, n, k, &bytes).expect("a Q8_0 weight")
}

#[test]
fn every_set_is_found_by_its_name_and_no_other_word() {
    for isa in Isa::ALL {
        assert_eq!(Isa::from_name(isa.name()), Some(isa));
    }
    assert_eq!(Isa::from_name("sse4"), None);
    assert_eq!(Isa::from_name("AMX"), None);
}

#[test]
fn the_cap_bounds_best_and_changes_no_bit() -> anyhow::Result<()> {
    assert_eq!(Isa::max(), Isa::Amx, "no cap by default");
    let widest = |cap: Isa| Isa::ALL.into_iter().rev().find(|&i| i as u8 <= cap as u8 && i.available());
    assert_eq!(Some(Isa::best()), widest(Isa::Amx), "the widest set this CPU has");
    // Enough rows for whole panels on the AMX tile unit, and a partial one.
    let (n, k, m) = (48, 96, 70);
    let w = q8_weight(n, k);
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
    let uncapped: Vec<u32> = w.product(&x, m, Isa::best(), &[])?.into_iter().map(f32::to_bits).collect();
    for cap in Isa::ALL {
        Isa::set_max(cap);
        assert_eq!(Isa::max(), cap);
        assert_eq!(Some(Isa::best()), widest(cap), "{cap:?}");
        // The quantized products give the same bits on every set.
        let got: Vec<u32> = w.product(&x, m, Isa::best(), &[])?.into_iter().map(f32::to_bits).collect();
        assert_eq!(got, uncapped, "{cap:?}");
    }
    Ok(())
}
