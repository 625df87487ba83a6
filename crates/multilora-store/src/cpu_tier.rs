//! The CPU tier: an LRU of loaded, validated adapters keyed by generation, capacity
//! `max_cpu_loras`, plus the generations held outside the capacity for the requests that lease
//! them (retired ones, and ones admitted while every entry was pinned). A plain data structure:
//! no locks, no I/O.

use std::collections::HashMap;
use std::sync::Arc;

use lru::LruCache;
use multilora_adapter::LoraAdapter;

use multilora_types::AdapterGen;

/// Loaded adapters on the CPU.
///
/// `live` holds current generations and never exceeds `capacity`. A generation superseded by an
/// in-place reload, or unloaded, while leases (slot or host) hold it moves to `retired`, outside
/// the capacity, until its last pin is released; so does a generation a request brings back from
/// the weights it holds ([`crate::Store::admit`]) when it is superseded or every live entry is
/// pinned. That is the one documented way the tier holds more than `max_cpu_loras` entries, which
/// [`CpuTier::retired_len`] shows; each such entry is pinned by a request and leaves with it.
#[derive(Debug)]
pub(crate) struct CpuTier {
    capacity: usize,
    // Unbounded on purpose: the capacity check is ours, so that the victim can skip pinned entries
    // (the crate's own `push` would evict the LRU entry whether pinned or not).
    live: LruCache<AdapterGen, Arc<LoraAdapter>>,
    retired: HashMap<AdapterGen, Arc<LoraAdapter>>,
    live_bytes: u64,
    retired_bytes: u64,
}

/// No entry could be evicted: every live entry is protected.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TierFull;

impl CpuTier {
    pub(crate) fn new(capacity: usize) -> CpuTier {
        CpuTier { capacity, live: LruCache::unbounded(), retired: HashMap::new(), live_bytes: 0, retired_bytes: 0 }
    }

    /// The adapter of `generation`, live or retired; a live hit becomes the most recently used.
    pub(crate) fn get(&mut self, generation: &AdapterGen) -> Option<Arc<LoraAdapter>> {
        self.live.get(generation).or_else(|| self.retired.get(generation)).cloned()
    }

    /// Like [`CpuTier::get`] without touching the LRU order.
    pub(crate) fn peek(&self, generation: &AdapterGen) -> Option<&Arc<LoraAdapter>> {
        self.live.peek(generation).or_else(|| self.retired.get(generation))
    }

    pub(crate) fn contains(&self, generation: &AdapterGen) -> bool {
        self.live.contains(generation) || self.retired.contains_key(generation)
    }

    /// Inserts a validated adapter as the most recently used entry. When full, evicts the least
    /// recently used entry for which `protected` is false, and returns it; when every entry is
    /// protected, inserts nothing. The caller validates fully before calling, so a bad adapter
    /// never costs an eviction.
    pub(crate) fn insert(
        &mut self,
        generation: AdapterGen,
        adapter: Arc<LoraAdapter>,
        protected: impl Fn(&AdapterGen) -> bool,
    ) -> Result<Option<AdapterGen>, TierFull> {
        let bytes = adapter.nbytes();
        if self.live.contains(&generation) {
            // The same generation again (its content is unchanged): replace it, evicting nothing.
            if let Some(old) = self.live.put(generation, adapter) {
                self.live_bytes = self.live_bytes - old.nbytes() + bytes;
            }
            return Ok(None);
        }
        let mut evicted = None;
        if self.live.len() >= self.capacity {
            let victim = self.live.iter().rev().map(|(g, _)| *g).find(|g| !protected(g)).ok_or(TierFull)?;
            if let Some(a) = self.live.pop(&victim) {
                self.live_bytes -= a.nbytes();
            }
            evicted = Some(victim);
        }
        // A reload back to the content of a generation that running requests still hold: it is
        // current again, so it is live (counted, evictable once unpinned), and retired no more.
        if let Some(old) = self.retired.remove(&generation) {
            self.retired_bytes -= old.nbytes();
        }
        self.live.put(generation, adapter);
        self.live_bytes += bytes;
        Ok(evicted)
    }

    /// Whether [`CpuTier::insert`] of `generation` would succeed once `leaving` (a live
    /// generation about to be retired or dropped) is out: the generation is live already, or
    /// there is a free entry, or some live entry is not `protected`.
    pub(crate) fn has_room(
        &self,
        generation: &AdapterGen,
        leaving: Option<&AdapterGen>,
        protected: impl Fn(&AdapterGen) -> bool,
    ) -> bool {
        let freed = usize::from(leaving.is_some_and(|g| self.live.contains(g)));
        self.live.contains(generation)
            || self.live.len() - freed < self.capacity
            || self.live.iter().any(|(g, _)| Some(g) != leaving && !protected(g))
    }

    /// Moves a live generation to the retired set (it stays until [`CpuTier::remove`]).
    pub(crate) fn retire(&mut self, generation: &AdapterGen) -> bool {
        match self.live.pop(generation) {
            Some(a) => {
                self.live_bytes -= a.nbytes();
                self.retired_bytes += a.nbytes();
                self.retired.insert(*generation, a);
                true
            }
            None => false,
        }
    }

    /// Holds `generation` outside the capacity (a request's, brought back while it could not be
    /// live), with the retired ones.
    pub(crate) fn hold_outside(&mut self, generation: AdapterGen, adapter: Arc<LoraAdapter>) {
        self.retired_bytes += adapter.nbytes();
        if let Some(old) = self.retired.insert(generation, adapter) {
            self.retired_bytes -= old.nbytes();
        }
    }

    /// Takes `generation` out of the entries held outside the capacity, if it is one.
    pub(crate) fn take_outside(&mut self, generation: &AdapterGen) -> Option<Arc<LoraAdapter>> {
        let a = self.retired.remove(generation)?;
        self.retired_bytes -= a.nbytes();
        Some(a)
    }

