//! `MetricsSnapshot`: gauges, cumulative counters and fixed-bucket histograms, as plain data for
//! any exporter (names follow vLLM's `vllm:*` metrics where one exists).

use std::collections::BTreeMap;

pub use multilora_types::Histogram;

/// Bucket bounds (seconds) of time to first token and end-to-end latency.
pub const LATENCY_BUCKETS_S: [f64; 14] =
    [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];
/// Bucket bounds (seconds) of the inter-token latency.
pub const ITL_BUCKETS_S: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];
/// Bucket bounds (seconds) of a step's duration.
pub const STEP_BUCKETS_S: [f64; 14] =
    [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5];
/// Bucket bounds (tokens) of the tokens in a step, vLLM's `vllm:iteration_tokens_total` buckets.
pub const STEP_TOKEN_BUCKETS: [f64; 14] =
    [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0];

/// Bucket bounds (seconds) of a constrained row's allowed-token mask.
pub const MASK_BUCKETS_S: [f64; 12] =
    [0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1];
/// Bucket bounds (sequences) of the rows of a step.
pub const STEP_ROW_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
/// Bucket bounds (adapters) of the distinct adapters of a step (0: base-model rows only).
pub const STEP_ADAPTER_BUCKETS: [f64; 10] = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0];

/// Occupancy of one adapter tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierOccupancy {
    /// Entries held.
    pub entries: usize,
    /// Capacity.
    pub capacity: usize,
}

/// What one adapter (tenant) used; the base model is listed under its served name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdapterUsage {
    /// Requests admitted.
    pub requests: u64,
    /// Prompt tokens of those requests.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
}

/// A snapshot of the engine's metrics.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Requests running in the scheduler.
    pub running: usize,
    /// Requests waiting: in the scheduler, or in the engine for their adapter's load.
    pub waiting: usize,
    /// Requests deferred now: waiting for their adapter to load, or blocked by the adapter limit.
    pub deferred: usize,
    /// The most requests ever deferred at once (gauges are easy to miss between polls).
    pub deferred_max: usize,
    /// Names of the adapters of running requests.
    pub running_adapters: Vec<String>,
    /// Names of the adapters of waiting requests (those waiting for a load included), sorted.
    pub waiting_adapters: Vec<String>,
    /// `max_loras`.
    pub max_lora: usize,
    /// Adapters in device slots.
    pub device_tier: TierOccupancy,
    /// Adapters in the CPU tier.
    pub cpu_tier: TierOccupancy,
    /// Device slots pinned by running requests.
    pub pinned_slots: usize,
    /// Fraction of KV blocks held by requests.
    pub kv_usage: f64,
    /// KV blocks in the pool.
    pub kv_blocks: usize,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Finished requests by finish reason (`stop`, `length`, `abort`, `error`).
    pub requests_finished: BTreeMap<&'static str, u64>,
    /// Failed requests by error kind.
    pub request_errors: BTreeMap<&'static str, u64>,
    /// Prefix-cache lookups.
    pub prefix_cache_queries: u64,
    /// Tokens looked up.
    pub prefix_cache_query_tokens: u64,
    /// Tokens found cached.
    pub prefix_cache_hit_tokens: u64,
    /// Running requests preempted for KV blocks (they wait again and recompute).
    pub preemptions: u64,
    /// Adapter loads into the CPU tier.
    pub adapter_loads: u64,
    /// The store's load events on their way down the engine loop's command channel, not yet
    /// taken (the loop takes them every iteration, so this stays near 0 however many loads an
    /// engine's life sees).
    pub adapter_events_pending: usize,
    /// Adapter evictions from the CPU tier and from device slots.
    pub adapter_evictions: u64,
    /// Adapter loads waiting now for a CPU-tier entry to be unpinned (not failures: their
    /// requests wait).
    pub adapter_loads_waiting: usize,
    /// Adapter loads that ever had to wait for a CPU-tier entry.
    pub adapter_capacity_waits: u64,
    /// Per adapter usage, by name.
    pub per_adapter: BTreeMap<String, AdapterUsage>,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens of a request.
    pub inter_token_latency: Histogram,
    /// Submission to finish.
    pub e2e_latency: Histogram,
    /// Adapter load time.
    pub adapter_load_time: Histogram,
    /// Model steps run.
    pub steps: u64,
    /// Duration of each step (schedule, forward, sampling), seconds.
    pub step_duration: Histogram,
    /// Tokens computed per step, decode rows and prefill together (vLLM's
    /// `vllm:iteration_tokens_total`).
    pub iteration_tokens: Histogram,
    /// Prompt tokens prefilled per step, in steps that prefill any: the trade-off the step-time
    /// budget makes between arriving prompts and running streams.
    pub prefill_tokens_per_step: Histogram,
    /// Sequences per step (decode rows and prefill chunks): the batch size; `sum / count` is the
    /// exact mean.
    pub step_rows: Histogram,
    /// Distinct adapters per step (base-model rows count none): how many adapters share each
    /// forward pass.
    pub step_adapters: Histogram,
    /// Time to compute one constrained row's allowed-token mask (structured outputs), seconds.
    pub grammar_mask_duration: Histogram,
    /// Tokens appended because a request's grammar forced them (not sampled).
    pub grammar_forced_tokens: u64,
}

/// The counters the engine loop accumulates.
#[derive(Debug)]
pub(crate) struct Counters {
    pub(crate) prompt_tokens: u64,
    pub(crate) generation_tokens: u64,
    pub(crate) finished: BTreeMap<&'static str, u64>,
    pub(crate) errors: BTreeMap<&'static str, u64>,
    pub(crate) per_adapter: BTreeMap<String, AdapterUsage>,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) deferred_max: usize,
    pub(crate) preemptions: u64,
    pub(crate) steps: u64,
    pub(crate) step_duration: Histogram,
    pub(crate) iteration_tokens: Histogram,
    pub(crate) prefill_tokens: Histogram,
    pub(crate) step_rows: Histogram,
    pub(crate) step_adapters: Histogram,
    pub(crate) mask_duration: Histogram,
    pub(crate) forced_tokens: u64,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            prompt_tokens: 0,
            generation_tokens: 0,
            finished: BTreeMap::new(),
            errors: BTreeMap::new(),
            per_adapter: BTreeMap::new(),
            ttft: Histogram::new(&LATENCY_BUCKETS_S),
            itl: Histogram::new(&ITL_BUCKETS_S),
            e2e: Histogram::new(&LATENCY_BUCKETS_S),
            deferred_max: 0,
            preemptions: 0,
            steps: 0,
            step_duration: Histogram::new(&STEP_BUCKETS_S),
            iteration_tokens: Histogram::new(&STEP_TOKEN_BUCKETS),
            prefill_tokens: Histogram::new(&STEP_TOKEN_BUCKETS),
            step_rows: Histogram::new(&STEP_ROW_BUCKETS),
            step_adapters: Histogram::new(&STEP_ADAPTER_BUCKETS),
            mask_duration: Histogram::new(&MASK_BUCKETS_S),
            forced_tokens: 0,
        }
    }
}

impl Counters {
    pub(crate) fn adapter(&mut self, name: &str) -> &mut AdapterUsage {
        self.per_adapter.entry(name.to_string()).or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn histogram_buckets() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(5));
        assert_eq!(h.counts, vec![1, 1, 1]);
        assert_eq!(h.count, 3);
        let mut t = Histogram::new(&STEP_TOKEN_BUCKETS);
        t.observe_value(16.0);
        t.observe_value(17.0);
        assert_eq!((t.counts[2], t.counts[3], t.sum), (1, 1, 33.0));
    }
}
