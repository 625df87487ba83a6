//! Adapter-aware prefix-cache block hashing and the KV block pool.
//!
//! Three layers, all pure and synchronous (no tensors, threads or I/O):
//!
//! - [`hash_blocks`]: chained xxh3-128 hashes of full blocks of tokens, with the adapter's content
//!   fingerprint and an optional per-tenant salt mixed into every block ([`ExtraKeys`]). Two
//!   adapters — or one adapter reloaded with new weights, which gets a new fingerprint — never
//!   produce the same hashes, so they never share KV. The byte layout is spelled out on [`BlockHash`].
//! - [`BlockPool`]: block ids, reference counts, the hash → block map, and an O(1) LRU free queue
//!   in which a freed cached block stays findable until it is reused.
//! - [`KvManager`]: per-request block tables on top, as the scheduler drives them: `admit` (take
//!   the cached prefix, allocate the rest), `allocate` (grow), `commit` (cache newly full blocks),
//!   `free`; with [`SlidingKv`], a second table per request for a model's sliding-window
//!   layers, whose blocks behind the window are freed as the request advances.
//!
//! ```
//! use multilora_prefix_cache::{ExtraKeys, KvConfig, KvManager};
//!
//! let mut kv = KvManager::new(KvConfig { num_blocks: 8, ..KvConfig::default() });
//! let adapter = ExtraKeys::adapter([0xab; 32]);
//! let prompt: Vec<u32> = (0..40).collect(); // two full blocks of 16 and a tail of 8
//!
//! // First request: nothing cached; room for the whole prompt.
//! assert_eq!(kv.admit(1, &prompt, &adapter, false, prompt.len())?, 0);
//! assert_eq!(kv.block_table(1).len(), 3);
//! kv.commit(1, &prompt, prompt.len())?; // the step computed the prompt's KV
//! kv.free(1);
//!
//! // Same prompt, same adapter: both full blocks hit.
//! assert_eq!(kv.lookup(&prompt, &adapter, false), 32);
//! // Same prompt under the base model: nothing is shared.
//! assert_eq!(kv.lookup(&prompt, &ExtraKeys::base(), false), 0);
//! # Ok::<(), multilora_prefix_cache::Error>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod free_queue;
mod hash;
mod manager;
mod metrics;
mod pool;
mod sliding;

pub use error::{Error, Result};
pub use hash::{AdapterKey, BlockHash, BlockHashes, ExtraKeys, extend_hashes, hash_blocks, seed_parent};
pub use manager::{DEFAULT_HASH_SEED, KvConfig, KvManager};
pub use metrics::KvMetrics;
pub use pool::BlockPool;
pub use sliding::{NULL_BLOCK, SlidingKv};

/// Index of a KV block in the pool, `0..num_blocks`.
pub type BlockId = u32;
/// The scheduler's id of a request.
pub type RequestId = u64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<KvManager>();
        check::<BlockPool>();
        check::<KvConfig>();
        check::<KvMetrics>();
        check::<ExtraKeys>();
        check::<Error>();
    }
}
