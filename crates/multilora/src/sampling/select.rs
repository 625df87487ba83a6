//! The best-ranked entries of a row of logits without sorting the row: [`top`] keeps a buffer of
//! candidates above a threshold that rises as the buffer is cut back, so a row costs one compare
//! per entry (one per block of [`BLOCK`] while the threshold is above the block's maximum) plus
//! the selections of a buffer of twice the wanted size. Ranking: larger logit first, lower id on
//! ties; NaN and −∞ never rank.

use std::cmp::Ordering;

/// One candidate token: its logit, its id, and the sampler's weight for it (0 until set).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Cand {
    pub(crate) x: f32,
    pub(crate) id: u32,
    pub(crate) w: f32,
}

/// Larger logit first, then lower id: a total order on candidates of one row.
pub(crate) fn rank(a: &Cand, b: &Cand) -> Ordering {
    b.x.total_cmp(&a.x).then(a.id.cmp(&b.id))
}

/// Entries of the row looked at together: a block whose maximum does not beat the threshold is
/// passed over in one compare.
const BLOCK: usize = 64;

/// The `m` best-ranked finite entries of `x` (fewer when the row has fewer), in no particular
/// order, into `out` (cleared first; its allocation is kept from call to call).
pub(crate) fn top(x: &[f32], m: usize, out: &mut Vec<Cand>) {
    out.clear();
    if m == 0 {
        return;
    }
    let cap = (2 * m).max(BLOCK);
    // Every kept entry has a lower id than the one looked at, so an entry equal to the worst
    // kept one ranks below it: only a strictly larger logit gets in.
    let mut threshold = f32::NEG_INFINITY;
    for (b, block) in x.chunks(BLOCK).enumerate() {
        // Never NaN: NaN entries are passed over.
        if block_max(block) <= threshold {
            continue;
        }
        for (j, &v) in block.iter().enumerate() {
            if v > threshold && v < f32::INFINITY {
                out.push(Cand { x: v, id: (b * BLOCK + j) as u32, w: 0.0 });
            }
        }
        if out.len() >= cap {
            out.select_nth_unstable_by(m - 1, rank);
            out.truncate(m);
            threshold = out[m - 1].x;
        }
    }
    if out.len() > m {
        out.select_nth_unstable_by(m - 1, rank);
        out.truncate(m);
    }
}

/// The largest value of a block (NaN passed over), as 16 lane-wise maxima the compiler
/// vectorises, then theirs.
fn block_max(block: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = block.chunks_exact(16);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// The first index of the largest value (NaN passed over; 0 for a row of NaN alone).
pub(crate) fn argmax(x: &[f32]) -> u32 {
    multilora_cpu::logits::argmax(x) as u32
}

#[cfg(test)]
mod tests {
    use multilora_types::SplitMix64;

    use super::*;

    fn full_sort(x: &[f32]) -> Vec<Cand> {
        let mut all: Vec<Cand> = x
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| Cand { x: v, id: i as u32, w: 0.0 })
            .collect();
        all.sort_by(rank);
        all
    }

    /// The kept set is the head of the full sort, for sizes around the buffer's cuts, with ties
    /// (values from a small set) and NaN / ±∞ entries.
    #[test]
    fn top_is_the_head_of_the_full_sort() {
        let mut rng = SplitMix64::new(7);
        let mut x: Vec<f32> = (0..5000).map(|_| (rng.next_f64() * 40.0).floor() as f32).collect();
        x[17] = f32::NAN;
        x[400] = f32::INFINITY;
        x[401] = f32::NEG_INFINITY;
        let full = full_sort(&x);
        let mut out = Vec::new();
        for m in [1, 2, 31, 32, 33, 64, 100, 1000, 4996, 4997, 6000] {
            top(&x, m, &mut out);
            out.sort_by(rank);
            assert_eq!(out, full[..m.min(full.len())].to_vec(), "m = {m}");
        }
        // Rising rows move the threshold at every cut.
        let rising: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        top(&rising, 10, &mut out);
        out.sort_by(rank);
        assert_eq!(out.iter().map(|c| c.id).collect::<Vec<_>>(), (2990..3000).rev().collect::<Vec<_>>());
    }

    #[test]
    fn argmax_takes_the_first_largest() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, 5.0, f32::NAN]), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 4]), 0);
    }
}
