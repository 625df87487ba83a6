//! Failed loads remembered with a back-off: within it, `resolve` answers with the same error and
//! starts nothing (a flood of requests for a broken adapter does not hammer the disk or the hub);
//! after it, `resolve` starts a fresh load. The back-off doubles per consecutive failure of the
//! same adapter, from `StoreConfig::load_retry_backoff` up to [`MAX_LOAD_RETRY_BACKOFF`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;

/// The longest back-off after a failed load (unless the configured base is longer).
pub(crate) const MAX_LOAD_RETRY_BACKOFF: Duration = Duration::from_secs(60);

/// The back-off after the `consecutive`-th failure in a row (1 for the first): `base · 2^(n-1)`,
/// capped at [`MAX_LOAD_RETRY_BACKOFF`] or `base`, whichever is longer.
pub(crate) fn backoff(base: Duration, consecutive: u32) -> Duration {
    let factor = 1u32.checked_shl(consecutive.saturating_sub(1)).unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(MAX_LOAD_RETRY_BACKOFF.max(base))
}

/// A failed load: the error every request gets until `retry_at`.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub(crate) error: Arc<Error>,
    /// When a `resolve` may start the next load.
    pub(crate) retry_at: Instant,
    /// Failures in a row of this adapter (or unknown name), this one included.
    pub(crate) consecutive: u32,
}

impl Failure {
    /// The `consecutive`-th failure in a row, now, with the back-off from `base`.
    pub(crate) fn new(error: Arc<Error>, base: Duration, consecutive: u32) -> Failure {
        let now = Instant::now();
        let retry_at = now.checked_add(backoff(base, consecutive)).unwrap_or(now);
        Failure { error, retry_at, consecutive }
    }

    /// Whether requests at `now` still get the error instead of a new load.
    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        now < self.retry_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_up_to_the_cap() {
        let s = Duration::from_secs;
        let got: Vec<Duration> = (1..=8).map(|n| backoff(s(1), n)).collect();
        assert_eq!(got, [s(1), s(2), s(4), s(8), s(16), s(32), s(60), s(60)]);
        // No overflow however many failures, and a base above the cap is kept.
        assert_eq!(backoff(s(1), u32::MAX), s(60));
        assert_eq!(backoff(s(90), 3), s(90));
        assert_eq!(backoff(Duration::from_millis(5), 2), Duration::from_millis(10));
        assert_eq!(backoff(Duration::ZERO, 4), Duration::ZERO);
    }

    #[test]
    fn a_failure_backs_off_until_its_time() {
        let error = Arc::new(Error::UnknownAdapter { name: "x".into() });
        let failure = Failure::new(error, Duration::from_secs(3600), 1);
        assert!(failure.backing_off(Instant::now()));
        assert!(!failure.backing_off(failure.retry_at));
        assert!(!Failure::new(Arc::clone(&failure.error), Duration::ZERO, 1).backing_off(Instant::now()));
    }
}
