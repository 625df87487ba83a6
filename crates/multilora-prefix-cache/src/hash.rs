//! Chained, adapter-aware block hashes (xxh3-128) and their exact byte layout.

use xxhash_rust::xxh3::{Xxh3Default, xxh3_128};

/// A 32-byte adapter content fingerprint (blake3-256 computed by the adapter crate); the base model has none.
pub type AdapterKey = [u8; 32];

/// The hash of one full block of tokens, chained over its prefix.
///
/// # Byte layout
///
/// The hash of a full block of `block_size` tokens is `xxh3_128(bytes)` — XXH3-128 with seed 0 and
/// the default secret, i.e. `XXH3_128bits(bytes, len)` of the reference C library — read as the
/// `u128` `(high64 << 64) | low64`. `bytes` is the concatenation of:
///
/// | field   | bytes | encoding |
/// |---------|-------|----------|
/// | parent  | 16    | the previous block's hash as `u128` little-endian; for the first block the seed `u64` zero-extended to `u128` (so `seed.to_le_bytes()` then 8 zero bytes) |
/// | tokens  | 4 × `block_size` | each token id as `u32` little-endian, in order |
/// | adapter | 1 or 33 | `0x00` for the base model; `0x01` then the 32 fingerprint bytes as given |
/// | salt    | 1 or 9 + len | `0x00` for none; `0x01`, the salt length as `u64` little-endian, then the salt bytes |
///
/// For example, with seed 0 and `block_size` 4 the base-model block `[1, 2, 3, 4]` hashes the 34
/// bytes `00×16 ‖ 01 00 00 00 02 00 00 00 03 00 00 00 04 00 00 00 ‖ 00 ‖ 00`, and `xxhsum -H2`
/// over them prints `d4c8b3a09ed1ce0c047e0e46e9b2070d`:
///
/// ```
/// use multilora_prefix_cache::{BlockHash, ExtraKeys, hash_blocks};
///
/// let h = hash_blocks(0, 4, &[1, 2, 3, 4], &ExtraKeys::base());
/// assert_eq!(h, [BlockHash(0xd4c8b3a09ed1ce0c047e0e46e9b2070d)]);
/// ```
///
/// The extra keys go into every block, not only the first: the chain would carry them anyway, but
/// mixing them in each block means a block hash alone identifies the adapter's KV, whatever table
/// it sits in. Only full blocks are hashed; a partial tail block is never shared.
///
/// # Why xxh3-128
///
/// Speed: one XXH3 call over ~114 bytes costs tens of nanoseconds, so hashing runs at hundreds of
/// millions of tokens per second and never shows up next to a model step. 128 bits: among `n`
/// distinct blocks the chance of any accidental collision is about `n² / 2¹²⁹` — for a trillion
/// blocks still below `10⁻¹⁴`, negligible. It is stable: the output is fixed by the XXH3
/// specification, unlike `std`'s `DefaultHasher`, which may change between Rust releases.
///
/// XXH3 is *not* collision-resistant against an adversary: someone who chooses token sequences
/// and knows the other inputs can search for a block whose hash equals a target block's. A tenant
/// able to craft such collisions could, at worst, make two different blocks share one cache
/// entry. If the attacker's block is cached first, a victim request whose block collides reuses
/// the attacker's KV, so the victim's output is steered or garbled (cache poisoning); if the
/// victim's block is cached first, the attacker's request attends to the victim's KV and may learn
/// something about the victim's prompt from its own output (a side channel). Only requests whose
/// chain contains the colliding hash are affected; stored KV is never overwritten, and the engine
/// itself stays sound. Crafting a target requires knowing every hashed byte of the victim's block,
/// including its parent chain and extra keys; so the mitigation is [`ExtraKeys::cache_salt`]: a
/// secret salt per tenant puts each tenant's blocks in a hash space an attacker cannot aim at. The
/// adapter fingerprint keeps adapters apart the same way (but is not secret).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Extra keys mixed into every block hash.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExtraKeys {
    /// The adapter's content fingerprint; `None` for the base model.
    pub adapter: Option<AdapterKey>,
    /// A per-tenant salt that keeps tenants' blocks apart (see the collision note on [`BlockHash`]).
    pub cache_salt: Option<Vec<u8>>,
}

impl ExtraKeys {
    /// Keys of the base model: no adapter, no salt.
    pub fn base() -> Self {
        Self::default()
    }

