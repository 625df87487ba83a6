//! The kernel body, generic over the instruction set ([`DotSimd`]) and the weight type
//! ([`Format`]): a row tile of up to `S::RM` rows against `S::LANES` columns of one weight tile,
//! the whole of `k` in one pass. For each 32-value block, in order along `k`: the weight
//! sub-block is decoded once into 8 vectors of quants (one per group of 4 values), each row's
//! exact integer dot product with the block's activation quants is taken (`vpdpbusd`, or
//! `vpmaddubsw` + `vpmaddwd`), and the block's epilogue ([`Kind`]) scales it into the row's f32
//! accumulator. A column's output is thus the same chain of f32 operations, block by block,
//! whatever the tile, the row tile or the thread it falls in.

use super::act::{BLOCK, LO, Meta, PANEL};
use super::format::{Format, Kind};
use super::simd::DotSimd;

/// Each of `R` rows' integer dot product of the decoded weight groups `w` with its block's
/// combined quants `254 · hi + lo` (`x[r]`: the row's `hi`; its `lo` is [`LO`] bytes on), exact in
/// i32 (at most 32 · 255 · 32,385 in magnitude).
///
/// # Safety
/// As for [`DotSimd::dot_rows`], for both planes.
#[inline(always)]
unsafe fn dot_planes<S: DotSimd, const R: usize>(w: &[S::W], x: [*const i8; R], maxw: i32, signed: bool) -> [S::I; R] {
    // SAFETY: forwarded from the caller.
    unsafe {
        let hi = S::dot_rows::<R>(w, x, maxw, signed);
        let lo = S::dot_rows::<R>(w, x.map(|p| p.add(LO)), maxw, signed);
        std::array::from_fn(|r| S::combine(hi[r], lo[r]))
    }
}

/// Which values of a block an integer dot product covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    /// All 32.
    All,
    /// The first 16 (groups 0–3).
    First,
    /// The last 16 (groups 4–7).
    Last,
}

/// Where a block's exact integer dot products come from, each row's `254 · hi + lo` over a
/// [`Part`]: the set's own instructions on the decoded weight groups ([`Decoded`]), or the tile
/// unit's results (`amx`). The sums are exact either way, so the epilogue that scales them
/// ([`block`]) gives the same bits whichever computed them.
pub(super) trait Dots<S: DotSimd, const R: usize> {
    /// # Safety
    /// What the source's maker vouched for, and `S`'s instruction set is available.
    unsafe fn dots<F: Format>(&self, part: Part) -> [S::I; R];
}

/// A block's decoded weight groups and `R` rows' activation quants (`x[r]`: the row's `hi`).
pub(super) struct Decoded<'a, S: DotSimd, const R: usize> {
    pub(super) w: &'a [S::W; 8],
    pub(super) x: [*const i8; R],
}

impl<S: DotSimd, const R: usize> Dots<S, R> for Decoded<'_, S, R> {
    #[inline(always)]
    unsafe fn dots<F: Format>(&self, part: Part) -> [S::I; R] {
        // SAFETY: each `x[r]` reaches its row's 32 quants of both planes (the maker); the halves
        // read 16 of them, from the start or the 16th.
        unsafe {
            match part {
                Part::All => dot_planes::<S, R>(self.w, self.x, F::MAXW, F::SIGNED),
                Part::First => dot_planes::<S, R>(&self.w[..4], self.x, F::MAXW, F::SIGNED),
                Part::Last => dot_planes::<S, R>(&self.w[4..], self.x.map(|p| p.add(16)), F::MAXW, F::SIGNED),
            }
        }
    }
}

