//! Metrics as data: a snapshot of the tiers (occupancy in entries and bytes, hits, misses,
//! evictions), the load time histogram and failures by kind. The engine turns it into Prometheus.

use std::collections::BTreeMap;

use multilora_types::Histogram;

/// Upper bounds of the load time buckets, in seconds; a last bucket catches everything above.
/// Fixed, so that histograms from different replicas add up.
pub const LOAD_TIME_BUCKETS_S: [f64; 12] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];

/// One tier's occupancy and traffic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierMetrics {
    /// Entries held (CPU: live plus retired; device: occupied slots).
    pub entries: usize,
    /// Configured capacity (`max_cpu_loras`, `max_loras`).
    pub capacity: usize,
    /// Bytes held: CPU `Σ nbytes`; device `Σ` each resident adapter's modules at `max_lora_rank`.
    pub bytes: u64,
    /// Lookups that found the adapter (CPU: `resolve`; device: `activate` of a resident generation).
    pub hits: u64,
    /// Lookups that did not (CPU: a load was started; device: a slot was written).
    pub misses: u64,
    /// Entries pushed out to make room.
    pub evictions: u64,
}

/// A snapshot of the store.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct StoreMetrics {
    /// Registered adapters.
    pub registered: usize,
    /// The CPU tier.
    pub cpu: TierMetrics,
    /// CPU entries that are generations superseded or unloaded while leases (slot or host) hold them;
    /// included in `cpu.entries`, and the only way `cpu.entries` exceeds `cpu.capacity`.
    pub cpu_retired: usize,
    /// The device slots.
    pub device: TierMetrics,
    /// Slots whose generation a running request or the operator pins.
    pub pinned_slots: usize,
    /// Generations that host leases ([`crate::HostLease`], preempted requests) hold: their CPU
    /// entries are not evicted, their slots are not pinned.
    pub host_pinned: usize,
    /// Loads queued or running on the loader threads.
    pub loading: usize,
    /// Finished loads waiting for a CPU entry to unpin (every entry was pinned); their adapters
    /// report `Loading` and become ready when an entry unpins.
    pub waiting_for_capacity: usize,
    /// Loads running, waiting for room, or ended and still held by a request's
    /// [`crate::LoadTicket`]: their records, which go with the last ticket (0 once idle).
    pub pending_loads: usize,
    /// Loads that had to wait for a CPU entry to unpin, since start.
    pub capacity_waits: u64,
    /// Load events published and not yet taken by [`crate::Store::poll_completed`] or
    /// [`crate::Store::wait_completed`]: bounded only while a consumer takes them.
    pub events_pending: usize,
    /// Loads that succeeded (startup, background and runtime).
    pub loads: u64,
    /// Time per successful load, from the start of reading to a validated adapter.
    pub load_time: Histogram,
    /// Failed loads and refusals, by [`crate::Error::kind`].
    pub failures: BTreeMap<&'static str, u64>,
}

/// The counters the store keeps under its lock; occupancy is read off the tiers at snapshot time.
#[derive(Debug)]
pub(crate) struct Counters {
    pub(crate) cpu_hits: u64,
    pub(crate) cpu_misses: u64,
    pub(crate) cpu_evictions: u64,
    pub(crate) device_hits: u64,
    pub(crate) device_misses: u64,
    pub(crate) device_evictions: u64,
    pub(crate) capacity_waits: u64,
    pub(crate) loads: u64,
    pub(crate) load_time: Histogram,
    pub(crate) failures: BTreeMap<&'static str, u64>,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            cpu_hits: 0,
            cpu_misses: 0,
            cpu_evictions: 0,
            device_hits: 0,
            device_misses: 0,
            device_evictions: 0,
            capacity_waits: 0,
            loads: 0,
            load_time: Histogram::new(&LOAD_TIME_BUCKETS_S),
            failures: BTreeMap::new(),
        }
    }
}

impl Counters {
    pub(crate) fn failure(&mut self, kind: &'static str) {
        *self.failures.entry(kind).or_insert(0) += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn observations_land_in_their_bucket() {
        let mut h = Histogram::new(&LOAD_TIME_BUCKETS_S);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(100));
        assert_eq!(h.count, 3);
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[4], 1);
        assert_eq!(h.counts[LOAD_TIME_BUCKETS_S.len()], 1);
        assert!((h.sum - 100.0305).abs() < 1e-9);
    }
}