    /// Keys of an adapter, identified by its content fingerprint.
    pub fn adapter(key: AdapterKey) -> Self {
        Self { adapter: Some(key), cache_salt: None }
    }

    /// Adds a per-tenant cache salt.
    pub fn with_salt(mut self, salt: impl Into<Vec<u8>>) -> Self {
        self.cache_salt = Some(salt.into());
        self
    }

    /// Length in bytes of the encoded extra keys (the tail of every hashed buffer).
    fn encoded_len(&self) -> usize {
        let adapter = 1 + self.adapter.map_or(0, |k| k.len());
        let salt = 1 + self.cache_salt.as_ref().map_or(0, |s| 8 + s.len());
        adapter + salt
    }

    /// Feeds the encoded extra keys to `sink` piece by piece, in layout order.
    fn encode(&self, mut sink: impl FnMut(&[u8])) {
        match &self.adapter {
            None => sink(&[0]),
            Some(key) => {
                sink(&[1]);
                sink(key);
            }
        }
        match &self.cache_salt {
            None => sink(&[0]),
            Some(salt) => {
                sink(&[1]);
                sink(&(salt.len() as u64).to_le_bytes());
                sink(salt);
            }
        }
    }
}

/// The parent value of the first block for a given seed.
pub fn seed_parent(seed: u64) -> BlockHash {
    BlockHash(u128::from(seed))
}

/// Largest buffer hashed in one call from the stack; block_size 16 with an adapter needs 114 bytes.
const STACK_BUF: usize = 512;

/// Hashes of the full blocks of `tokens` (a partial tail block is not hashed).
///
/// `seed` is the parent of the first block ([`KvConfig::hash_seed`](crate::KvConfig::hash_seed));
/// a `block_size` of 0 yields no blocks.
pub fn hash_blocks(seed: u64, block_size: usize, tokens: &[u32], extra: &ExtraKeys) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len().checked_div(block_size).unwrap_or(0));
    extend_hashes(seed_parent(seed), block_size, tokens, extra, &mut out);
    out
}

/// Appends to `out` the hashes of the full blocks of `tokens`, chaining from `parent`.
///
/// This is the incremental form of [`hash_blocks`]: to extend a sequence, pass the last hash
/// already computed as `parent` and only the tokens after the hashed blocks.
pub fn extend_hashes(
    parent: BlockHash,
    block_size: usize,
    tokens: &[u32],
    extra: &ExtraKeys,
    out: &mut Vec<BlockHash>,
) {
    out.extend(BlockHashes::new(parent, block_size, tokens, extra));
}

/// A lazy iterator over the hashes of the full blocks of a token sequence, chaining from a parent;
/// lets a lookup stop hashing at the first block that misses the cache.
#[derive(Debug)]
pub struct BlockHashes<'a> {
    parent: u128,
    blocks: std::slice::ChunksExact<'a, u32>,
    extra: &'a ExtraKeys,
    /// End of the token bytes, where the encoded extra keys start.
    token_end: usize,
    /// Length of the hashed buffer.
    total: usize,
    /// The buffer reused for every block when `total` fits; the extra keys are written once.
    buf: [u8; STACK_BUF],
}

impl<'a> BlockHashes<'a> {
    /// Hashes of the full blocks of `tokens` after `parent` (none when `block_size` is 0).
    pub fn new(parent: BlockHash, block_size: usize, tokens: &'a [u32], extra: &'a ExtraKeys) -> Self {
        // A block size of 0 yields no blocks: chunk by 1 over nothing.
        let blocks = if block_size == 0 { [].chunks_exact(1) } else { tokens.chunks_exact(block_size) };
        let token_end = 16 + 4 * block_size;
        let total = token_end + extra.encoded_len();
        let mut buf = [0u8; STACK_BUF];
        if total <= STACK_BUF {
            // The extra keys are the same for every block, so they are written once at the tail
            // and only the parent and tokens are overwritten per block: no allocation, one call.
            let mut at = token_end;
            extra.encode(|piece| {
                buf[at..at + piece.len()].copy_from_slice(piece);
                at += piece.len();
            });
        }
        Self { parent: parent.0, blocks, extra, token_end, total, buf }
    }
}

