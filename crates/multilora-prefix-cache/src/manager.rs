//! The per-request KV manager: block tables, prefix-cache hits at admission, and commits.

use std::collections::HashMap;

use crate::sliding::{NULL_BLOCK, SlidingGroup};
use crate::{
    BlockHash, BlockHashes, BlockId, BlockPool, Error, ExtraKeys, KvMetrics, RequestId, Result, SlidingKv,
    extend_hashes, hash_blocks, seed_parent,
};

/// The default [`KvConfig::hash_seed`]: the ASCII bytes `"multilor"` read as a big-endian `u64`.
pub const DEFAULT_HASH_SEED: u64 = 0x6d75_6c74_696c_6f72;

/// Configuration of the KV block pool and the prefix cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvConfig {
    /// KV blocks in the pool (default 1024).
    pub num_blocks: usize,
    /// Tokens per block (default 16).
    pub block_size: usize,
    /// Whether full blocks are hashed and shared between requests (default true).
    pub enable_prefix_caching: bool,
    /// The parent value of the first block; deployments with different seeds never share hashes
    /// (default [`DEFAULT_HASH_SEED`]).
    pub hash_seed: u64,
    /// The sliding layers' own group, for a model whose layers mix a sliding window with full
    /// attention (Gemma 3): each request gets a second block table from a second pool, whose
    /// blocks behind the window are freed (default none: one table for every layer).
    pub sliding: Option<SlidingKv>,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            enable_prefix_caching: true,
            hash_seed: DEFAULT_HASH_SEED,
            sliding: None,
        }
    }
}

/// What the manager keeps per request.
#[derive(Clone, Debug)]
struct RequestState {
    /// The keys given at admission; every later hash of this request uses them.
    extra: ExtraKeys,
    /// The block table, in token order.
    blocks: Vec<BlockId>,
    /// Hashes of the request's leading full blocks, extended incrementally as tokens are computed.
    hashes: Vec<BlockHash>,
    /// Leading blocks already in the cache (hit at admission or registered by `commit`).
    num_committed: usize,
    /// The sliding layers' table (empty without a sliding group): as long as `blocks`,
    /// [`NULL_BLOCK`] where the window has passed.
    sliding: Vec<BlockId>,
}

/// Per-request block tables over a [`BlockPool`], with prefix caching keyed on [`ExtraKeys`].
///
/// Owned by the scheduler. A request is admitted once, grows with [`KvManager::allocate`],
/// registers its computed full blocks with [`KvManager::commit`], and is released with
/// [`KvManager::free`]. Admitted tokens that are not computed yet simply hold blocks.
#[derive(Clone, Debug)]
pub struct KvManager {
    config: KvConfig,
    pool: BlockPool,
    sliding: Option<SlidingGroup>,
    requests: HashMap<RequestId, RequestState>,
    queries: u64,
    query_tokens: u64,
    hit_tokens: u64,
}

impl KvManager {
    /// A manager over a fresh pool of `config.num_blocks` blocks.
    ///
    /// # Panics
    /// If the configuration is invalid (see [`KvManager::try_new`]).
    pub fn new(config: KvConfig) -> Self {
        match Self::try_new(config) {
            Ok(manager) => manager,
            Err(e) => panic!("{e}"),
        }
    }

