//! [`SplitMix64`]: the one small seeded generator of the workspace (the per-request sampler, the
//! synthetic adapters and models, the tests' and benches' data). A few lines whose streams are
//! the same on every platform and in every version, which a general-purpose RNG crate does not
//! promise; the seeded outputs and fixtures of the workspace rely on that.

/// SplitMix64 (Steele, Lea and Flood, 2014): a Weyl sequence of the golden-ratio increment, each
/// state mixed by two multiply-xorshift rounds.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose first output mixes `seed + 0x9e37_79b9_7f4a_7c15`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in the open interval `(0, 1)` (the midpoints of [`SplitMix64::next_f64`]'s grid),
    /// so that its logarithm is finite.
    pub fn next_f64_open(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform in `[0, 1)` from the top 24 bits (every value exact in `f32`).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[-1, 1)`: [`SplitMix64::next_f32`] scaled, exactly.
    pub fn unit_f32(&mut self) -> f32 {
        self.next_f32() * 2.0 - 1.0
    }

    /// Below `n` (`next_u64() % n`: a bias under `n / 2^64`, which data generation does not see).
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A standard normal sample by Box–Muller, from two [`SplitMix64::next_f64_open`] draws (the
    /// cosine branch only).
    pub fn gaussian(&mut self) -> f64 {
        let (u, v) = (self.next_f64_open(), self.next_f64_open());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    /// The reference stream of SplitMix64 for seed 1234567 (Vigna's `splitmix64.c`), so a change
    /// that would move every seeded output is caught here first.
    #[test]
    fn matches_the_reference_stream() {
        let mut r = SplitMix64::new(1234567);
        let got: Vec<u64> = (0..5).map(|_| r.next_u64()).collect();
        assert_eq!(
            got,
            [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]
        );
    }

    #[test]
    fn floats_stay_in_their_ranges() {
        let mut r = SplitMix64::new(7);
        for _ in 0..10_000 {
            let (a, b, c, d) = (r.next_f64(), r.next_f64_open(), r.next_f32(), r.unit_f32());
            assert!((0.0..1.0).contains(&a) && b > 0.0 && b < 1.0 && (0.0..1.0).contains(&c));
            assert!((-1.0..1.0).contains(&d));
            assert!(r.gaussian().is_finite() && r.below(3) < 3);
        }
    }
}
