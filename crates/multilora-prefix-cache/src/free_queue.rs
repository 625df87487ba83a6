//! An O(1) free-block queue: an intrusive doubly linked list over block ids.

use crate::BlockId;

/// Marks "no block" in the links.
const NIL: u32 = u32::MAX;

/// The free blocks in eviction order, least recently used at the head.
///
/// Links live in two `Vec`s indexed by block id (as vLLM's `FreeKVCacheBlockQueue` keeps them in
/// the blocks), so push, pop and removal from the middle are O(1) and never allocate.
#[derive(Clone, Debug)]
pub(crate) struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Whether each block is currently in the queue; guards against double insertion.
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every block of `0..num_blocks`, in id order.
    pub(crate) fn full(num_blocks: usize) -> Self {
        let n = num_blocks as u32;
        Self {
            prev: (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect(),
            queued: vec![true; num_blocks],
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            len: num_blocks,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, block: BlockId) -> bool {
        self.queued[block as usize]
    }

    /// Removes and returns the head (least recently used) block.
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let head = self.head;
        if head == NIL {
            return None;
        }
        self.remove(head);
        Some(head)
    }

    /// Unlinks `block`, which must be queued.
    pub(crate) fn remove(&mut self, block: BlockId) {
        debug_assert!(self.queued[block as usize]);
        let (p, n) = (self.prev[block as usize], self.next[block as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[block as usize] = NIL;
        self.next[block as usize] = NIL;
        self.queued[block as usize] = false;
        self.len -= 1;
    }

    /// Appends `block` at the tail (most recently used, evicted last).
    pub(crate) fn push_back(&mut self, block: BlockId) {
        debug_assert!(!self.queued[block as usize]);
        self.prev[block as usize] = self.tail;
        self.next[block as usize] = NIL;
        if self.tail == NIL {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.queued[block as usize] = true;
        self.len += 1;
    }

    /// Puts `block` at the head (evicted first).
    pub(crate) fn push_front(&mut self, block: BlockId) {
        debug_assert!(!self.queued[block as usize]);
        self.next[block as usize] = self.head;
        self.prev[block as usize] = NIL;
        if self.head == NIL {
            self.tail = block;
        } else {
            self.prev[self.head as usize] = block;
        }
        self.head = block;
        self.queued[block as usize] = true;
        self.len += 1;
    }

    /// The queued blocks from head to tail.
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            (at != NIL).then(|| {
                let here = at;
                at = self.next[here as usize];
                here
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_pop_remove_keep_order() {
        let mut q = FreeQueue::full(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        q.remove(2);
        assert_eq!(q.pop_front(), Some(0));
        q.push_back(0);
        q.push_front(2);
        assert_eq!(q.iter().collect::<Vec<_>>(), [2, 1, 3, 0]);
        assert_eq!(q.len(), 4);
        q.remove(0);
        q.remove(2);
        assert_eq!(q.iter().collect::<Vec<_>>(), [1, 3]);
        assert!(!q.contains(0) && q.contains(3));
        while q.pop_front().is_some() {}
        assert_eq!(q.len(), 0);
        q.push_back(3);
        assert_eq!(q.iter().collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn empty_queue() {
        let mut q = FreeQueue::full(0);
        assert_eq!(q.pop_front(), None);
        assert_eq!(q.iter().count(), 0);
    }
}
