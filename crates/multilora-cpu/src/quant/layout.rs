//! How a [`super::QuantWeight`] holds its blocks: GGML's blocks rearranged into tiles of
//! [`TN`] (16) output columns, in which every fixed-size group of bytes is what one vector
//! instruction of the kernels needs, with the same bytes as the GGUF file (the K-quants' packed
//! 6-bit scales are held one per byte: at most 3.6% more).
//!
//! A segment of `n` columns is `ceil(n / 16)` tiles, each the whole `k` of its 16 columns as
//! `k / sb` consecutive super-block records (`sb`: 32 values, 256 for the K-quants), so a tile
//! streams from memory in one pass. One record holds, for its 16 columns `c` (zero past `n`):
//!
//! - `d` (every type): 16 f16 scales, `d[c]`; `m`: 16 f16 minima or K-quant `dmin`;
//! - `sc` (K-quants): 16 groups × 16 columns of one byte, `sc[g·16 + c]` (Q4_K / Q5_K: the 8
//!   scales then the 8 minima of the 32-value sub-blocks; Q6_K, Q3_K, Q2_K: the scale of each
//!   16 values, Q3_K's less 32);
//! - for each 32-value sub-block `s` of the record, the quants `q` (unsigned: GGML's offsets,
//!   −8, −16, −32, −4, are applied by the kernels), cut into 8 groups of 4 values `4g..4g+4`,
//!   each group laid out as 16 columns × 4 bytes `(c, t)`, the operand of one `vpdpbusd`:
//!   - `nib` (4-bit low parts): 4 × 64 bytes, byte `(v, c, t)` = `q[4v+t] | q[16+4v+t] << 4`;
//!   - `two` (2-bit parts: Q6_K's high bits, Q3_K's and Q2_K's low bits): 2 × 64 bytes, bits
//!     `2j..2j+2` of byte `(u, c, t)` = the part of `q[4(4u+j)+t]`;
//!   - `bits` (one high bit: Q5_*'s 16s, Q3_K's 4s): 8 × u64, bit `4c+t` of word `g` = the bit of `q[4g+t]`;
//!   - `q8` (Q8_0's i8 quants): 8 × 64 bytes, byte `(g, c, t)` = `q[4g+t]`.

use super::QuantType;

/// Output columns per tile.
pub(crate) const TN: usize = 16;

/// Byte offsets of the fields of one super-block record of a tile (`NONE` where absent).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// Values per super-block along `k`.
    pub(crate) sb: usize,
    /// 32-value sub-blocks per super-block.
    pub(crate) subs: usize,
    pub(crate) m: usize,
    pub(crate) sc: usize,
    pub(crate) nib: usize,
    pub(crate) two: usize,
    pub(crate) bits: usize,
    pub(crate) q8: usize,
    /// Bytes of one record (16 columns, one super-block).
    pub(crate) bytes: usize,
}

/// The offset of an absent field.
pub(crate) const NONE: usize = usize::MAX;

const D: usize = 2 * TN;
const SC: usize = TN * TN;
const NIB: usize = 4 * 64;
const TWO: usize = 2 * 64;
const BITS: usize = 8 * 8;
const Q8: usize = 8 * 64;

/// The record layout of a type; `d` is always at 0.
pub(crate) const fn layout(q: QuantType) -> Layout {
    let base = Layout { sb: 32, subs: 1, m: NONE, sc: NONE, nib: NONE, two: NONE, bits: NONE, q8: NONE, bytes: 0 };
    match q {
        QuantType::Q4_0 => Layout { nib: D, bytes: D + NIB, ..base },
        QuantType::Q4_1 => Layout { m: D, nib: 2 * D, bytes: 2 * D + NIB, ..base },
        QuantType::Q5_0 => Layout { bits: D, nib: D + BITS, bytes: D + BITS + NIB, ..base },
        QuantType::Q5_1 => Layout { m: D, bits: 2 * D, nib: 2 * D + BITS, bytes: 2 * D + BITS + NIB, ..base },
        QuantType::Q8_0 => Layout { q8: D, bytes: D + Q8, ..base },
        QuantType::Q2K => {
            Layout { sb: 256, subs: 8, m: D, sc: 2 * D, two: 2 * D + SC, bytes: 2 * D + SC + 8 * TWO, ..base }
        }
        QuantType::Q3K => Layout {
            sb: 256,
            subs: 8,
            sc: D,
            bits: D + SC,
            two: D + SC + 8 * BITS,
            bytes: D + SC + 8 * BITS + 8 * TWO,
            ..base
        },
        QuantType::Q4K => {
            Layout { sb: 256, subs: 8, m: D, sc: 2 * D, nib: 2 * D + SC, bytes: 2 * D + SC + 8 * NIB, ..base }
        }
        QuantType::Q5K => Layout {
            sb: 256,
            subs: 8,
            m: D,
            sc: 2 * D,
            bits: 2 * D + SC,
            nib: 2 * D + SC + 8 * BITS,
            bytes: 2 * D + SC + 8 * BITS + 8 * NIB,
            ..base
        },
        QuantType::Q6K => Layout {
            sb: 256,
            subs: 8,
            sc: D,
            two: D + SC,
            nib: D + SC + 8 * TWO,
            bytes: D + SC + 8 * TWO + 8 * NIB,
            ..base
        },
    }
}

