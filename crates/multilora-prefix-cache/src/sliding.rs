//! The sliding layers' KV group (Gemma 3): their own block pool and, per request, a block table
//! whose blocks behind the window are given back.
//!
//! A model whose layers mix a sliding window with full attention keeps the sliding layers' K and V
//! in a second pool. The next query at position `p` reads keys `p + 1 − window ..= p` in those
//! layers, so a block whose last position is before that is never read again: it is freed (a
//! cached block stays findable on the free queue, as any freed cached block). A request's sliding
//! table has the full table's length, [`NULL_BLOCK`] standing where blocks were freed.
//!
//! A prefix-cache hit of `h` blocks is usable in this group when the blocks the next query reads
//! (from `h · block_size + 1 − window` up to `h`) are all cached here too; [`SlidingGroup::usable`]
//! finds the longest such `h`.

use crate::{BlockHash, BlockId, BlockPool};

/// The entry of a sliding table whose block was freed: outside every window still to be read.
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// The sliding layers' group: their window and how many blocks their pool holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingKv {
    /// Query position `p` attends to positions `p + 1 − window ..= p` in the sliding layers.
    pub window: usize,
    /// Blocks in the sliding layers' pool.
    pub num_blocks: usize,
}

impl SlidingKv {
    /// The most sliding blocks one request of up to `max_len` tokens holds at once when each
    /// step brings it at most `chunk` new tokens: the window behind the chunk's first token, the
    /// chunk, and one block each end that the two only partly fill.
    pub fn request_blocks(window: usize, block_size: usize, chunk: usize, max_len: usize) -> usize {
        let bs = block_size.max(1);
        ((window + chunk).div_ceil(bs) + 1).min(max_len.div_ceil(bs))
    }

    /// A sliding pool for `max_seqs` requests decoding at once, each holding its window and the
    /// two blocks it only partly fills, plus one step of `chunk` tokens among them; never less
    /// than one request's [`SlidingKv::request_blocks`].
    pub fn pool_blocks(window: usize, block_size: usize, chunk: usize, max_len: usize, max_seqs: usize) -> usize {
        let bs = block_size.max(1);
        let decoding = (window.div_ceil(bs) + 2).min(max_len.div_ceil(bs));
        let pool = decoding.saturating_mul(max_seqs).saturating_add(chunk.div_ceil(bs));
        pool.max(Self::request_blocks(window, block_size, chunk, max_len))
    }
}

/// The sliding group of a [`KvManager`](crate::KvManager).
#[derive(Clone, Debug)]
pub(crate) struct SlidingGroup {
    pub(crate) window: usize,
    pub(crate) pool: BlockPool,
}

impl SlidingGroup {
    pub(crate) fn new(config: SlidingKv) -> Self {
        Self { window: config.window, pool: BlockPool::new(config.num_blocks) }
    }

    /// The first block a query at position `pos` reads.
    pub(crate) fn first_needed(&self, pos: usize, block_size: usize) -> usize {
        (pos + 1).saturating_sub(self.window) / block_size
    }

    /// Of `hits` leading blocks cached in the full group, how many this group can use: the most
    /// `h ≤ hits` whose window blocks (`first_needed(h · block_size) .. h`) are all cached here.
    /// A miss at block `m` rules out every `h` above it (their windows start at or before it),
    /// so the search goes down from miss to miss.
    pub(crate) fn usable(&self, hashes: &[BlockHash], hits: usize, block_size: usize) -> usize {
        let mut h = hits;
        while h > 0 {
            let lo = self.first_needed(h * block_size, block_size);
            match (lo..h).rev().find(|&i| self.pool.cached_block(hashes[i]).is_none()) {
                None => return h,
                Some(miss) => h = miss,
            }
        }
        0
    }

    /// The table of an admission with `hits` usable blocks and `fresh` new ones: null before the
    /// window, the cached window blocks (a reference taken on each), then the fresh blocks. The
    /// caller has checked that `fresh` blocks are free beside the revived hits.
    pub(crate) fn admit(&mut self, hashes: &[BlockHash], hits: usize, fresh: usize, block_size: usize) -> Vec<BlockId> {
        let lo = self.first_needed(hits * block_size, block_size).min(hits);
        let cached: Vec<BlockId> = hashes[lo..hits]
            .iter()
            .map(|h| self.pool.cached_block(*h).unwrap_or_else(|| unreachable!("usable hits are cached")))
            .collect();
        self.pool.touch(&cached).unwrap_or_else(|e| unreachable!("cached blocks are in the pool: {e}"));
        let mut table = vec![NULL_BLOCK; lo];
        table.extend(cached);
        table.extend(self.pool.allocate(fresh).unwrap_or_else(|e| unreachable!("checked free blocks: {e}")));
        table
    }

    /// Blocks this group's hits take off the free queue: they do not count toward a fresh
    /// allocation.
    pub(crate) fn revived(&self, hashes: &[BlockHash], hits: usize, block_size: usize) -> usize {
        let lo = self.first_needed(hits * block_size, block_size).min(hits);
        hashes[lo..hits]
            .iter()
            .filter_map(|h| self.pool.cached_block(*h))
            .filter(|&b| self.pool.ref_count(b) == 0)
            .count()
    }

    /// Frees the blocks of `table` that a query at `next_pos` or later never reads, and returns
    /// how many it freed.
    pub(crate) fn slide(&mut self, table: &mut [BlockId], next_pos: usize, block_size: usize) -> usize {
        let end = self.first_needed(next_pos, block_size).min(table.len());
        let gone: Vec<BlockId> = table[..end].iter().copied().filter(|&b| b != NULL_BLOCK).collect();
        table[..end].fill(NULL_BLOCK);
        self.pool.free(&gone).unwrap_or_else(|e| unreachable!("request held its sliding blocks: {e}"));
        gone.len()
    }

    /// Frees what `table` still holds.
    pub(crate) fn release(&mut self, table: &[BlockId]) {
        let held: Vec<BlockId> = table.iter().copied().filter(|&b| b != NULL_BLOCK).collect();
        self.pool.free(&held).unwrap_or_else(|e| unreachable!("request held its sliding blocks: {e}"));
    }
}
