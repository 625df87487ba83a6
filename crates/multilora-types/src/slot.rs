//! `SlotId`: one of the `max_loras` device slots an adapter generation is written into.

use std::fmt;

/// A device slot, `0..max_loras`. A row with no adapter has no slot (`Option<SlotId>::None`);
/// only the kernels' own index buffers spell that `-1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(usize);

impl SlotId {
    /// Slot number `index`.
    pub const fn new(index: usize) -> SlotId {
        SlotId(index)
    }

    /// The slot's number, an index into the slot buffers.
    pub const fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {}", self.0)
    }
}