/// One column's super-block as integers: what a GGML block says, before any float arithmetic.
#[derive(Clone, Debug)]
pub(crate) struct Parts {
    /// f16 bits of `d`.
    pub(crate) d: u16,
    /// f16 bits of `m` / `dmin`.
    pub(crate) m: u16,
    /// The per-group scale bytes, as laid out in `sc`.
    pub(crate) sc: [u8; 16],
    /// The unsigned quants (Q8_0: the i8 bits).
    pub(crate) q: [u8; 256],
}

impl Parts {
    const ZERO: Parts = Parts { d: 0, m: 0, sc: [0; 16], q: [0; 256] };
}

fn f16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// GGML's unpacking of the 6-bit scale and minimum `j` of a Q4_K / Q5_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// GGML's unpacking of Q3_K's sixteen 6-bit scales (0..=63).
fn scales_q3k(s: &[u8]) -> [u8; 16] {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    let aux = [
        (a0 & K2) | ((tmp & K1) << 4),
        (a1 & K2) | (((tmp >> 2) & K1) << 4),
        ((a0 >> 4) & K2) | (((tmp >> 4) & K1) << 4),
        ((a1 >> 4) & K2) | (((tmp >> 6) & K1) << 4),
    ];
    let mut out = [0u8; 16];
    for (i, a) in aux.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&a.to_le_bytes());
    }
    out
}

