//! KV-cache metrics as plain data.

/// A snapshot of the KV block pool and the prefix cache, as plain data for any exporter.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvMetrics {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Blocks that can be allocated now (free, including evictable cached blocks).
    pub free_blocks: usize,
    /// Fraction of blocks referenced by requests, in `0.0..=1.0`.
    pub usage: f64,
    /// Prefix lookups made at admission (requests admitted with caching on and not skipped).
    pub queries: u64,
    /// Tokens looked up by those queries.
    pub query_tokens: u64,
    /// Tokens found cached by those queries.
    pub hit_tokens: u64,
    /// Cached blocks whose hash was dropped because the block was reused.
    pub evictions: u64,
}

impl KvMetrics {
    /// Fraction of queried tokens that hit the cache (0 when nothing was queried).
    pub fn hit_rate(&self) -> f64 {
        if self.query_tokens == 0 { 0.0 } else { self.hit_tokens as f64 / self.query_tokens as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_handles_zero() {
        assert_eq!(KvMetrics::default().hit_rate(), 0.0);
        let m = KvMetrics { query_tokens: 4, hit_tokens: 1, ..KvMetrics::default() };
        assert_eq!(m.hit_rate(), 0.25);
    }
}
