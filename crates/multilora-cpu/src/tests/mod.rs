//! The crate's tests: each kernel family against its definition, on every instruction set this
//! CPU has (`Isa::available_of`), and the pool's hot step.

mod attention;
mod float;
mod pool;

/// SplitMix64: a seeded source of test values.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in `[-scale, scale)`.
    pub(crate) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// A kernel element made from an f32 (rounded to nearest).
pub(crate) trait FromF32 {
    fn from_f32(v: f32) -> Self;
}

impl FromF32 for f32 {
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl FromF32 for half::bf16 {
    fn from_f32(v: f32) -> half::bf16 {
        half::bf16::from_f32(v)
    }
}

impl FromF32 for half::f16 {
    fn from_f32(v: f32) -> half::f16 {
        half::f16::from_f32(v)
    }
}
