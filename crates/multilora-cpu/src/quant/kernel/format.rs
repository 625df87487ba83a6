//! Each weight type as the kernel sees it ([`Format`]): how one 32-value sub-block of a tile
//! record becomes 8 vectors of unsigned quants (one per group of 4 values) and the f32 scale
//! vectors its [`Kind`] of epilogue needs. Every scale vector here is exact (an f16 times an
//! integer of at most 8 bits), so the f32 arithmetic the epilogue does on it is the only rounding.

use super::simd::DotSimd;
use crate::quant::QuantType;
use crate::quant::layout::{Layout, NONE, layout};

/// How a sub-block's integer sums become f32, per column (`D`: the activation block's scale,
/// `S` / `SA`: its quants' sum over 32 / over the first 16; `a`, `b`, `c`, `e`: [`Format::sub`]'s
/// scale vectors; `I` the integer dot product, `IA` / `IB` over the first / last 16 values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// `acc += float(I − off·S) · (a·D)`: a scale and an offset (`d · (q − off)`).
    Sym(i32),
    /// `acc += float(I) · (a·D); acc += b · (D·S)`: a scale and a minimum (`d · q + m`).
    Min,
    /// `t = float(IA − off·SA) · a; t += float(IB − off·(S − SA)) · b; acc += t · D`: one scale
    /// per 16 values and an offset.
    Split(i32),
    /// As `Split(0)`, then `acc += c · (D·SA); acc += e · (D·(S − SA))`: scales and minima per 16.
    SplitMin,
}

/// One weight type.
pub(super) trait Format {
    const L: Layout;
    const KIND: Kind;
    /// The largest unsigned quant.
    const MAXW: i32;
    /// Whether the quants are signed bytes (Q8_0).
    const SIGNED: bool = false;

    /// The super-block's `d` and `m` (`d` again where there is no `m`) for the columns from `c0`.
    ///
    /// # Safety
    /// `r` is a whole record, `c0 + S::LANES <= 16`, and `S`'s instruction set is available.
    #[inline(always)]
    unsafe fn sb<S: DotSimd>(r: *const u8, c0: usize) -> [S::F; 2] {
        // SAFETY: `d` and `m` hold 16 f16 each inside the record; the caller keeps `c0` in range.
        unsafe {
            let d = S::load_f16(r.add(2 * c0));
            let m = if Self::L.m == NONE { d } else { S::load_f16(r.add(Self::L.m + 2 * c0)) };
            [d, m]
        }
    }

    /// Sub-block `s`'s 8 group vectors (groups 0–3: values 0–15) and its scale vectors.
    ///
    /// # Safety
    /// As for [`Format::sb`], with `s < L.subs`.
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, s: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]);
}

/// The 8 groups of a nibble plane: low nibbles groups 0–3, high nibbles 4–7.
///
/// # Safety
/// `p` is the plane's sub-block plus `4 · c0`, with 4 × 64 bytes from the plane's start readable.
#[inline(always)]
unsafe fn nibbles<S: DotSimd>(p: *const u8) -> [S::W; 8] {
    // SAFETY: forwarded from the caller: vectors `v < 4` of the plane.
    unsafe {
        let v = [S::load_w(p), S::load_w(p.add(64)), S::load_w(p.add(128)), S::load_w(p.add(192))];
        [
            S::nib_lo(v[0]),
            S::nib_lo(v[1]),
            S::nib_lo(v[2]),
            S::nib_lo(v[3]),
            S::nib_hi(v[0]),
            S::nib_hi(v[1]),
            S::nib_hi(v[2]),
            S::nib_hi(v[3]),
        ]
    }
}

/// Adds `add` to the bytes of every group whose bit is set in the sub-block's bit plane `bits`
/// (the plane's sub-block start; the columns from `c0`).
///
/// # Safety
/// `bits .. bits + 64` readable.
#[inline(always)]
unsafe fn high_bits<S: DotSimd>(w: &mut [S::W; 8], bits: *const u8, c0: usize, add: i8) {
    for (g, v) in w.iter_mut().enumerate() {
        // SAFETY: word `g < 8` of the plane, from bit `4 · c0`.
        *v = unsafe { S::add_bits(*v, bits.add(8 * g + c0 / 2), add) };
    }
}

