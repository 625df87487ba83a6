//! The step-time budget: how long a step that carries decode rows may take, and the step cost
//! model the engine measures, from which the scheduler turns that time into prefill tokens.
//!
//! A step's time is modelled as `fixed + decode_rows · per_decode_row + prefill_tokens ·
//! per_prefill_token`. While requests are decoding, every step delays each of their next tokens
//! by the step's whole time, so a burst of arriving prompts prefilled in one step freezes every
//! stream; bounding the step's time bounds that gap. The budget is in time, not tokens, because
//! the right token count differs by orders of magnitude between a 2-core CPU and a GPU; the
//! engine measures the costs (the scheduler stays pure: costs come in as data). The budget itself,
//! `StepTime`, is the shared vocabulary's (`multilora-types`).

use multilora_types::StepTime;

/// What a step costs, as the engine measured it. All in seconds, all ≥ 0.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepCost {
    /// The part of a step that does not grow with its rows (weights read once, launches, sampling).
    pub fixed_s: f64,
    /// Each decode row.
    pub per_decode_row_s: f64,
    /// Each prefill token.
    pub per_prefill_token_s: f64,
}

impl StepCost {
    /// The modelled time of a step of `decode_rows` decode rows and `prefill_tokens` prefill tokens.
    pub fn step_s(&self, decode_rows: usize, prefill_tokens: usize) -> f64 {
        self.fixed_s + decode_rows as f64 * self.per_decode_row_s + prefill_tokens as f64 * self.per_prefill_token_s
    }

    /// Prefill tokens that fit next to `decode_rows` decode rows in a step of at most `max_step_s`
    /// (0 when the decode rows alone take that long; unbounded when a prefill token costs nothing).
    pub fn prefill_tokens_within(&self, max_step_s: f64, decode_rows: usize) -> usize {
        let left = max_step_s - self.step_s(decode_rows, 0);
        if !left.is_finite() || self.per_prefill_token_s <= 0.0 {
            return if left > 0.0 { usize::MAX } else { 0 };
        }
        if left <= 0.0 { 0 } else { (left / self.per_prefill_token_s).floor().min(usize::MAX as f64) as usize }
    }

    /// The longest step `step_time` allows next to `decode_rows` decode rows, given these costs;
    /// `None` when unbounded (no budget, or no decode row to protect).
    pub fn limit_s(&self, step_time: StepTime, decode_rows: usize) -> Option<f64> {
        if decode_rows == 0 {
            return None;
        }
        match step_time {
            StepTime::Auto { factor } => Some(factor * self.step_s(decode_rows, 0)),
            StepTime::Max { seconds } => Some(seconds),
            // `Unbounded` (and a budget this scheduler does not apply, which `validate` refuses).
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COST: StepCost = StepCost { fixed_s: 0.030, per_decode_row_s: 0.0005, per_prefill_token_s: 0.001 };

    #[test]
    fn tokens_within_a_step() {
        // 16 decode rows: 38 ms; a 100 ms step leaves 62 ms, 62 prefill tokens.
        assert_eq!(COST.prefill_tokens_within(0.100, 16), 62);
        assert_eq!(COST.prefill_tokens_within(0.030, 16), 0);
        let free = StepCost { per_prefill_token_s: 0.0, ..COST };
        assert_eq!(free.prefill_tokens_within(0.100, 16), usize::MAX);
        assert_eq!(free.prefill_tokens_within(0.010, 16), 0);
        assert!((COST.step_s(16, 62) - 0.100).abs() < 1e-12);
    }

    #[test]
    fn limits() {
        assert_eq!(COST.limit_s(StepTime::Unbounded, 16), None);
        assert_eq!(COST.limit_s(StepTime::Max { seconds: 0.1 }, 16), Some(0.1));
        let auto = COST.limit_s(StepTime::Auto { factor: 2.5 }, 16).unwrap();
        assert!((auto - 0.095).abs() < 1e-12, "{auto}");
        // Nothing decoding: nothing to protect.
        assert_eq!(COST.limit_s(StepTime::Max { seconds: 0.1 }, 0), None);
    }
}