/// One block's contribution to each of `R` rows' accumulators: the rows' integer dot products
/// first (all of them, for the instruction scheduler), then each row's epilogue, its scales
/// broadcast straight from the block's [`Meta`].
///
/// # Safety
/// `dots` can be read (its maker's conditions), `mt` is the block's [`Meta`], `slot + R <=
/// PANEL`, and `S`'s instruction set is available.
#[inline(always)]
pub(super) unsafe fn block<S: DotSimd, F: Format, const R: usize>(
    acc: &mut [S::F; R],
    dots: &impl Dots<S, R>,
    sc: &[S::F; 4],
    mt: *const Meta,
    slot: usize,
) {
    // SAFETY: `*mt` is readable (the caller) and rows `slot + r` are inside its fields; the dot
    // products are the source's.
    unsafe {
        let fp = |field: *const f32, r: usize| field.add(slot + r);
        let ip = |field: *const i32, r: usize| field.add(slot + r);
        let m = &*mt;
        match F::KIND {
            Kind::Sym(off) => {
                let off = if F::SIGNED { S::I8_BIAS } else { off };
                let shift = off.trailing_zeros();
                debug_assert!(off == 0 || off == 1 << shift, "offsets are powers of two");
                let is = dots.dots::<F>(Part::All);
                for r in 0..R {
                    let v = if off != 0 { S::sub_at(is[r], ip(m.s.as_ptr(), r), shift) } else { is[r] };
                    acc[r] = S::fma(S::cvt(v), S::mul(sc[0], S::splat_at(fp(m.d.as_ptr(), r))), acc[r]);
                }
            }
            Kind::Min => {
                let is = dots.dots::<F>(Part::All);
                for r in 0..R {
                    acc[r] = S::fma(S::cvt(is[r]), S::mul(sc[0], S::splat_at(fp(m.d.as_ptr(), r))), acc[r]);
                    acc[r] = S::fma(sc[1], S::splat_at(fp(m.ds.as_ptr(), r)), acc[r]);
                }
            }
            Kind::Split(off) => {
                let shift = off.trailing_zeros();
                debug_assert!(off == 1 << shift, "offsets are powers of two");
                // Each half's sums become f32 as soon as they are ready, so that two sets of 8
                // sums, 8 accumulators and the weights are never live at once (the operations are
                // the same, in the same order, as one expression per row).
                let ia = dots.dots::<F>(Part::First);
                let mut t = [S::zero(); R];
                for r in 0..R {
                    t[r] = S::mul(S::cvt(S::sub_at(ia[r], ip(m.sa.as_ptr(), r), shift)), sc[0]);
                }
                let ib = dots.dots::<F>(Part::Last);
                for r in 0..R {
                    let t = S::fma(S::cvt(S::sub_at(ib[r], ip(m.sb.as_ptr(), r), shift)), sc[1], t[r]);
                    acc[r] = S::fma(t, S::splat_at(fp(m.d.as_ptr(), r)), acc[r]);
                }
            }
            Kind::SplitMin => {
                // As for `Split`, the first half folded in before the second is summed.
                let ia = dots.dots::<F>(Part::First);
                let mut t = [S::zero(); R];
                for r in 0..R {
                    t[r] = S::mul(S::cvt(ia[r]), sc[0]);
                }
                let ib = dots.dots::<F>(Part::Last);
                for r in 0..R {
                    let t = S::fma(S::cvt(ib[r]), sc[1], t[r]);
                    acc[r] = S::fma(t, S::splat_at(fp(m.d.as_ptr(), r)), acc[r]);
                    acc[r] = S::fma(sc[2], S::splat_at(fp(m.dsa.as_ptr(), r)), acc[r]);
                    acc[r] = S::fma(sc[3], S::splat_at(fp(m.dsb.as_ptr(), r)), acc[r]);
                }
            }
        }
    }
}

/// Where one row tile reads and writes.
#[derive(Clone, Copy, Debug)]
pub(super) struct RowTile {
    /// The weight tile's first record.
    pub(super) w: *const u8,
    /// Super-blocks along `k`.
    pub(super) nsb: usize,
    /// The tile's first column handled (0, or 8 for a 256-bit set's second half).
    pub(super) c0: usize,
    /// The first row's block-0 activation quants, its panel's block-0 [`Meta`] and its slot
    /// in the panel (`act::PANEL` rows; the tile's rows are the next ones of the same panel).
    pub(super) x: *const i8,
    pub(super) meta: *const Meta,
    pub(super) slot: usize,
    /// The first row's first output (`ldy` apart), of which `cols` are written.
    pub(super) y: *mut f32,
    pub(super) ldy: usize,
    pub(super) cols: usize,
    /// Lines ([`super::LINE`] bytes) from this address that the tile asks to be brought into the caches, spread over
    /// its blocks: what the caller reads after the product.
    pub(super) ahead: usize,
    pub(super) ahead_lines: usize,
}