    /// Drops a generation, live or retired.
    pub(crate) fn remove(&mut self, generation: &AdapterGen) -> Option<Arc<LoraAdapter>> {
        if let Some(a) = self.live.pop(generation) {
            self.live_bytes -= a.nbytes();
            return Some(a);
        }
        let a = self.retired.remove(generation)?;
        self.retired_bytes -= a.nbytes();
        Some(a)
    }

    #[cfg(test)]
    pub(crate) fn is_retired(&self, generation: &AdapterGen) -> bool {
        self.retired.contains_key(generation)
    }

    /// Live generations, least recently used first.
    pub(crate) fn lru_order(&self) -> Vec<AdapterGen> {
        self.live.iter().rev().map(|(g, _)| *g).collect()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn live_len(&self) -> usize {
        self.live.len()
    }

    pub(crate) fn retired_len(&self) -> usize {
        self.retired.len()
    }

    /// Bytes held by live and retired entries (`Σ nbytes`).
    pub(crate) fn bytes(&self) -> u64 {
        self.live_bytes + self.retired_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{adapter, generation};

    fn insert(tier: &mut CpuTier, id: u64, protected: &[u64]) -> Result<Option<u64>, TierFull> {
        let generation = generation(id, id as u8);
        let evicted = tier.insert(generation, Arc::new(adapter("a", id as u8, 4)), |g| protected.contains(&g.id.0))?;
        Ok(evicted.map(|g| g.id.0))
    }

    fn order(tier: &CpuTier) -> Vec<u64> {
        tier.lru_order().iter().map(|g| g.id.0).collect()
    }

    #[test]
    fn evicts_the_least_recently_used() {
        let mut tier = CpuTier::new(3);
        for id in 0..3 {
            assert_eq!(insert(&mut tier, id, &[]), Ok(None));
        }
        assert_eq!(order(&tier), [0, 1, 2]);
        // A hit makes 0 the most recent, so 1 is the victim.
        assert!(tier.get(&generation(0, 0)).is_some());
        assert_eq!(order(&tier), [1, 2, 0]);
        assert_eq!(insert(&mut tier, 3, &[]), Ok(Some(1)));
        assert_eq!(order(&tier), [2, 0, 3]);
        assert_eq!(tier.live_len(), 3);
        // peek leaves the order alone.
        assert!(tier.peek(&generation(2, 2)).is_some());
        assert_eq!(insert(&mut tier, 4, &[]), Ok(Some(2)));
    }

    #[test]
    fn protected_entries_are_skipped_and_a_full_tier_takes_nothing() {
        let mut tier = CpuTier::new(2);
        insert(&mut tier, 0, &[]).unwrap();
        insert(&mut tier, 1, &[]).unwrap();
        assert_eq!(insert(&mut tier, 2, &[0]), Ok(Some(1)));
        assert_eq!(insert(&mut tier, 3, &[0, 2]), Err(TierFull));
        assert_eq!(order(&tier), [0, 2]);
        assert_eq!(CpuTier::new(0).insert(generation(9, 9), Arc::new(adapter("z", 9, 4)), |_| false), Err(TierFull));
    }

    #[test]
    fn room_counts_the_leaving_generation_and_unprotected_entries() {
        let mut tier = CpuTier::new(2);
        insert(&mut tier, 0, &[]).unwrap();
        assert!(tier.has_room(&generation(1, 1), None, |_| true));
        insert(&mut tier, 1, &[]).unwrap();
        let all = |_: &AdapterGen| true;
        assert!(!tier.has_room(&generation(2, 2), None, all));
        assert!(tier.has_room(&generation(2, 2), Some(&generation(0, 0)), all));
        assert!(tier.has_room(&generation(1, 1), None, all));
        assert!(tier.has_room(&generation(2, 2), None, |g| g.id.0 == 0));
        // A leaving generation that is not live frees nothing.
        assert!(!tier.has_room(&generation(2, 2), Some(&generation(7, 7)), all));
    }

    #[test]
    fn a_retired_generation_inserted_again_is_live_once() {
        let one = adapter("a", 0, 4).nbytes();
        let mut tier = CpuTier::new(2);
        insert(&mut tier, 0, &[]).unwrap();
        assert!(tier.retire(&generation(0, 0)));
        insert(&mut tier, 0, &[]).unwrap();
        assert_eq!((tier.live_len(), tier.retired_len(), tier.bytes()), (1, 0, one));
    }

    #[test]
    fn bytes_follow_entries_and_retired_ones_sit_outside_the_capacity() {
        let one = adapter("a", 0, 4).nbytes();
        assert_eq!(one, 4 * 16 * 4);
        let mut tier = CpuTier::new(2);
        insert(&mut tier, 0, &[]).unwrap();
        insert(&mut tier, 1, &[]).unwrap();
        assert_eq!(tier.bytes(), 2 * one);
        assert!(tier.retire(&generation(0, 0)));
        assert!(tier.is_retired(&generation(0, 0)));
        insert(&mut tier, 2, &[]).unwrap();
        // Two live entries at capacity plus one retired: three held, and the bytes say so.
        assert_eq!((tier.live_len(), tier.retired_len(), tier.bytes()), (2, 1, 3 * one));
        assert!(tier.get(&generation(0, 0)).is_some());
        assert!(tier.remove(&generation(0, 0)).is_some());
        assert_eq!(tier.bytes(), 2 * one);
        // Re-inserting a live generation replaces it without evicting.
        assert_eq!(insert(&mut tier, 2, &[]), Ok(None));
        assert_eq!(tier.bytes(), 2 * one);
    }
}