/// The integer parts of one GGML block (`b` is exactly `q.block_bytes()` long).
pub(crate) fn ggml_parts(qt: QuantType, b: &[u8]) -> Parts {
    let mut p = Parts::ZERO;
    match qt {
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let at = if qt == QuantType::Q4_1 { 4 } else { 2 };
            for j in 0..16 {
                p.q[j] = b[at + j] & 15;
                p.q[j + 16] = b[at + j] >> 4;
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let at = if qt == QuantType::Q5_1 { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            for j in 0..16 {
                p.q[j] = (b[at + 4 + j] & 15) | ((((qh >> j) & 1) as u8) << 4);
                p.q[j + 16] = (b[at + 4 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
        }
        QuantType::Q8_0 => p.q[..32].copy_from_slice(&b[2..34]),
        QuantType::Q2K => {
            p.sc.copy_from_slice(&b[..16]);
            for e in 0..256 {
                p.q[e] = (b[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            }
        }
        QuantType::Q3K => {
            for (o, s) in p.sc.iter_mut().zip(scales_q3k(&b[96..108])) {
                *o = (s as i8 - 32) as u8;
            }
            for e in 0..256 {
                let (n, j, l) = (e / 128, (e % 128) / 32, e % 32);
                let low = (b[32 + 32 * n + l] >> (2 * j)) & 3;
                let high = (b[l] >> (4 * n + j)) & 1;
                p.q[e] = low | (high << 2);
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            let five = qt == QuantType::Q5K;
            let qs = if five { 48 } else { 16 };
            for s in 0..8 {
                (p.sc[s], p.sc[8 + s]) = scale_min_k4(s, &b[4..16]);
            }
            for e in 0..256 {
                let (j, half, l) = (e / 64, (e % 64) / 32, e % 32);
                let mut v = (b[qs + 32 * j + l] >> (4 * half)) & 15;
                if five {
                    v |= ((b[16 + l] >> (2 * j + half)) & 1) << 4;
                }
                p.q[e] = v;
            }
        }
        QuantType::Q6K => {
            p.sc.copy_from_slice(&b[192..208]);
            for e in 0..256 {
                let (idx, a, l) = (e / 128, (e % 128) / 32, e % 32);
                let ql = b[64 * idx + l + 32 * (a % 2)];
                let low = if a < 2 { ql & 15 } else { ql >> 4 };
                let high = (b[128 + 32 * idx + l] >> (2 * a)) & 3;
                p.q[e] = low | (high << 4);
            }
        }
    }
    (p.d, p.m) = match qt {
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => (f16_at(b, 0), f16_at(b, 2)),
        QuantType::Q2K => (f16_at(b, 80), f16_at(b, 82)),
        QuantType::Q3K => (f16_at(b, 108), 0),
        QuantType::Q6K => (f16_at(b, 208), 0),
        _ => (f16_at(b, 0), 0),
    };
    p
}

/// Byte `(c, t)` of the group vector at `base` (16 columns × 4 values).
fn at(base: usize, c: usize, t: usize) -> usize {
    base + 4 * c + t
}

/// Writes column `c`'s parts into one record `r` (`layout(qt).bytes` long).
pub(crate) fn write_parts(qt: QuantType, r: &mut [u8], c: usize, p: &Parts) {
    let l = layout(qt);
    r[2 * c..2 * c + 2].copy_from_slice(&p.d.to_le_bytes());
    if l.m != NONE {
        r[l.m + 2 * c..l.m + 2 * c + 2].copy_from_slice(&p.m.to_le_bytes());
    }
    if l.sc != NONE {
        for g in 0..16 {
            r[l.sc + 16 * g + c] = p.sc[g];
        }
    }
    for s in 0..l.subs {
        let q = &p.q[32 * s..32 * s + 32];
        for g in 0..8 {
            for t in 0..4 {
                let v = q[4 * g + t];
                if l.q8 != NONE {
                    r[at(l.q8 + 64 * g, c, t)] = v;
                }
                if l.nib != NONE {
                    let i = at(l.nib + 256 * s + 64 * (g % 4), c, t);
                    r[i] |= (v & 15) << (4 * (g / 4));
                }
                if l.two != NONE {
                    // Q6_K keeps its high 2 bits here, Q3_K and Q2_K their low 2 bits.
                    let part = if qt == QuantType::Q6K { v >> 4 } else { v & 3 };
                    r[at(l.two + 128 * s + 64 * (g / 4), c, t)] |= (part & 3) << (2 * (g % 4));
                }
                if l.bits != NONE {
                    let bit = if qt == QuantType::Q3K { (v >> 2) & 1 } else { (v >> 4) & 1 };
                    r[l.bits + 64 * s + 8 * g + (4 * c + t) / 8] |= bit << ((4 * c + t) % 8);
                }
            }
        }
    }
}

/// Reads column `c`'s parts back from one record.
pub(crate) fn read_parts(qt: QuantType, r: &[u8], c: usize) -> Parts {
    let l = layout(qt);
    let mut p = Parts::ZERO;
    p.d = f16_at(r, 2 * c);
    if l.m != NONE {
        p.m = f16_at(r, l.m + 2 * c);
    }
    if l.sc != NONE {
        for g in 0..16 {
            p.sc[g] = r[l.sc + 16 * g + c];
        }
    }
    for s in 0..l.subs {
        for g in 0..8 {
            for t in 0..4 {
                let mut v = 0u8;
                if l.q8 != NONE {
                    v = r[at(l.q8 + 64 * g, c, t)];
                }
                if l.nib != NONE {
                    v |= (r[at(l.nib + 256 * s + 64 * (g % 4), c, t)] >> (4 * (g / 4))) & 15;
                }
                if l.two != NONE {
                    let part = (r[at(l.two + 128 * s + 64 * (g / 4), c, t)] >> (2 * (g % 4))) & 3;
                    v |= if qt == QuantType::Q6K { part << 4 } else { part };
                }
                if l.bits != NONE {
                    let bit = (r[l.bits + 64 * s + 8 * g + (4 * c + t) / 8] >> ((4 * c + t) % 8)) & 1;
                    v |= if qt == QuantType::Q3K { bit << 2 } else { bit << 4 };
                }
                p.q[32 * s + 4 * g + t] = v;
            }
        }
    }
    p
}