/// The scales of 16 groups laid out `sc[g · 16 + c]`, groups `g` and `g + 1`, as f32 (`signed`:
/// sign-extended bytes).
///
/// # Safety
/// `sc` is the record's scale field; `g + 1 < 16`.
#[inline(always)]
unsafe fn scale_pair<S: DotSimd>(sc: *const u8, g: usize, c0: usize, signed: bool) -> [S::I; 2] {
    // SAFETY: bytes `16g + c0 ..+ LANES` and the next group's, inside the 256-byte field.
    unsafe {
        let (a, b) = (sc.add(16 * g + c0), sc.add(16 * (g + 1) + c0));
        if signed { [S::load_i8(a), S::load_i8(b)] } else { [S::load_u8(a), S::load_u8(b)] }
    }
}

/// A marker type per weight type, with its record layout.
macro_rules! format_type {
    ($name:ident, $q:expr) => {
        #[derive(Clone, Copy, Debug)]
        #[allow(non_camel_case_types)]
        pub(super) struct $name;
        impl $name {
            const LAYOUT: Layout = layout($q);
        }
    };
}

format_type!(Q4_0, QuantType::Q4_0);
format_type!(Q4_1, QuantType::Q4_1);
format_type!(Q5_0, QuantType::Q5_0);
format_type!(Q5_1, QuantType::Q5_1);
format_type!(Q8_0, QuantType::Q8_0);
format_type!(Q2K, QuantType::Q2K);
format_type!(Q3K, QuantType::Q3K);
format_type!(Q4K, QuantType::Q4K);
format_type!(Q5K, QuantType::Q5K);
format_type!(Q6K, QuantType::Q6K);

impl Format for Q4_0 {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Sym(8);
    const MAXW: i32 = 15;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, _: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: the nibble plane of the record's one sub-block.
        (unsafe { nibbles::<S>(r.add(Self::L.nib + 4 * c0)) }, [sb[0]; 4])
    }
}

impl Format for Q4_1 {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Min;
    const MAXW: i32 = 15;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, _: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: the nibble plane of the record's one sub-block.
        (unsafe { nibbles::<S>(r.add(Self::L.nib + 4 * c0)) }, [sb[0], sb[1], sb[0], sb[0]])
    }
}

impl Format for Q5_0 {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Sym(16);
    const MAXW: i32 = 31;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, _: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: the nibble and bit planes of the record's one sub-block.
        unsafe {
            let mut w = nibbles::<S>(r.add(Self::L.nib + 4 * c0));
            high_bits::<S>(&mut w, r.add(Self::L.bits), c0, 16);
            (w, [sb[0]; 4])
        }
    }
}

impl Format for Q5_1 {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Min;
    const MAXW: i32 = 31;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, _: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: the nibble and bit planes of the record's one sub-block.
        unsafe {
            let mut w = nibbles::<S>(r.add(Self::L.nib + 4 * c0));
            high_bits::<S>(&mut w, r.add(Self::L.bits), c0, 16);
            (w, [sb[0], sb[1], sb[0], sb[0]])
        }
    }
}

impl Format for Q8_0 {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Sym(0);
    const MAXW: i32 = 127;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, _: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        let p = Self::L.q8 + 4 * c0;
        // SAFETY: the 8 group vectors of the quant field.
        let w = std::array::from_fn(|g| unsafe { S::prep_i8(S::load_w(r.add(p + 64 * g))) });
        (w, [sb[0]; 4])
    }
}