/// Asks for the `len` bytes from `p` to be brought into the caches (no access: never faults).
#[inline(always)]
fn prefetch(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut o = 0;
        while o < len {
            // SAFETY: a prefetch hint reads nothing and cannot fault, whatever the address.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.wrapping_add(o).cast()) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// Asks for the line at `addr` to be brought into the caches, L1 and L2 (`prefetcht0`; no
/// access: never faults). Into L2 alone (`prefetcht1`), the 16-row LoRA step of
/// docs/BENCHMARKS.md measured 0.01–0.25 ms slower in each of ten alternating runs (Zen 5).
#[inline(always)]
fn prefetch_ahead(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch hint reads nothing and cannot fault, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// Asks for share `i` of `n` (as even as whole lines allow) of the `lines` cache lines from `addr`
/// ([`prefetch_ahead`]): a tile spreads what it was handed over its records.
#[inline(always)]
pub(super) fn prefetch_share((addr, lines): (usize, usize), i: usize, n: usize) {
    let per = lines.div_ceil(n.max(1));
    for l in (i * per).min(lines)..((i + 1) * per).min(lines) {
        prefetch_ahead(addr.wrapping_add(l * super::LINE));
    }
}

/// `RM` rows against `H · S::LANES` columns of one weight tile: `H` is 1, or 2 for both halves of
/// a 256-bit set's 16-column tile in one pass, so that each record is read once and the weight
/// stream never waits on a second pass over what is already cached (each half's outputs are the
/// same chain of operations either way).
///
/// # Safety
/// The tile holds `nsb` records; the `RM` rows are in one activation panel of `nsb · subs`
/// blocks; `RM` rows of `cols <= H · S::LANES` outputs are writable and nobody else's; `c0 + H ·
/// S::LANES <= 16`; `S`'s instruction set is available.
#[inline(always)]
pub(super) unsafe fn rows<S: DotSimd, F: Format, const RM: usize, const H: usize>(t: RowTile) {
    let subs = F::L.subs;
    // SAFETY: every access below stays inside what the caller vouched for.
    unsafe {
        let mut acc = [[S::zero(); RM]; H];
        for sb in 0..t.nsb {
            let r = t.w.add(sb * F::L.bytes);
            if S::PREFETCH > 0 {
                prefetch(r.wrapping_add(S::PREFETCH), F::L.bytes);
            }
            prefetch_share((t.ahead, t.ahead_lines), sb, t.nsb);
            let sbs: [_; H] = std::array::from_fn(|h| F::sb::<S>(r, t.c0 + h * S::LANES));
            for s in 0..subs {
                let b = sb * subs + s;
                let xb = t.x.add(BLOCK * b);
                for (h, acc) in acc.iter_mut().enumerate() {
                    let (w, sc) = F::sub::<S>(r, t.c0 + h * S::LANES, s, &sbs[h]);
                    let dots = Decoded::<S, RM> { w: &w, x: std::array::from_fn(|i| xb.add(32 * i)) };
                    block::<S, F, RM>(acc, &dots, &sc, t.meta.add(b), t.slot);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            let cols = t.cols.saturating_sub(h * S::LANES).min(S::LANES);
            for (i, a) in acc.iter().enumerate() {
                let y = t.y.add(i * t.ldy + h * S::LANES);
                if cols == S::LANES {
                    S::store(y, *a);
                } else {
                    let mut edge = [0f32; 16];
                    S::store(edge.as_mut_ptr(), *a);
                    std::ptr::copy_nonoverlapping(edge.as_ptr(), y, cols);
                }
            }
        }
    }
}

/// [`rows`] at a height picked at run time: the tallest of 8, 4, 2, 1 (2, 1 for both halves at
/// once: `H = 2`) that fits `left` rows, `S::RM` and what is left of the panel after the tile's
/// slot; returns it.
///
/// # Safety
/// As for [`rows`] with that many rows.
#[inline(always)]
pub(super) unsafe fn rows_any<S: DotSimd, F: Format, const H: usize>(left: usize, t: RowTile) -> usize {
    let top = if H == 1 { 8 } else { 2 };
    let h = [8, 4, 2, 1].into_iter().find(|&h| h <= top && h <= left && h <= S::RM && t.slot + h <= PANEL).unwrap_or(1);
    // SAFETY: forwarded from the caller, for `h <= left` rows.
    unsafe {
        match (h, H) {
            (8, 1) => rows::<S, F, 8, 1>(t),
            (4, 1) => rows::<S, F, 4, 1>(t),
            (2, _) => rows::<S, F, 2, H>(t),
            _ => rows::<S, F, 1, H>(t),
        }
    }
    h
}