impl Iterator for BlockHashes<'_> {
    type Item = BlockHash;

    fn next(&mut self) -> Option<BlockHash> {
        let block = self.blocks.next()?;
        self.parent = if self.total <= STACK_BUF {
            self.buf[..16].copy_from_slice(&self.parent.to_le_bytes());
            for (dst, token) in self.buf[16..self.token_end].chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&token.to_le_bytes());
            }
            xxh3_128(&self.buf[..self.total])
        } else {
            // Large blocks or long salts: the streaming hasher gives the same digest as the
            // one-shot call over the concatenated bytes, still without allocating.
            let mut hasher = Xxh3Default::new();
            hasher.update(&self.parent.to_le_bytes());
            for token in block {
                hasher.update(&token.to_le_bytes());
            }
            self.extra.encode(|piece| hasher.update(piece));
            hasher.digest128()
        };
        Some(BlockHash(self.parent))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for BlockHashes<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout spelled out by hand, as another implementation would write it.
    fn reference(seed: u64, block_size: usize, tokens: &[u32], extra: &ExtraKeys) -> Vec<BlockHash> {
        let mut parent = u128::from(seed);
        let mut out = Vec::new();
        for block in tokens.chunks_exact(block_size) {
            let mut bytes = parent.to_le_bytes().to_vec();
            for t in block {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            match extra.adapter {
                None => bytes.push(0),
                Some(k) => {
                    bytes.push(1);
                    bytes.extend_from_slice(&k);
                }
            }
            match &extra.cache_salt {
                None => bytes.push(0),
                Some(s) => {
                    bytes.push(1);
                    bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    bytes.extend_from_slice(s);
                }
            }
            parent = xxh3_128(&bytes);
            out.push(BlockHash(parent));
        }
        out
    }

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).map(|i| i.wrapping_mul(2_654_435_761)).collect()
    }

    #[test]
    fn matches_the_documented_layout() {
        let t = tokens(100);
        let cases = [
            ExtraKeys::base(),
            ExtraKeys::adapter([7; 32]),
            ExtraKeys::adapter([7; 32]).with_salt(b"tenant".to_vec()),
            ExtraKeys::base().with_salt(vec![9; 600]), // forces the streaming path
        ];
        for extra in &cases {
            for bs in [1, 3, 16, 200] {
                assert_eq!(hash_blocks(42, bs, &t, extra), reference(42, bs, &t, extra), "bs {bs}");
            }
        }
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(hash_blocks(0, 16, &tokens(47), &ExtraKeys::base()).len(), 2);
        assert!(hash_blocks(0, 16, &tokens(15), &ExtraKeys::base()).is_empty());
        assert!(hash_blocks(0, 0, &tokens(15), &ExtraKeys::base()).is_empty());
    }

    #[test]
    fn incremental_equals_whole() {
        let t = tokens(80);
        let extra = ExtraKeys::adapter([1; 32]);
        let whole = hash_blocks(5, 16, &t, &extra);
        let mut inc = hash_blocks(5, 16, &t[..32], &extra);
        let parent = *inc.last().unwrap();
        extend_hashes(parent, 16, &t[32..], &extra, &mut inc);
        assert_eq!(inc, whole);
    }

    #[test]
    fn seed_and_salt_separate_chains() {
        let t = tokens(32);
        let base = hash_blocks(1, 16, &t, &ExtraKeys::base());
        assert_ne!(base, hash_blocks(2, 16, &t, &ExtraKeys::base()));
        assert_ne!(base, hash_blocks(1, 16, &t, &ExtraKeys::base().with_salt(b"a".to_vec())));
        // An empty salt is still a salt: it differs from none.
        assert_ne!(base, hash_blocks(1, 16, &t, &ExtraKeys::base().with_salt(Vec::new())));
    }

    /// Pins the output so an accidental layout change is caught. The expected values were
    /// produced independently by the reference C tool, `xxhsum -H2` (xxHash 0.8.1), over files
    /// holding the bytes of the documented layout.
    #[test]
    fn golden_values_match_the_reference_tool() {
        let h = hash_blocks(0, 4, &[1, 2, 3, 4], &ExtraKeys::base());
        assert_eq!(h, [BlockHash(0xd4c8b3a09ed1ce0c047e0e46e9b2070d)]);
        let tokens: Vec<u32> = (0..16).collect();
        let h = hash_blocks(crate::DEFAULT_HASH_SEED, 16, &tokens, &ExtraKeys::adapter([0xab; 32]));
        assert_eq!(h, [BlockHash(0xecea8c6da42e75efaa2ef0fec1831ba4)]);
    }
}