impl Format for Q4K {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Min;
    const MAXW: i32 = 15;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, s: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: sub-block `s < 8` of the nibble plane; its scale `s` and minimum `8 + s`.
        unsafe {
            let w = nibbles::<S>(r.add(Self::L.nib + 256 * s + 4 * c0));
            let sc = r.add(Self::L.sc);
            let d = S::mul(sb[0], S::cvt(S::load_u8(sc.add(16 * s + c0))));
            let m = S::neg(S::mul(sb[1], S::cvt(S::load_u8(sc.add(16 * (8 + s) + c0)))));
            (w, [d, m, d, d])
        }
    }
}

impl Format for Q5K {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Min;
    const MAXW: i32 = 31;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, s: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: as for Q4_K, and sub-block `s` of the bit plane.
        unsafe {
            let mut w = nibbles::<S>(r.add(Self::L.nib + 256 * s + 4 * c0));
            high_bits::<S>(&mut w, r.add(Self::L.bits + 64 * s), c0, 16);
            let sc = r.add(Self::L.sc);
            let d = S::mul(sb[0], S::cvt(S::load_u8(sc.add(16 * s + c0))));
            let m = S::neg(S::mul(sb[1], S::cvt(S::load_u8(sc.add(16 * (8 + s) + c0)))));
            (w, [d, m, d, d])
        }
    }
}

impl Format for Q6K {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Split(32);
    const MAXW: i32 = 63;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, s: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: sub-block `s < 8` of the nibble and 2-bit planes; scales `2s`, `2s + 1`.
        unsafe {
            let lo = nibbles::<S>(r.add(Self::L.nib + 256 * s + 4 * c0));
            let two = r.add(Self::L.two + 128 * s + 4 * c0);
            let hi = [S::load_w(two), S::load_w(two.add(64))];
            let w = std::array::from_fn(|g| S::or_crumb_hi(lo[g], hi[g / 4], g % 4));
            let [a, b] = scale_pair::<S>(r.add(Self::L.sc), 2 * s, c0, true);
            (w, [S::mul(sb[0], S::cvt(a)), S::mul(sb[0], S::cvt(b)), sb[0], sb[0]])
        }
    }
}

impl Format for Q3K {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::Split(4);
    const MAXW: i32 = 7;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, s: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: sub-block `s < 8` of the 2-bit and bit planes; scales `2s`, `2s + 1`.
        unsafe {
            let two = r.add(Self::L.two + 128 * s + 4 * c0);
            let v = [S::load_w(two), S::load_w(two.add(64))];
            let mut w = std::array::from_fn(|g| S::crumb(v[g / 4], g % 4));
            high_bits::<S>(&mut w, r.add(Self::L.bits + 64 * s), c0, 4);
            let [a, b] = scale_pair::<S>(r.add(Self::L.sc), 2 * s, c0, true);
            (w, [S::mul(sb[0], S::cvt(a)), S::mul(sb[0], S::cvt(b)), sb[0], sb[0]])
        }
    }
}

impl Format for Q2K {
    const L: Layout = Self::LAYOUT;
    const KIND: Kind = Kind::SplitMin;
    const MAXW: i32 = 3;
    #[inline(always)]
    unsafe fn sub<S: DotSimd>(r: *const u8, c0: usize, s: usize, sb: &[S::F; 2]) -> ([S::W; 8], [S::F; 4]) {
        // SAFETY: sub-block `s < 8` of the 2-bit plane; scale bytes `2s`, `2s + 1`.
        unsafe {
            let two = r.add(Self::L.two + 128 * s + 4 * c0);
            let v = [S::load_w(two), S::load_w(two.add(64))];
            let w = std::array::from_fn(|g| S::crumb(v[g / 4], g % 4));
            let [a, b] = scale_pair::<S>(r.add(Self::L.sc), 2 * s, c0, false);
            let (d, m) = (sb[0], sb[1]);
            let scale = |v| S::mul(d, S::cvt(S::lo4(v)));
            let min = |v| S::neg(S::mul(m, S::cvt(S::hi4(v))));
            (w, [scale(a), scale(b), min(a), min(b)])
        }
    }
}
