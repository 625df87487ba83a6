//! Interned adapter generations with running and waiting counts, so the hot path compares `u32`s.

use std::collections::HashMap;

use multilora_types::AdapterGen;

/// The interned index of "no adapter" (a base-model request).
pub(crate) const NO_ADAPTER: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Entry {
    generation: AdapterGen,
    /// Live requests (waiting or running) with this generation; the entry is recycled at 0.
    live: u32,
    running: u32,
    waiting: u32,
}

/// Adapter generations of live requests, interned to small indices.
#[derive(Clone, Debug, Default)]
pub(crate) struct AdapterTable {
    index: HashMap<AdapterGen, u32>,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Entries with `running > 0`.
    num_running: usize,
}

impl AdapterTable {
    /// Interns `generation` for one more live request and returns its index.
    pub(crate) fn acquire(&mut self, generation: Option<AdapterGen>) -> u32 {
        let Some(generation) = generation else {
            return NO_ADAPTER;
        };
        if let Some(&idx) = self.index.get(&generation) {
            self.entries[idx as usize].live += 1;
            return idx;
        }
        let entry = Entry { generation, live: 1, running: 0, waiting: 0 };
        let idx = match self.free.pop() {
            Some(idx) => {
                self.entries[idx as usize] = entry;
                idx
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        self.index.insert(generation, idx);
        idx
    }

    /// Drops one live request of `idx`; the index is recycled when none is left.
    pub(crate) fn release(&mut self, idx: u32) {
        if idx == NO_ADAPTER {
            return;
        }
        let entry = &mut self.entries[idx as usize];
        debug_assert!(entry.live > 0);
        entry.live -= 1;
        if entry.live == 0 {
            let generation = entry.generation;
            self.index.remove(&generation);
            self.free.push(idx);
        }
    }

    pub(crate) fn add_running(&mut self, idx: u32) {
        if idx == NO_ADAPTER {
            return;
        }
        let entry = &mut self.entries[idx as usize];
        entry.running += 1;
        if entry.running == 1 {
            self.num_running += 1;
        }
    }

    pub(crate) fn remove_running(&mut self, idx: u32) {
        if idx == NO_ADAPTER {
            return;
        }
        let entry = &mut self.entries[idx as usize];
        entry.running -= 1;
        if entry.running == 0 {
            self.num_running -= 1;
        }
    }

    pub(crate) fn add_waiting(&mut self, idx: u32) {
        if idx != NO_ADAPTER {
            self.entries[idx as usize].waiting += 1;
        }
    }

    pub(crate) fn remove_waiting(&mut self, idx: u32) {
        if idx != NO_ADAPTER {
            self.entries[idx as usize].waiting -= 1;
        }
    }

    /// Whether a running request uses `idx` (always true for the base model, which needs no slot).
    #[inline]
    pub(crate) fn is_running(&self, idx: u32) -> bool {
        idx == NO_ADAPTER || self.entries[idx as usize].running > 0
    }

    /// Distinct generations among running requests.
    #[inline]
    pub(crate) fn num_running(&self) -> usize {
        self.num_running
    }

    /// The running generation with the fewest running requests (lowest index on ties).
    pub(crate) fn fewest_running(&self) -> Option<u32> {
        self.live_entries().filter(|(_, e)| e.running > 0).min_by_key(|(idx, e)| (e.running, *idx)).map(|(idx, _)| idx)
    }

    pub(crate) fn running_gens(&self) -> Vec<AdapterGen> {
        self.sorted_gens(|e| e.running > 0)
    }

    pub(crate) fn waiting_gens(&self) -> Vec<AdapterGen> {
        self.sorted_gens(|e| e.waiting > 0)
    }

    /// Waiting requests whose generation is not running.
    pub(crate) fn waiting_not_running(&self) -> usize {
        self.live_entries().filter(|(_, e)| e.running == 0).map(|(_, e)| e.waiting as usize).sum()
    }

    fn live_entries(&self) -> impl Iterator<Item = (u32, &Entry)> {
        self.entries.iter().enumerate().filter(|(_, e)| e.live > 0).map(|(i, e)| (i as u32, e))
    }

    fn sorted_gens(&self, keep: impl Fn(&Entry) -> bool) -> Vec<AdapterGen> {
        let mut gens: Vec<AdapterGen> =
            self.live_entries().filter(|(_, e)| keep(e)).map(|(_, e)| e.generation).collect();
        gens.sort_unstable();
        gens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multilora_types::{AdapterId, Fingerprint};

    fn g(id: u64, fp: u8) -> Option<AdapterGen> {
        Some(AdapterGen::new(AdapterId(id), Fingerprint([fp; 32])))
    }

    #[test]
    fn generations_are_interned_counted_and_recycled() {
        let mut t = AdapterTable::default();
        assert_eq!(t.acquire(None), NO_ADAPTER);
        let a = t.acquire(g(1, 1));
        let a2 = t.acquire(g(1, 1));
        let reloaded = t.acquire(g(1, 2));
        assert_eq!(a, a2);
        assert_ne!(a, reloaded, "a reload in place is a new generation");
        t.add_running(a);
        t.add_running(reloaded);
        assert_eq!(t.num_running(), 2);
        assert_eq!(t.fewest_running(), Some(a));
        t.remove_running(reloaded);
        t.release(reloaded);
        assert_eq!(t.num_running(), 1);
        let b = t.acquire(g(2, 3));
        assert_eq!(b, reloaded, "the freed index is reused");
        assert!(t.is_running(NO_ADAPTER));
        assert!(!t.is_running(b));
        t.add_waiting(b);
        assert_eq!(t.waiting_not_running(), 1);
        assert_eq!(t.running_gens(), vec![AdapterGen::new(AdapterId(1), Fingerprint([1; 32]))]);
        assert_eq!(t.waiting_gens(), vec![AdapterGen::new(AdapterId(2), Fingerprint([3; 32]))]);
    }
}
