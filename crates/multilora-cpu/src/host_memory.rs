//! Host memory a model keeps for its whole life: the advice that lets the system back a buffer
//! with huge pages ([`advise_huge`], [`advise_huge_within`]), taken by the quantized weights'
//! chunks ([`crate::quant`]'s arena) and by the layers' LoRA slots and CPU KV cache; and files
//! mapped to be read in place ([`map_file`]: adapters' safetensors, GGUF weights); and the
//! machine's memory ([`physical_bytes`]), what the engine sizes its defaults from.
//!
//! A decode step streams its weights, its adapters' slots and its KV rows once each, tens of
//! megabytes as short streams: on 4 KiB pages far more translations than the TLBs hold, on 2 MiB
//! pages a few dozen (docs/BENCHMARKS.md, "One GGUF decode step, and memory").

use std::ptr::NonNull;

/// The size of a huge page on x86-64 and aarch64 Linux.
pub const HUGE: usize = 2 << 20;

/// Asks the system to back `size` bytes from `ptr` with huge pages as they are first touched
/// (`madvise(MADV_HUGEPAGE)`); its answer changes nothing but speed, so it is not checked.
#[cfg(target_os = "linux")]
pub fn advise_huge(ptr: NonNull<u8>, size: usize) {
    // SAFETY: advice on a range of the caller's allocation; it changes how the range is backed,
    // not its contents or its validity.
    let _ = unsafe { libc::madvise(ptr.as_ptr().cast(), size, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
pub fn advise_huge(_: NonNull<u8>, _: usize) {}

/// [`advise_huge`] for the whole huge pages inside `len` bytes from `addr` (an allocation that is
/// not on a huge-page boundary).
pub fn advise_huge_within(addr: usize, len: usize) {
    let (start, end) = (addr.next_multiple_of(HUGE), (addr + len) / HUGE * HUGE);
    if let (true, Some(p)) = (start < end, NonNull::new(start as *mut u8)) {
        advise_huge(p, end - start);
    }
}

/// `file` mapped read-only, to be read in place.
///
/// The mapping is valid for as long as the returned map lives; what it cannot guard against is
/// another process truncating or rewriting the file meanwhile (the map's bytes would change
/// under the reader, or reading past the new end would fault). The files mapped here (adapters,
/// model weights) are opened read-only and not written while served: an operator who replaces
/// one in place while it loads gets a failed or inconsistent load of that one file, as with any
/// reader of a file that changes under it.
pub fn map_file(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: see above: a read-only private map of a file its owner does not change while it
    // is read; a concurrent truncation is the caller's documented hazard.
    unsafe { memmap2::Mmap::map(file) }
}

/// The machine's physical memory in bytes (`MemTotal` of `/proc/meminfo`), `None` where it cannot
/// be read (not Linux, no `/proc`).
pub fn physical_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
