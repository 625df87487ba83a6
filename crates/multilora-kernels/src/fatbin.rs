//! What a CUDA fatbin holds: its entries' kind (machine code for one architecture, or PTX for the
//! driver to compile) and architecture, read from the container's headers. `build.rs` makes one
//! fatbin per `.cu` file; the host logs what each holds and whether the GPU at hand runs one of
//! its SASS entries as it is (no compile on first use), and a test checks every module holds
//! SASS for each architecture it was built for (against `cuobjdump --list-elf` where CI has it).
//!
//! The layout, as nvcc writes it (little-endian): a 16-byte header (magic `0xBA55ED50`, `u16`
//! version, `u16` header size, `u64` size of the entries), then entries, each a header (`u16`
//! kind: 1 PTX, 2 ELF; `u16` version; `u32` header size; `u64` payload size; …; `u32` SM version
//! at byte 28; `u64` flags at byte 40, bit 20 the architecture-specific `a` variant) followed by
//! its payload.

use crate::Error;

/// The fatbin container's magic number.
const MAGIC: u32 = 0xBA55_ED50;
/// The flag of an entry built for an architecture-specific target (`sm_90a`).
const ARCH_SPECIFIC: u64 = 1 << 20;

/// What an entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Machine code (a cubin) for one GPU architecture, loaded as it is.
    Sass,
    /// PTX, which the driver compiles for the GPU when it loads the module.
    Ptx,
}

/// One entry of a fatbin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// SASS or PTX.
    pub code: Code,
    /// `sm_90a`, `sm_80` for SASS; `compute_90` for PTX.
    pub arch: String,
    /// The SM version as a number (90 for `sm_90a`).
    pub sm: u32,
    /// Bytes of the payload.
    pub bytes: usize,
}

impl Entry {
    /// Whether a GPU of compute capability `major.minor` runs this entry without a compile: SASS
    /// of exactly its version (an `sm_90a` cubin runs only on 9.0).
    pub fn runs_as_is_on(&self, major: u32, minor: u32) -> bool {
        self.code == Code::Sass && self.sm == major * 10 + minor
    }
}

/// The entries of `fatbin`, in order.
pub fn entries(fatbin: &[u8]) -> Result<Vec<Entry>, Error> {
    let bad = |why: String| Error::Fatbin(why);
    let magic = u32_at(fatbin, 0).ok_or_else(|| bad("shorter than its header".into()))?;
    if magic != MAGIC {
        return Err(bad(format!("magic {magic:#010x}, not {MAGIC:#010x}")));
    }
    let header = usize::from(u16_at(fatbin, 6).ok_or_else(|| bad("no header size".into()))?);
    let size = u64_at(fatbin, 8).ok_or_else(|| bad("no size".into()))?;
    let end =
        usize::try_from(size).ok().and_then(|s| header.checked_add(s)).filter(|&e| e <= fatbin.len()).ok_or_else(
            || bad(format!("{size} bytes of entries after a {header}-byte header in {} bytes", fatbin.len())),
        )?;
    let mut out = Vec::new();
    let mut at = header;
    while at < end {
        let field = |what: &str, v: Option<u64>| v.ok_or_else(|| bad(format!("entry at byte {at}: no {what}")));
        let kind = field("kind", u16_at(fatbin, at).map(u64::from))?;
        let head = field("header size", u32_at(fatbin, at + 4).map(u64::from))?;
        let payload = field("payload size", u64_at(fatbin, at + 8))?;
        let sm = field("SM version", u32_at(fatbin, at + 28).map(u64::from))? as u32;
        let flags = field("flags", u64_at(fatbin, at + 40))?;
        let next = usize::try_from(head.saturating_add(payload))
            .ok()
            .and_then(|n| at.checked_add(n))
            .filter(|&n| n <= end && head >= 48)
            .ok_or_else(|| bad(format!("entry at byte {at}: {head} + {payload} bytes run past the end ({end})")))?;
        let (code, arch) = match kind {
            1 => (Code::Ptx, format!("compute_{sm}")),
            2 => (Code::Sass, format!("sm_{sm}{}", if flags & ARCH_SPECIFIC != 0 { "a" } else { "" })),
            other => return Err(bad(format!("entry at byte {at}: kind {other}, neither PTX (1) nor ELF (2)"))),
        };
        out.push(Entry { code, arch, sm, bytes: payload as usize });
        at = next;
    }
    Ok(out)
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fatbin's bytes: the container header, then each `(kind, sm, flags, payload)` entry.
    fn container(entries: &[(u16, u32, u64, &[u8])]) -> Vec<u8> {
        let mut body = Vec::new();
        for (kind, sm, flags, payload) in entries {
            let mut h = [0u8; 64];
            h[0..2].copy_from_slice(&kind.to_le_bytes());
            h[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
            h[4..8].copy_from_slice(&64u32.to_le_bytes());
            h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            h[28..32].copy_from_slice(&sm.to_le_bytes());
            h[40..48].copy_from_slice(&flags.to_le_bytes());
            body.extend_from_slice(&h);
            body.extend_from_slice(payload);
        }
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&16u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn reads_each_entry_and_the_a_variant() {
        let b =
            container(&[(2, 80, 0x11, b"\x7fELF...."), (2, 90, 0x11 | ARCH_SPECIFIC, b"\x7fELF"), (1, 90, 0, b"ptx")]);
        let e = entries(&b).unwrap();
        let names: Vec<_> = e.iter().map(|e| (e.code, e.arch.as_str(), e.bytes)).collect();
        assert_eq!(names, [(Code::Sass, "sm_80", 8), (Code::Sass, "sm_90a", 4), (Code::Ptx, "compute_90", 3)]);
        assert!(e[1].runs_as_is_on(9, 0));
        assert!(!e[1].runs_as_is_on(8, 9));
        assert!(!e[2].runs_as_is_on(9, 0), "PTX is compiled on load");
    }

    #[test]
    fn a_cut_or_foreign_file_is_an_error_not_a_panic() {
        let b = container(&[(2, 80, 0, b"\x7fELF....")]);
        for cut in 0..b.len() {
            assert!(entries(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(entries(&bad).unwrap_err().to_string().contains("magic"));
        let mut huge = b.clone();
        huge[16 + 8..16 + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(entries(&huge).is_err());
        let mut kind = b;
        kind[16] = 7;
        assert!(entries(&kind).unwrap_err().to_string().contains("kind 7"));
    }
}
