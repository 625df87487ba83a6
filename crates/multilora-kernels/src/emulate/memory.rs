//! The host memory of emulated launches: buffers, and the views of them that the parameters'
//! pointer fields point into. Every access a kernel makes through a pointer is checked against
//! the view the pointer came from, so a view says how far a field may reach: a whole buffer
//! ([`Memory::add`]) or a narrower stretch of it ([`Memory::view`]).
//!
//! A pointer value is `(view + 1) << 48 | byte offset in the view's buffer`, so pointer
//! arithmetic on the host (`out + 4 * column`) stays within the same view; 0 is null.

use super::{Error, Result};

/// Bits of a pointer value that hold the byte offset.
const OFFSET_BITS: u32 = 48;
/// Views one [`Memory`] holds at most (the high 16 bits of a pointer, less null).
const MAX_VIEWS: usize = (1 << (64 - OFFSET_BITS)) - 1;

/// One view: `len` bytes of buffer `buffer` from byte `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) buffer: usize,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// Buffers and views for a sequence of emulated launches; see the module's doc.
#[derive(Clone, Debug, Default)]
pub struct Memory {
    pub(crate) buffers: Vec<Vec<u8>>,
    pub(crate) views: Vec<View>,
}

impl Memory {
    /// No buffers.
    pub fn new() -> Memory {
        Memory::default()
    }

    /// Adds a buffer and returns a pointer to its first byte, in a view of the whole buffer.
    ///
    /// # Panics
    /// Past 65535 views in one `Memory` (the pointer encoding's limit).
    pub fn add(&mut self, bytes: Vec<u8>) -> u64 {
        let len = bytes.len();
        self.buffers.push(bytes);
        self.push_view(View { buffer: self.buffers.len() - 1, start: 0, len })
    }

    /// A pointer to where `ptr` points, in a new view of the `len` bytes from there: what a
    /// pointer field may reach when it names part of a buffer (one tensor of several).
    ///
    /// # Panics
    /// Past 65535 views in one `Memory`.
    pub fn view(&mut self, ptr: u64, len: usize) -> Result<u64> {
        let (view, offset) = self.locate(ptr)?;
        let buffer = self.views[view].buffer;
        let size = self.buffers[buffer].len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::View { reason: format!("{len} bytes from byte {offset} of a buffer of {size} bytes") });
        }
        Ok(self.push_view(View { buffer, start: offset, len }))
    }

    /// The whole buffer `ptr`'s view lies in.
    pub fn get(&self, ptr: u64) -> Result<&[u8]> {
        let (view, _) = self.locate(ptr)?;
        Ok(&self.buffers[self.views[view].buffer])
    }

    fn push_view(&mut self, v: View) -> u64 {
        assert!(self.views.len() < MAX_VIEWS, "an emulator memory holds at most {MAX_VIEWS} views");
        self.views.push(v);
        ((self.views.len() as u64) << OFFSET_BITS) | v.start as u64
    }

    /// The view a pointer names and the byte offset in its buffer.
    fn locate(&self, ptr: u64) -> Result<(usize, usize)> {
        let view = (ptr >> OFFSET_BITS) as usize;
        let offset = (ptr & ((1 << OFFSET_BITS) - 1)) as usize;
        if view == 0 || view > self.views.len() {
            return Err(Error::View { reason: format!("pointer {ptr:#x} names no view of this memory") });
        }
        Ok((view - 1, offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_name_views_and_offsets() -> Result<()> {
        let mut m = Memory::new();
        let a = m.add(vec![0; 16]);
        let b = m.add(vec![1; 8]);
        assert_eq!(a, 1 << 48);
        assert_eq!(b, 2 << 48);
        let part = m.view(b + 4, 4)?;
        assert_eq!(part, (3 << 48) | 4);
        assert_eq!(m.views[2], View { buffer: 1, start: 4, len: 4 });
        assert_eq!(m.get(part)?, &[1; 8]);
        assert_eq!(m.get(a + 12)?.len(), 16);
        assert!(m.view(b + 4, 5).is_err(), "a view past its buffer");
        assert!(m.get(0).is_err() && m.get(9 << 48).is_err());
        Ok(())
    }
}
