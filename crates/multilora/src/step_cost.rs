//! The engine's measurement of what a step costs, which the scheduler turns into prefill tokens
//! under the step-time budget (`crate::StepTime`).
//!
//! Every step is timed and fed in as `(decode rows, prefill tokens, seconds)`. Decode-only steps
//! fit a line `fixed + rows · per_row` by least squares over the most recent [`WINDOW`] of them
//! (a decode step is mostly the weights read once, so `fixed` dominates); a step with prefill
//! tokens gives the marginal cost of a token, `(seconds − line(rows)) / tokens`, averaged
//! exponentially. Pure: the caller owns the clock. The estimate is seeded by a short warm-up at
//! start (a prefill, and decode steps of two sizes) so the first burst is already budgeted.

use std::collections::VecDeque;

use multilora_scheduler::StepCost;

/// Decode-only steps the line is fitted over.
pub(crate) const WINDOW: usize = 64;
/// Weight of the newest observation in the per-token average.
const ALPHA: f64 = 0.25;

/// The running estimate.
#[derive(Clone, Debug, Default)]
pub(crate) struct CostEstimator {
    decode: VecDeque<(f64, f64)>,
    per_token: Option<f64>,
}

impl CostEstimator {
    /// Records one step.
    pub(crate) fn observe(&mut self, decode_rows: usize, prefill_tokens: usize, seconds: f64) {
        if !(seconds.is_finite() && seconds >= 0.0) || decode_rows + prefill_tokens == 0 {
            return;
        }
        if prefill_tokens == 0 {
            if self.decode.len() == WINDOW {
                self.decode.pop_front();
            }
            self.decode.push_back((decode_rows as f64, seconds));
            return;
        }
        // Before any decode step, the whole step is charged to its tokens (an overestimate, so
        // the first budgets are cautious).
        let base = self.line().map_or(0.0, |(fixed, per_row)| fixed + per_row * decode_rows as f64);
        let marginal = ((seconds - base) / prefill_tokens as f64).max(1e-9);
        self.per_token = Some(match self.per_token {
            Some(old) => old + ALPHA * (marginal - old),
            None => marginal,
        });
    }

    /// `(fixed, per_row)` of the decode-only steps: least squares, slope and intercept kept ≥ 0.
    fn line(&self) -> Option<(f64, f64)> {
        if self.decode.is_empty() {
            return None;
        }
        let n = self.decode.len() as f64;
        let (sx, sy) = self.decode.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
        let (mx, my) = (sx / n, sy / n);
        let (sxx, sxy) =
            self.decode.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + (x - mx) * (x - mx), b + (x - mx) * (y - my)));
        let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        let fixed = (my - slope * mx).max(0.0);
        // A clamped intercept leaves the slope to carry the mean.
        let slope = if fixed == 0.0 && mx > 0.0 { my / mx } else { slope };
        Some((fixed, slope))
    }

    /// The cost model, once both a decode step and a prefill step have been seen.
    pub(crate) fn cost(&self) -> Option<StepCost> {
        let (fixed_s, per_decode_row_s) = self.line()?;
        Some(StepCost { fixed_s, per_decode_row_s, per_prefill_token_s: self.per_token? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_until_both_kinds_of_step() {
        let mut e = CostEstimator::default();
        assert!(e.cost().is_none());
        e.observe(4, 0, 0.020);
        assert!(e.cost().is_none());
        e.observe(0, 100, 0.110);
        assert!(e.cost().is_some());
    }

    #[test]
    fn recovers_a_linear_cost() {
        // 30 ms + 0.5 ms a decode row + 0.8 ms a prompt token.
        let truth = StepCost { fixed_s: 0.030, per_decode_row_s: 0.0005, per_prefill_token_s: 0.0008 };
        let mut e = CostEstimator::default();
        for i in 0..200 {
            let rows = 1 + (i * 7) % 16;
            let prompt = if i % 5 == 0 { 16 + (i * 13) % 200 } else { 0 };
            e.observe(rows, prompt, truth.step_s(rows, prompt));
        }
        let c = e.cost().unwrap();
        assert!((c.fixed_s - truth.fixed_s).abs() < 1e-9, "{c:?}");
        assert!((c.per_decode_row_s - truth.per_decode_row_s).abs() < 1e-9, "{c:?}");
        assert!((c.per_prefill_token_s - truth.per_prefill_token_s).abs() < 1e-6, "{c:?}");
        assert_eq!(e.decode.len(), WINDOW);
    }

    #[test]
    fn one_row_count_and_noise_stay_sane() {
        let mut e = CostEstimator::default();
        for (i, t) in [0.040, 0.038, 0.041, 0.039].iter().enumerate() {
            e.observe(16, 0, *t);
            e.observe(16, 64, *t + 0.050 + 0.001 * i as f64);
        }
        let c = e.cost().unwrap();
        // One row count: no slope, the mean as the fixed part; a token ≈ 50 ms / 64.
        assert_eq!(c.per_decode_row_s, 0.0);
        assert!((c.fixed_s - 0.0395).abs() < 1e-9);
        assert!((c.per_prefill_token_s - 0.050 / 64.0).abs() < 5e-5, "{c:?}");
        // Garbage is ignored; costs never go negative.
        e.observe(3, 0, f64::NAN);
        e.observe(0, 0, 1.0);
        e.observe(16, 10, 0.0);
        let c = e.cost().unwrap();
        assert!(c.fixed_s >= 0.0 && c.per_decode_row_s >= 0.0 && c.per_prefill_token_s > 0.0);
    }
}
