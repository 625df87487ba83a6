//! Where quantized weights live ([`Lines`]): ranges of 2 MiB-aligned chunks that the kernel is
//! asked to back with huge pages.
//!
//! A decode step streams every weight once (~64 MB for SmolLM2-135M's projections, 30 MB more
//! for its `lm_head`), mostly through the products' own prefetches a few KiB ahead. On 4 KiB
//! pages each of those streams crosses into a new page every 4 KiB, and a step touches ~25,000
//! pages, far more than the TLBs hold; on 2 MiB pages a step's weights take ~50 translations.
//! Measured on the 16-row LoRA step of docs/BENCHMARKS.md (Zen 5; two copies of the model in one
//! process, steps alternating between them, each arrangement loaded first as often as second):
//! 0.1–0.2 ms of a ~9.5 ms step faster than the same chunks on 4 KiB pages, or than one
//! allocation per tensor.
//!
//! The weights of one model are a few hundred tensors of 50 KiB to 1 MiB (and one large
//! embedding), too small for a huge page each: they are carved one after the other from shared
//! chunks of [`CHUNK`] bytes (a tensor larger than half a chunk gets one of its own), each range
//! zeroed as it is carved, so only the pages in use become resident. A chunk is freed when the
//! last weight in it is. Huge pages are advice: where the kernel has none to give (or the system
//! is not Linux), the chunks are ordinary memory and nothing else changes.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::host_memory::{HUGE, advise_huge};

/// Bytes of a shared chunk.
const CHUNK: usize = 32 << 20;

/// Every range starts on a cache line, so a vector load of a record's field never straddles two
/// lines where the layout aligns it.
const LINE: usize = 64;

/// One allocation of `size` bytes on a huge page, advised to be backed by huge pages.
struct Chunk {
    ptr: NonNull<u8>,
    size: usize,
}

// SAFETY: a chunk is plain memory; each `Lines` carved from it is the only one that touches its
// range (see `Lines`), and the chunk itself only allocates and frees.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// A chunk of `size > 0` bytes (a multiple of `HUGE`); aborts as `Vec` does when memory runs out.
    fn new(size: usize) -> Chunk {
        let layout = std::alloc::Layout::from_size_align(size, HUGE).expect("chunk layout");
        // SAFETY: `size > 0`.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(ptr) else { std::alloc::handle_alloc_error(layout) };
        advise_huge(ptr, size);
        Chunk { ptr, size }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.size, HUGE).expect("chunk layout");
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// The chunk small weights are carved from now, and the bytes of it taken. Weak: the chunk goes
/// when its last weight does.
static CURRENT: Mutex<Option<(Weak<Chunk>, usize)>> = Mutex::new(None);

/// `len` bytes of weight tiles, zeroed, on a cache line of a huge-page chunk ([`Lines::zeroed`]);
/// dereferences to them.
pub(crate) struct Lines {
    chunk: Arc<Chunk>,
    at: usize,
    len: usize,
}

impl Lines {
    /// `len` zero bytes.
    pub(crate) fn zeroed(len: usize) -> Lines {
        let need = len.div_ceil(LINE).max(1) * LINE;
        let (chunk, at) = if need > CHUNK / 2 {
            (Arc::new(Chunk::new(need.next_multiple_of(HUGE))), 0)
        } else {
            let mut current = CURRENT.lock().unwrap_or_else(PoisonError::into_inner);
            let live = current.as_ref().and_then(|(c, used)| Some((c.upgrade()?, *used)));
            let (chunk, at) = match live {
                Some((c, used)) if used + need <= c.size => (c, used),
                _ => (Arc::new(Chunk::new(CHUNK)), 0),
            };
            *current = Some((Arc::downgrade(&chunk), at + need));
            (chunk, at)
        };
        // SAFETY: `at + len <= chunk.size`, a range no other `Lines` was given (`CURRENT` hands
        // each byte out once, under its lock).
        unsafe { chunk.ptr.as_ptr().add(at).write_bytes(0, len) };
        Lines { chunk, at, len }
    }
}

impl std::ops::Deref for Lines {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes from `at` in the chunk, initialized (zeroed in `zeroed`), this
        // `Lines`' alone, borrowed with `self`; the `Arc` keeps the chunk alive.
        unsafe { std::slice::from_raw_parts(self.chunk.ptr.as_ptr().add(self.at), self.len) }
    }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, borrowed mutably with `self`: no other `Lines` reaches the range.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.ptr.as_ptr().add(self.at), self.len) }
    }
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lines({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranges are zeroed, on cache lines, apart from each other, large ones in chunks of their
    /// own, and a chunk goes with its last range.
    #[test]
    fn ranges_are_zeroed_aligned_and_apart() {
        let mut a = Lines::zeroed(100);
        a.fill(0xab);
        let b = Lines::zeroed(CHUNK / 4);
        let big = Lines::zeroed(CHUNK);
        for l in [&a, &b, &big] {
            assert_eq!(l.as_ptr() as usize % LINE, 0);
        }
        assert!(b.iter().all(|&v| v == 0) && big.iter().all(|&v| v == 0));
        assert_eq!(a.len(), 100);
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        assert!(pa + 100 <= pb || pb + CHUNK / 4 <= pa, "ranges overlap");
        assert_eq!(big.chunk.ptr.as_ptr() as usize % HUGE, 0);
        assert_eq!(big.chunk.size, CHUNK.next_multiple_of(HUGE));
        let weak = Arc::downgrade(&big.chunk);
        drop(big);
        assert!(weak.upgrade().is_none(), "a large range's chunk goes with it");
        assert!(a.iter().all(|&v| v == 0xab), "a's bytes are its own");
    }
}
