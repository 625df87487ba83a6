//! `Histogram`: fixed upper bounds, exact sum and count; the one histogram every crate's metrics
//! use (latencies in seconds, batch sizes and token counts as plain values).

use std::time::Duration;

/// A histogram with fixed upper bounds and one more bucket for `+Inf`. Fixed bounds, so that
/// histograms from different replicas add up.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Histogram {
    /// Upper bounds, ascending (the last bucket, not listed, is unbounded).
    pub bounds: Vec<f64>,
    /// Observations per bucket (not cumulative), `bounds.len() + 1` of them.
    pub counts: Vec<u64>,
    /// The sum of all observations (seconds for durations).
    pub sum: f64,
    /// The number of observations.
    pub count: u64,
}

impl Default for Histogram {
    /// An empty histogram with one bucket, `+Inf` (it counts and sums; set bounds with [`Histogram::new`]).
    fn default() -> Histogram {
        Histogram::new(&[])
    }
}

impl Histogram {
    /// An empty histogram over `bounds`.
    pub fn new(bounds: &[f64]) -> Histogram {
        Histogram { bounds: bounds.to_vec(), counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    /// Adds one duration, in seconds.
    pub fn observe(&mut self, d: Duration) {
        self.observe_value(d.as_secs_f64());
    }

    /// Adds one plain value (rows, tokens, adapters).
    pub fn observe_value(&mut self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// The mean of the observations (exact: the sum and the count are kept exactly); 0 when
    /// there are none.
    pub fn mean(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.sum / self.count as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_fall_in_their_bucket_and_the_mean_is_exact() {
        let mut h = Histogram::new(&[1.0, 4.0]);
        for v in [0.5, 1.0, 3.0, 9.0] {
            h.observe_value(v);
        }
        assert_eq!(h.counts, vec![2, 1, 1]);
        assert_eq!(h.count, 4);
        assert_eq!(h.mean(), 13.5 / 4.0);
        h.observe(Duration::from_millis(2500));
        assert_eq!(h.counts, vec![2, 2, 1]);
        assert_eq!(Histogram::new(&[]).mean(), 0.0);
        let mut d = Histogram::default();
        d.observe_value(3.0);
        assert_eq!((d.counts.clone(), d.mean()), (vec![1], 3.0));
    }
}
