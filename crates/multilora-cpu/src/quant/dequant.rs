//! Dequantization: a column's super-block parts to f32 with GGML's own expressions, operation
//! for operation (`dequantize_row_*`), so every value is bit for bit what ggml and candle give.

use half::f16;

use super::QuantType;
use super::layout::Parts;

fn f(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Writes the `layout(qt).sb` values of one super-block into `out`.
pub(crate) fn values(qt: QuantType, p: &Parts, out: &mut [f32]) {
    let (d, m) = (f(p.d), f(p.m));
    match qt {
        QuantType::Q4_0 => out[..32].iter_mut().zip(&p.q).for_each(|(o, &q)| *o = (q as i16 - 8) as f32 * d),
        QuantType::Q4_1 | QuantType::Q5_1 => out[..32].iter_mut().zip(&p.q).for_each(|(o, &q)| *o = q as f32 * d + m),
        QuantType::Q5_0 => out[..32].iter_mut().zip(&p.q).for_each(|(o, &q)| *o = (q as i32 - 16) as f32 * d),
        QuantType::Q8_0 => out[..32].iter_mut().zip(&p.q).for_each(|(o, &q)| *o = q as i8 as f32 * d),
        QuantType::Q2K => {
            for (e, o) in out[..256].iter_mut().enumerate() {
                let sc = p.sc[e / 16];
                let dl = d * (sc & 0xF) as f32;
                let ml = m * (sc >> 4) as f32;
                *o = dl * p.q[e] as f32 - ml;
            }
        }
        QuantType::Q3K => {
            for (e, o) in out[..256].iter_mut().enumerate() {
                // GGML: `d · (scale − 32.0)`, the scale held here already less 32 (exact).
                let dl = d * (p.sc[e / 16] as i8) as f32;
                *o = dl * (p.q[e] as i8 - 4) as f32;
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            for (e, o) in out[..256].iter_mut().enumerate() {
                let s = e / 32;
                let d1 = d * p.sc[s] as f32;
                let m1 = m * p.sc[8 + s] as f32;
                *o = d1 * p.q[e] as f32 - m1;
            }
        }
        QuantType::Q6K => {
            for (e, o) in out[..256].iter_mut().enumerate() {
                *o = d * (p.sc[e / 16] as i8) as f32 * (p.q[e] as i8 - 32) as f32;
            }
        }
    }
}