    /// A manager over a fresh pool, or an error when `block_size` is 0 or `num_blocks` does not
    /// fit in a [`BlockId`].
    pub fn try_new(config: KvConfig) -> Result<Self> {
        if config.block_size == 0 {
            return Err(Error::InvalidConfig("block_size must be at least 1"));
        }
        if config.num_blocks >= u32::MAX as usize {
            return Err(Error::InvalidConfig("num_blocks must fit u32 block ids"));
        }
        if let Some(s) = config.sliding {
            if s.window == 0 {
                return Err(Error::InvalidConfig("the sliding window must be at least 1 token"));
            }
            if s.num_blocks >= NULL_BLOCK as usize {
                return Err(Error::InvalidConfig("sliding num_blocks must fit u32 block ids"));
            }
        }
        Ok(Self {
            pool: BlockPool::new(config.num_blocks),
            sliding: config.sliding.map(SlidingGroup::new),
            config,
            requests: HashMap::new(),
            queries: 0,
            query_tokens: 0,
            hit_tokens: 0,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    /// The underlying block pool, read-only (for checks and metrics).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Blocks that can be allocated now (free, including evictable cached blocks with ref count 0).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// The sliding layers' pool, read-only, when there is a sliding group.
    pub fn sliding_pool(&self) -> Option<&BlockPool> {
        self.sliding.as_ref().map(|g| &g.pool)
    }

    /// Whether a new request of `num_tokens` tokens fits in the free blocks of every group even
    /// without a cache hit.
    pub fn fits(&self, num_tokens: usize) -> bool {
        let blocks = num_tokens.div_ceil(self.config.block_size);
        self.pool.num_free_blocks() >= blocks
            && self.sliding.as_ref().is_none_or(|g| g.pool.num_free_blocks() >= blocks)
    }

    /// Number of requests holding blocks.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Pure lookup, no state change: number of leading tokens of `tokens` cached for `extra`.
    ///
    /// A multiple of `block_size`; when the whole prompt hits, the last block is not counted so the
    /// last token is left to compute and produce logits; 0 when caching is off or `skip_cache`
    /// (a request that wants prompt logprobs must compute every position).
    pub fn lookup(&self, tokens: &[u32], extra: &ExtraKeys, skip_cache: bool) -> usize {
        if !self.config.enable_prefix_caching || skip_cache {
            return 0;
        }
        // Hash lazily, so a prompt that misses early costs only the blocks up to the miss.
        let hashes: Vec<BlockHash> =
            BlockHashes::new(seed_parent(self.config.hash_seed), self.config.block_size, tokens, extra)
                .take_while(|h| self.pool.cached_block(*h).is_some())
                .collect();
        self.hits(&hashes, tokens.len()) * self.config.block_size
    }

    /// Admits a new request: takes references on its cached prefix blocks (exactly what
    /// [`KvManager::lookup`] returns) and allocates fresh blocks so that the request holds room for
    /// `cached + num_new_tokens` tokens. Returns the number of cached tokens.
    ///
    /// All or nothing: on error nothing changes, metrics included. With caching on and
    /// `skip_cache` false a successful admission counts one query of `tokens.len()` tokens.
    pub fn admit(
        &mut self,
        id: RequestId,
        tokens: &[u32],
        extra: &ExtraKeys,
        skip_cache: bool,
        num_new_tokens: usize,
    ) -> Result<usize> {
        if self.requests.contains_key(&id) {
            return Err(Error::AlreadyAdmitted(id));
        }
        let bs = self.config.block_size;
        let query = self.config.enable_prefix_caching && !skip_cache;
        // Hashes of a skipped request are computed by `commit`, as its blocks fill.
        let hashes = if query { self.hash(tokens, extra) } else { Vec::new() };
        let mut hits = self.pool.cached_prefix(&hashes);
        hits.truncate(self.hits(&hashes[..hits.len()], tokens.len()));
        let num_hits = hits.len();
        let cached = num_hits * bs;
        let fresh = (cached + num_new_tokens).div_ceil(bs).saturating_sub(num_hits);
        // Free cached blocks that we are about to hit leave the free queue, so they do not count
        // toward what the fresh allocation can use.
        let revived = hits.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        let free = self.pool.num_free_blocks() - revived;
        if fresh > free {
            return Err(Error::NoFreeBlocks { needed: fresh, free });
        }
        if let Some(g) = &self.sliding {
            let free = g.pool.num_free_blocks() - g.revived(&hashes, num_hits, bs);
            if fresh > free {
                return Err(Error::NoFreeBlocks { needed: fresh, free });
            }
        }
        self.pool.touch(&hits).unwrap_or_else(|e| unreachable!("cached blocks are in the pool: {e}"));
        let mut blocks = hits;
        let new_blocks = self.pool.allocate(fresh).unwrap_or_else(|e| unreachable!("checked free blocks: {e}"));
        blocks.extend(new_blocks);
        let sliding = self.sliding.as_mut().map_or_else(Vec::new, |g| g.admit(&hashes, num_hits, fresh, bs));
        if query {
            self.queries += 1;
            self.query_tokens += tokens.len() as u64;
            self.hit_tokens += cached as u64;
        }
        self.requests
            .insert(id, RequestState { extra: extra.clone(), blocks, hashes, num_committed: num_hits, sliding });
        Ok(cached)
    }

    /// Grows a running request's blocks so that it holds room for `total_tokens` tokens (never
    /// shrinks), in every group. All or nothing.
    pub fn allocate(&mut self, id: RequestId, total_tokens: usize) -> Result<()> {
        let bs = self.config.block_size;
        let state = self.requests.get_mut(&id).ok_or(Error::UnknownRequest(id))?;
        let needed = total_tokens.div_ceil(bs).saturating_sub(state.blocks.len());
        if let Some(g) = &self.sliding
            && needed > g.pool.num_free_blocks()
        {
            return Err(Error::NoFreeBlocks { needed, free: g.pool.num_free_blocks() });
        }
        let new_blocks = self.pool.allocate(needed)?;
        state.blocks.extend(new_blocks);
        if let Some(g) = &mut self.sliding {
            state.sliding.extend(g.pool.allocate(needed).unwrap_or_else(|e| unreachable!("checked free blocks: {e}")));
        }
        Ok(())
    }

    /// After a step computed KV for `tokens[..num_computed]` (`tokens` being the request's prompt
    /// and outputs so far), registers its newly full blocks in the cache (when caching is on),
    /// then frees the sliding blocks that the next query, at `num_computed`, no longer reads.
    /// Only the blocks that became full since the last commit are hashed.
    ///
    /// `tokens` must extend the tokens the request was admitted and committed with, and no step
    /// that reads the request's blocks may still be running.
    pub fn commit(&mut self, id: RequestId, tokens: &[u32], num_computed: usize) -> Result<()> {
        let bs = self.config.block_size;
        let caching = self.config.enable_prefix_caching;
        let seed = self.config.hash_seed;
        let state = self.requests.get_mut(&id).ok_or(Error::UnknownRequest(id))?;
        let capacity = state.blocks.len() * bs;
        if num_computed > tokens.len() || num_computed > capacity {
            return Err(Error::ComputedOutOfRange { id, num_computed, num_tokens: tokens.len(), capacity });
        }
        let full = num_computed / bs;
        if caching && full > state.num_committed {
            if state.hashes.len() < full {
                let parent = state.hashes.last().copied().unwrap_or(seed_parent(seed));
                let from = state.hashes.len() * bs;
                extend_hashes(parent, bs, &tokens[from..full * bs], &state.extra, &mut state.hashes);
            }
            for i in state.num_committed..full {
                // A block whose hash is already cached elsewhere stays private; that is harmless.
                self.pool
                    .cache_block(state.blocks[i], state.hashes[i])
                    .unwrap_or_else(|e| unreachable!("block of a request is in the pool: {e}"));
                if let Some(g) = &mut self.sliding
                    && state.sliding[i] != NULL_BLOCK
                {
                    g.pool
                        .cache_block(state.sliding[i], state.hashes[i])
                        .unwrap_or_else(|e| unreachable!("sliding block of a request is in the pool: {e}"));
                }
            }
            state.num_committed = full;
        }
        if let Some(g) = &mut self.sliding {
            g.slide(&mut state.sliding, num_computed, bs);
        }
        Ok(())
    }

    /// The request's block table (block ids in order); an empty slice for an unknown id.
    pub fn block_table(&self, id: RequestId) -> &[BlockId] {
        self.requests.get(&id).map_or(&[], |s| &s.blocks)
    }

    /// The request's sliding table: as long as its block table, with [`NULL_BLOCK`] where the
    /// window has passed; empty without a sliding group or for an unknown id.
    pub fn sliding_table(&self, id: RequestId) -> &[BlockId] {
        self.requests.get(&id).map_or(&[], |s| &s.sliding)
    }

    /// Number of leading tokens of the request whose blocks are in the cache (0 for an unknown id).
    pub fn num_committed_tokens(&self, id: RequestId) -> usize {
        self.requests.get(&id).map_or(0, |s| s.num_committed * self.config.block_size)
    }

    /// Frees everything the request holds, its blocks in reverse order so the tail is evicted
    /// first. Idempotent: an unknown id is ignored.
    pub fn free(&mut self, id: RequestId) {
        if let Some(state) = self.requests.remove(&id) {
            // Every block of a table holds one reference taken for this request.
            self.pool.free(&state.blocks).unwrap_or_else(|e| unreachable!("request held its blocks: {e}"));
            if let Some(g) = &mut self.sliding {
                g.release(&state.sliding);
            }
        }
    }

    /// Whether the manager holds the request.
    pub fn contains(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// A snapshot of the pool and cache metrics.
    pub fn metrics(&self) -> KvMetrics {
        let num_blocks = self.pool.num_blocks();
        let free_blocks = self.pool.num_free_blocks();
        let usage = if num_blocks == 0 { 0.0 } else { (num_blocks - free_blocks) as f64 / num_blocks as f64 };
        KvMetrics {
            num_blocks,
            free_blocks,
            usage,
            queries: self.queries,
            query_tokens: self.query_tokens,
            hit_tokens: self.hit_tokens,
            evictions: self.pool.evictions(),
        }
    }

    fn hash(&self, tokens: &[u32], extra: &ExtraKeys) -> Vec<BlockHash> {
        hash_blocks(self.config.hash_seed, self.config.block_size, tokens, extra)
    }

    /// Of the blocks of `hashes` (all cached in the full group), how many a request may use: all
    /// of them, except that a prompt hitting in full leaves its last block to compute, so the
    /// last token produces logits; and with a sliding group, no more than it holds the window of.
    fn hits(&self, hashes: &[BlockHash], num_tokens: usize) -> usize {
        let bs = self.config.block_size;
        let hits = hashes.len();
        let hits = if hits > 0 && hits * bs == num_tokens { hits - 1 } else { hits };
        self.sliding.as_ref().map_or(hits, |g| g.usable(hashes, hits, bs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(num_blocks: usize, caching: bool) -> KvManager {
        KvManager::new(KvConfig {
            num_blocks,
            block_size: 4,
            enable_prefix_caching: caching,
            hash_seed: 1,
            ..KvConfig::default()
        })
    }

    fn toks(n: u32) -> Vec<u32> {
        (100..100 + n).collect()
    }

    #[test]
    fn default_config_is_documented() {
        let c = KvConfig::default();
        assert_eq!((c.num_blocks, c.block_size), (1024, 16));
        assert!(c.enable_prefix_caching);
        assert_eq!(c.hash_seed.to_be_bytes(), *b"multilor");
    }

    #[test]
    fn invalid_config_is_an_error() {
        let e = KvManager::try_new(KvConfig { block_size: 0, ..KvConfig::default() }).unwrap_err();
        assert_eq!(e.kind(), "invalid_config");
    }

    #[test]
    fn admit_twice_and_unknown_ids() {
        let mut kv = manager(8, true);
        kv.admit(1, &toks(5), &ExtraKeys::base(), false, 5).unwrap();
        assert_eq!(kv.admit(1, &toks(5), &ExtraKeys::base(), false, 5), Err(Error::AlreadyAdmitted(1)));
        assert_eq!(kv.allocate(2, 4), Err(Error::UnknownRequest(2)));
        assert_eq!(kv.commit(2, &toks(4), 4), Err(Error::UnknownRequest(2)));
        assert!(kv.block_table(2).is_empty());
        assert!(kv.contains(1) && !kv.contains(2));
    }

    #[test]
    fn failed_admit_changes_nothing() {
        let mut kv = manager(4, true);
        let p = toks(12);
        kv.admit(1, &p, &ExtraKeys::base(), false, 12).unwrap();
        kv.commit(1, &p, 12).unwrap();
        kv.free(1);
        let before = (kv.metrics(), kv.pool().free_queue().collect::<Vec<_>>());
        // Two blocks hit (the third recomputes, since the whole prompt is cached) and leave the
        // free queue, so of the 4 fresh blocks asked for only 2 could be allocated.
        let err = kv.admit(2, &p, &ExtraKeys::base(), false, 4 + 12).unwrap_err();
        assert_eq!(err, Error::NoFreeBlocks { needed: 4, free: 2 });
        assert_eq!(before, (kv.metrics(), kv.pool().free_queue().collect::<Vec<_>>()));
        assert!(!kv.contains(2));
        // The same admission with room for what fits succeeds and reuses the two blocks.
        assert_eq!(kv.admit(2, &p, &ExtraKeys::base(), false, 4).unwrap(), 8);
        assert_eq!(kv.num_free_blocks(), 1);
    }

    #[test]
    fn allocate_grows_and_fails_cleanly() {
        let mut kv = manager(4, true);
        kv.admit(1, &toks(3), &ExtraKeys::base(), false, 3).unwrap();
        assert_eq!(kv.block_table(1).len(), 1);
        kv.allocate(1, 8).unwrap();
        assert_eq!(kv.block_table(1).len(), 2);
        kv.allocate(1, 5).unwrap(); // never shrinks
        assert_eq!(kv.block_table(1).len(), 2);
        let table = kv.block_table(1).to_vec();
        assert_eq!(kv.allocate(1, 17), Err(Error::NoFreeBlocks { needed: 3, free: 2 }));
        assert_eq!(kv.block_table(1), table);
        assert_eq!(kv.num_free_blocks(), 2);
    }

    #[test]
    fn commit_hashes_incrementally_like_a_whole_pass() {
        let mut kv = manager(8, true);
        let extra = ExtraKeys::adapter([3; 32]);
        let all = toks(14);
        kv.admit(1, &all[..5], &extra, false, 5).unwrap();
        kv.commit(1, &all[..5], 5).unwrap();
        kv.allocate(1, 14).unwrap();
        kv.commit(1, &all, 9).unwrap();
        kv.commit(1, &all, 14).unwrap();
        let whole = hash_blocks(1, 4, &all, &extra);
        let table = kv.block_table(1);
        assert_eq!(whole.len(), 3);
        for (block, hash) in table.iter().zip(&whole) {
            assert_eq!(kv.pool().block_hash(*block), Some(*hash));
        }
        assert_eq!(kv.pool().block_hash(table[3]), None); // the partial tail
    }

    #[test]
    fn commit_beyond_tokens_or_blocks_is_an_error() {
        let mut kv = manager(8, true);
        kv.admit(1, &toks(5), &ExtraKeys::base(), false, 5).unwrap();
        assert_eq!(kv.commit(1, &toks(5), 6).unwrap_err().kind(), "computed_out_of_range");
        assert!(kv.commit(1, &toks(12), 9).is_err());
        assert_eq!(kv.pool().num_cached_blocks(), 0);
    }

    #[test]
    fn skip_cache_reads_nothing_but_still_caches() {
        let mut kv = manager(8, true);
        let p = toks(9);
        kv.admit(1, &p, &ExtraKeys::base(), false, 9).unwrap();
        kv.commit(1, &p, 9).unwrap();
        assert_eq!(kv.lookup(&p, &ExtraKeys::base(), true), 0);
        assert_eq!(kv.admit(2, &p, &ExtraKeys::base(), true, 9).unwrap(), 0);
        assert_eq!(kv.block_table(2).len(), 3);
        assert_eq!(kv.metrics().queries, 1);
        kv.free(1);
        // Request 2's own blocks are duplicates of cached ones and stay private.
        kv.commit(2, &p, 9).unwrap();
        assert_eq!(kv.pool().num_cached_blocks(), 2);
        kv.free(2);
        assert_eq!(kv.lookup(&p, &ExtraKeys::base(), false), 8);
    }

    #[test]
    fn caching_off_hashes_nothing_and_allocates_the_same() {
        let mut on = manager(8, true);
        let mut off = manager(8, false);
        let p = toks(10);
        for kv in [&mut on, &mut off] {
            kv.admit(1, &p, &ExtraKeys::base(), false, 10).unwrap();
            kv.commit(1, &p, 10).unwrap();
            kv.admit(2, &toks(3), &ExtraKeys::base(), false, 3).unwrap();
        }
        assert_eq!(on.block_table(1), off.block_table(1));
        assert_eq!(on.block_table(2), off.block_table(2));
        assert_eq!(off.pool().num_cached_blocks(), 0);
        off.free(1);
        assert_eq!(off.lookup(&p, &ExtraKeys::base(), false), 0);
        assert_eq!(off.admit(3, &p, &ExtraKeys::base(), false, 10).unwrap(), 0);
        assert_eq!(off.metrics().queries, 0);
        assert_eq!(off.metrics().hit_tokens, 0);
    }

    #[test]
    fn metrics_count_queries_hits_usage_and_evictions() {
        let mut kv = manager(4, true);
        let p = toks(9);
        kv.admit(1, &p, &ExtraKeys::base(), false, 9).unwrap();
        kv.commit(1, &p, 9).unwrap();
        kv.free(1);
        kv.admit(2, &p, &ExtraKeys::base(), false, 1).unwrap();
        let m = kv.metrics();
        assert_eq!((m.queries, m.query_tokens, m.hit_tokens), (2, 18, 8));
        assert_eq!(m.num_blocks, 4);
        assert_eq!(m.free_blocks, 1);
        assert_eq!(m.usage, 0.75);
        assert_eq!(m.evictions, 0);
        // Request 2 holds the two cached blocks and the free tail; a new allocation of 1 block
        // takes the last free block, which was never cached: no eviction.
        kv.admit(3, &toks(2), &ExtraKeys::adapter([1; 32]), false, 2).unwrap();
        assert_eq!(kv.metrics().evictions, 0);
        kv.free(2);
        kv.free(3);
        // Reusing every block now evicts both cached ones.
        kv.admit(4, &[7; 16], &ExtraKeys::base(), false, 16).unwrap();
        assert_eq!(kv.metrics().evictions, 2);
        assert_eq!(kv.lookup(&p, &ExtraKeys::base(), false), 0);
    }

    #[test]
    fn free_is_idempotent_and_evicts_the_tail_first() {
        let mut kv = manager(6, true);
        let p = toks(12);
        kv.admit(1, &p, &ExtraKeys::base(), false, 12).unwrap();
        kv.commit(1, &p, 12).unwrap();
        let table = kv.block_table(1).to_vec();
        kv.free(1);
        kv.free(1);
        assert_eq!(kv.num_free_blocks(), 6);
        let queue: Vec<_> = kv.pool().free_queue().collect();
        // Never-used blocks first, then the request's blocks from its tail back to its head.
        assert_eq!(queue[3..], [table[2], table[1], table[0]]);
        // Reusing four blocks evicts only the tail block: the prefix still hits.
        kv.admit(2, &[1; 16], &ExtraKeys::base(), false, 16).unwrap();
        assert_eq!(kv.lookup(&toks(13), &ExtraKeys::base(), false), 8);
    }

    #[test]
    fn uncomputed_tokens_just_hold_blocks() {
        let mut kv = manager(8, true);
        let p = toks(16);
        kv.admit(1, &p, &ExtraKeys::base(), false, 16).unwrap();
        assert_eq!(kv.block_table(1).len(), 4);
        assert_eq!(kv.lookup(&p, &ExtraKeys::base(), false), 0);
        kv.commit(1, &p, 6).unwrap(); // a chunk of prefill
        assert_eq!(kv.num_committed_tokens(1), 4);
        assert_eq!(kv.lookup(&p, &ExtraKeys::base(), false), 4);
    }

    fn sliding(num_blocks: usize, sliding_blocks: usize) -> KvManager {
        KvManager::new(KvConfig {
            num_blocks,
            block_size: 4,
            hash_seed: 1,
            sliding: Some(SlidingKv { window: 8, num_blocks: sliding_blocks }),
            ..KvConfig::default()
        })
    }

    /// Blocks held in a sliding table.
    fn held(table: &[BlockId]) -> usize {
        table.iter().filter(|&&b| b != NULL_BLOCK).count()
    }

    /// A request of three windows, prefilled by a chunk of one block then decoded token by
    /// token: its sliding table keeps the full table's length, and after every step holds only
    /// the blocks the next query reads (a window of 8 and one block: 3 blocks of 4), so a pool
    /// of 4 sliding blocks serves it; every freed block is back on the sliding pool.
    #[test]
    fn sliding_blocks_behind_the_window_are_freed() {
        let mut kv = sliding(8, 4);
        let all = toks(24);
        kv.admit(1, &all[..4], &ExtraKeys::base(), false, 4).unwrap();
        let mut most = 0;
        for n in 4..=all.len() {
            kv.commit(1, &all[..n], n).unwrap();
            let table = kv.sliding_table(1);
            assert_eq!(table.len(), kv.block_table(1).len());
            // The next query at n reads positions n − 7 ..= n.
            let first = (n + 1).saturating_sub(8) / 4;
            assert!(table[..first].iter().all(|&b| b == NULL_BLOCK), "after {n}: {table:?}");
            assert!(table[first..].iter().all(|&b| b != NULL_BLOCK), "after {n}: {table:?}");
            most = most.max(held(table));
            assert_eq!(kv.sliding_pool().unwrap().num_free_blocks(), 4 - held(table));
            if n < all.len() {
                kv.allocate(1, n + 1).unwrap();
            }
        }
        assert_eq!(most, 3, "window + one block");
        assert_eq!(kv.block_table(1).len(), 6, "the full layers keep every block");
        kv.free(1);
        assert_eq!(kv.sliding_pool().unwrap().num_free_blocks(), 4);
        assert_eq!(kv.num_free_blocks(), 8);
    }

    /// A prefix hit is usable only as far as the sliding pool still holds its window: after a
    /// request of 24 tokens only the last blocks of its window stay cached in the sliding pool
    /// (the first ones were reused), which is all a hit of 6 blocks reads; the hit's table is
    /// null before that window. Once the window's blocks are evicted too, the hit falls back to
    /// the longest prefix whose window is still cached.
    #[test]
    fn sliding_hits_need_their_window_cached() {
        let mut kv = sliding(16, 4);
        let all = toks(24);
        kv.admit(1, &all, &ExtraKeys::base(), false, 4).unwrap();
        for n in (4..=24).step_by(4) {
            kv.commit(1, &all[..n], n).unwrap();
            kv.allocate(1, (n + 4).min(24)).unwrap();
        }
        kv.free(1);
        let mut prompt = all.clone();
        prompt.push(7);
        assert_eq!(kv.lookup(&prompt, &ExtraKeys::base(), false), 24);
        assert_eq!(kv.admit(2, &prompt, &ExtraKeys::base(), false, 1).unwrap(), 24);
        let table = kv.sliding_table(2).to_vec();
        assert_eq!(table.len(), 7);
        assert!(table[..4].iter().all(|&b| b == NULL_BLOCK) && held(&table) == 3, "{table:?}");
        kv.free(2);
        // Another request takes every sliding block: the 24-token prefix's window is gone.
        kv.admit(3, &[9; 16], &ExtraKeys::base(), false, 16).unwrap();
        kv.free(3);
        assert_eq!(kv.lookup(&prompt, &ExtraKeys::base(), false), 0);
        assert_eq!(kv.admit(4, &prompt, &ExtraKeys::base(), false, 8), Ok(0));
        assert_eq!(held(kv.sliding_table(4)), 2);
    }

    /// The sizes the engine and the scheduler take: Gemma 3 270M's window of 512 in blocks of 16
    /// with steps of 8,192 tokens — one request holds up to 545 blocks, 16 decoding requests and
    /// a step 1,056 (one request and a step 546); a short context caps both.
    #[test]
    fn sliding_pool_sizes() {
        assert_eq!(SlidingKv::request_blocks(512, 16, 8192, 32768), 545);
        assert_eq!(SlidingKv::pool_blocks(512, 16, 8192, 32768, 16), 1056);
        assert_eq!(SlidingKv::pool_blocks(512, 16, 8192, 32768, 1), 546);
        assert_eq!(SlidingKv::request_blocks(512, 16, 8192, 64), 4);
    }

    /// Both groups must have room: an allocation the sliding pool cannot hold fails and changes
    /// neither pool.
    #[test]
    fn sliding_allocations_are_all_or_nothing() {
        let mut kv = sliding(16, 2);
        kv.admit(1, &toks(8), &ExtraKeys::base(), false, 8).unwrap();
        assert_eq!(kv.allocate(1, 12), Err(Error::NoFreeBlocks { needed: 1, free: 0 }));
        assert_eq!((kv.block_table(1).len(), kv.num_free_blocks()), (2, 14));
        assert!(!kv.fits(4));
        assert_eq!(
            kv.admit(2, &toks(4), &ExtraKeys::base(), false, 4),
            Err(Error::NoFreeBlocks { needed: 1, free: 0 })
        );
        kv.commit(1, &toks(8), 8).unwrap(); // the next query at 8 still reads block 0
        assert_eq!(held(kv.sliding_table(1)), 2);
        let bad = KvConfig { sliding: Some(SlidingKv { window: 0, num_blocks: 4 }), ..KvConfig::default() };
        assert_eq!(KvManager::try_new(bad).unwrap_err().kind(), "invalid_config");
    }
}
