//! An adapter's identity (`AdapterId`), its content (`Fingerprint`), and the generation key made
//! of the two (`AdapterGen`).

use std::fmt;

/// An adapter's identity for the life of the store, assigned at registration and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterId(pub u64);

impl fmt::Display for AdapterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// blake3-256 of an adapter's normalized config and tensor bytes: its identity in the prefix cache
/// and the scheduler. Two adapters with the same fingerprint compute the same function.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex of the whole digest.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// An adapter generation: what occupies a slot and counts toward `max_loras`.
///
/// An in-place reload keeps the id and changes the fingerprint, so it is a new generation; while
/// requests of the old one still run, the two count as two adapters. The prefix cache keys on the
/// fingerprint alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterGen {
    /// The adapter.
    pub id: AdapterId,
    /// The content it had when this generation was loaded.
    pub fingerprint: Fingerprint,
}

impl AdapterGen {
    /// A generation key.
    pub fn new(id: AdapterId, fingerprint: Fingerprint) -> AdapterGen {
        AdapterGen { id, fingerprint }
    }
}

impl fmt::Display for AdapterGen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fp = &self.fingerprint.0;
        write!(f, "{}@{:02x}{:02x}{:02x}{:02x}", self.id.0, fp[0], fp[1], fp[2], fp[3])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_print_id_and_fingerprint_prefix() {
        let mut fp = [0u8; 32];
        fp[..4].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        let g = AdapterGen::new(AdapterId(7), Fingerprint(fp));
        assert_eq!(g.to_string(), "7@deadbeef");
        assert_eq!(Fingerprint(fp).to_hex().len(), 64);
        assert!(format!("{:?}", Fingerprint(fp)).starts_with("Fingerprint(deadbeef"));
    }
}
