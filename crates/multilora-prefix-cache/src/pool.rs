//! The KV block pool: block ids, reference counts, the hash → block map and the LRU free queue.

use std::collections::HashMap;

use crate::free_queue::FreeQueue;
use crate::{BlockHash, BlockId, Error, Result};

/// Per-block bookkeeping.
#[derive(Clone, Copy, Debug, Default)]
struct Block {
    /// Requests holding the block; the block is on the free queue exactly when this is 0.
    ref_count: u32,
    /// The hash it is cached under, if any; then `cached[hash] == this block`.
    hash: Option<BlockHash>,
}

/// `num_blocks` KV blocks with reference counts, a hash → block map of cached blocks, and a free
/// queue ordered least recently used first.
///
/// A freed block that holds a cached hash stays findable through [`BlockPool::longest_cache_hit`]
/// until it is reused by [`BlockPool::allocate`]; only then is its hash dropped (an eviction).
/// Freed blocks without a hash go to the head of the queue, because reusing them loses nothing;
/// freed cached blocks go to the tail, so the least recently used cached block is evicted first.
#[derive(Clone, Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: FreeQueue,
    /// Keyed by hashes an attacker can influence, so std's keyed SipHash stays: walking a
    /// 4,000-token prefix costs a few microseconds, well below hashing the tokens.
    cached: HashMap<BlockHash, BlockId>,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks with ids `0..num_blocks`.
    ///
    /// # Panics
    /// If `num_blocks` does not fit in a [`BlockId`] below `u32::MAX`; use
    /// [`KvManager::try_new`](crate::KvManager::try_new) to get an error instead.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < u32::MAX as usize, "kv pool of {num_blocks} blocks does not fit u32 block ids");
        Self {
            blocks: vec![Block::default(); num_blocks],
            free: FreeQueue::full(num_blocks),
            cached: HashMap::new(),
            evictions: 0,
        }
    }

    /// Number of blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now: free ones, including evictable cached ones.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Number of blocks currently registered under a hash (held or free).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks whose hash was dropped because the block was reused, since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The reference count of `block` (0 for an id outside the pool).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks.get(block as usize).map_or(0, |b| b.ref_count)
    }

    /// The hash `block` is cached under, if any.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks.get(block as usize).and_then(|b| b.hash)
    }

    /// Whether `block` waits on the free queue.
    pub fn is_free(&self, block: BlockId) -> bool {
        (block as usize) < self.blocks.len() && self.free.contains(block)
    }

    /// The free queue from the next block to be reused to the last.
    pub fn free_queue(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.iter()
    }

    /// The block cached under `hash`, if any.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Number of leading `hashes` that are cached; no state changes.
    pub fn count_cache_hits(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.cached.contains_key(h)).count()
    }

    /// The blocks of the longest cached prefix of `hashes`, without taking references.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// The blocks of the longest cached prefix of `hashes`, with a reference taken on each.
    pub fn longest_cache_hit(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let hits = self.cached_prefix(hashes);
        for &block in &hits {
            self.take_ref(block);
        }
        hits
    }

    /// Allocates `n` fresh blocks with one reference each, reusing the least recently used free
    /// block first and dropping the hash of a cached block it reuses. All or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n > self.free.len() {
            return Err(Error::NoFreeBlocks { needed: n, free: self.free.len() });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(block) = self.free.pop_front() else { unreachable!("free queue shorter than its length") };
            let meta = &mut self.blocks[block as usize];
            if let Some(hash) = meta.hash.take() {
                self.cached.remove(&hash);
                self.evictions += 1;
            }
            meta.ref_count = 1;
            out.push(block);
        }
        Ok(out)
    }

    /// Takes one more reference on each of `blocks`, pulling any free one off the free queue.
    /// All or nothing: an id outside the pool changes nothing.
    pub fn touch(&mut self, blocks: &[BlockId]) -> Result<()> {
        self.check_ids(blocks)?;
        for &block in blocks {
            self.take_ref(block);
        }
        Ok(())
    }

    /// Drops one reference on each of `blocks` (a request's block table, in order), walking them
    /// in reverse so that the request's tail is queued first and evicted before its prefix.
    /// Blocks whose count reaches 0 join the free queue, cached ones keeping their hash.
    /// All or nothing: an unknown id or a block without references changes nothing.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<()> {
        self.check_ids(blocks)?;
        for (i, &block) in blocks.iter().enumerate() {
            let meta = &mut self.blocks[block as usize];
            if meta.ref_count == 0 {
                // A block listed more often than it is held: undo and refuse.
                for &done in &blocks[..i] {
                    self.blocks[done as usize].ref_count += 1;
                }
                return Err(Error::BlockNotHeld(block));
            }
            meta.ref_count -= 1;
        }
        for &block in blocks.iter().rev() {
            let meta = self.blocks[block as usize];
            if meta.ref_count == 0 && !self.free.contains(block) {
                if meta.hash.is_some() {
                    self.free.push_back(block);
                } else {
                    self.free.push_front(block);
                }
            }
        }
        Ok(())
    }

    /// Registers `block` (which holds the KV for `hash`) in the cache. Returns whether it was
    /// registered: a block already cached keeps its hash, and when another block is already cached
    /// under `hash` that one stays the canonical copy and this block remains private.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) -> Result<bool> {
        self.check_ids(&[block])?;
        let meta = &mut self.blocks[block as usize];
        if meta.hash.is_some() || self.cached.contains_key(&hash) {
            return Ok(false);
        }
        meta.hash = Some(hash);
        self.cached.insert(hash, block);
        Ok(true)
    }

    fn take_ref(&mut self, block: BlockId) {
        let meta = &mut self.blocks[block as usize];
        if meta.ref_count == 0 {
            self.free.remove(block);
        }
        meta.ref_count += 1;
    }

    fn check_ids(&self, blocks: &[BlockId]) -> Result<()> {
        match blocks.iter().find(|&&b| b as usize >= self.blocks.len()) {
            Some(&block) => Err(Error::UnknownBlock { block, num_blocks: self.blocks.len() }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).unwrap();
        assert_eq!(a, [0, 1, 2]);
        let before: Vec<_> = pool.free_queue().collect();
        assert_eq!(pool.allocate(2), Err(Error::NoFreeBlocks { needed: 2, free: 1 }));
        assert_eq!(pool.free_queue().collect::<Vec<_>>(), before);
        assert_eq!(pool.num_free_blocks(), 1);
    }

    #[test]
    fn freed_cached_block_stays_findable_until_reused() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate(2).unwrap();
        assert!(pool.cache_block(a[0], h(10)).unwrap());
        assert!(pool.cache_block(a[1], h(11)).unwrap());
        pool.free(&a).unwrap();
        // Reverse order: the tail block (a[1]) is queued first; the never-used block 2 has no hash
        // and sits at the head.
        assert_eq!(pool.free_queue().collect::<Vec<_>>(), [2, a[1], a[0]]);
        assert_eq!(pool.count_cache_hits(&[h(10), h(11)]), 2);
        // Reuse two blocks: block 2, then a[1] whose hash is evicted.
        let b = pool.allocate(2).unwrap();
        assert_eq!(b, [2, a[1]]);
        assert_eq!(pool.evictions(), 1);
        assert_eq!(pool.cached_block(h(11)), None);
        assert_eq!(pool.longest_cache_hit(&[h(10), h(11)]), [a[0]]);
        assert_eq!(pool.ref_count(a[0]), 1);
        assert!(!pool.is_free(a[0]));
    }

    #[test]
    fn hit_takes_references_and_free_returns_them() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.cache_block(a[0], h(1)).unwrap();
        let hit = pool.longest_cache_hit(&[h(1), h(2)]);
        assert_eq!(hit, a);
        assert_eq!(pool.ref_count(a[0]), 2);
        pool.free(&a).unwrap();
        assert!(!pool.is_free(a[0]));
        pool.free(&hit).unwrap();
        assert!(pool.is_free(a[0]));
        assert_eq!(pool.free(&hit), Err(Error::BlockNotHeld(a[0])));
        assert_eq!(pool.num_free_blocks(), 2);
    }

    #[test]
    fn free_of_a_block_listed_twice_changes_nothing() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        assert_eq!(pool.free(&[a[0], a[0]]), Err(Error::BlockNotHeld(a[0])));
        assert_eq!(pool.ref_count(a[0]), 1);
        assert_eq!(pool.touch(&[9]).unwrap_err().kind(), "unknown_block");
    }

    #[test]
    fn duplicate_hash_keeps_the_first_block() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(2).unwrap();
        assert!(pool.cache_block(a[0], h(5)).unwrap());
        assert!(!pool.cache_block(a[1], h(5)).unwrap());
        assert!(!pool.cache_block(a[0], h(6)).unwrap());
        assert_eq!(pool.cached_block(h(5)), Some(a[0]));
        assert_eq!(pool.num_cached_blocks(), 1);
    }

    #[test]
    fn touch_revives_a_free_cached_block() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.cache_block(a[0], h(3)).unwrap();
        pool.free(&a).unwrap();
        assert_eq!(pool.num_free_blocks(), 2);
        pool.touch(&a).unwrap();
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(pool.ref_count(a[0]), 1);
    }
}
