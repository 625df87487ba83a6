//! The quantized product of many rows on the AMX tile unit (AMX-TILE and AMX-INT8: Sapphire
//! Rapids and later Xeons): the same exact integer sums as the vector kernels, scaled by the same
//! epilogue ([`block`]), so every output is the same bits as on AVX-512 VNNI.
//!
//! For each weight tile of a job (16 output columns, the whole of `k`), every 32-value block is
//! decoded once into its 8 groups of quants (the `vpdpbusd` operand of the vector kernels, which
//! is also the tile unit's `B` layout: 8 rows of 16 columns × 4 bytes) and its scale vectors, in a
//! per-thread buffer. Then for each whole panel of 16 activation rows, block after block: the
//! panel's `hi` and `lo` quants of the block (16 rows × 32 bytes each, the activations' own layout,
//! [`super::act`]) are loaded as `A` tiles and `tdpbsud` (signed activations × unsigned weights,
//! i32 sums) gives each row's 16 column sums per plane, which are stored to a buffer and read
//! back as the [`Dots`] of the vector epilogue. The types with a scale per 16 values (Q6_K, Q3_K,
//! Q2_K) take each half of the block as its own product (`A`: 16 × 16 bytes, `B`: 4 rows). The
//! tile work runs `AHEAD` blocks ahead of the epilogue, through a ring of buffers (and, for whole
//! blocks, two sets of result tiles, even and odd blocks), so that the tile unit and the vector
//! units may overlap; measured, they overlap little (docs/BENCHMARKS.md): the tile unit's share
//! and the epilogue's add up.
//!
//! Rows outside whole panels run the AVX-512 VNNI kernel; so do whole products of a decode
//! step's size (`QuantMatrix::product` runs them on AVX-512 VNNI: there reading the weight is the
//! cost, and in a whole SmolLM2 decode step the tile unit made 16-row steps 3–5% slower and 64-row
//! ones no faster). The tile state is configured at
//! the start of a job and released at its end (a guard, also on unwinding), so a thread holds it
//! only while it multiplies.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::act::{Act, BLOCK, LO, Meta, PANEL};
use super::format::{Format, Kind, Q2K, Q3K, Q4_0, Q4_1, Q4K, Q5_0, Q5_1, Q5K, Q6K, Q8_0};
use super::simd::DotSimd;
use super::tile::{Dots, Part, block};
use super::{Ahead, Job, Out, Seg, TN, tile_rows};
use crate::isa::Avx512Vnni as S;
use crate::quant::QuantType;

/// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) and the operating
/// system lets this process use the tile state: asked once, the answer kept. Linux enables the
/// tile data in `XCR0` but faults its first use unless the process asked for it with
/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, which fails where the kernel is older
/// than 5.16, the feature is off, or a thread's signal stack is too small for the state.
pub(crate) fn granted() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| {
        let leaf7 = __cpuid_count(7, 0);
        let cpu = leaf7.edx & (1 << 24) != 0 && leaf7.edx & (1 << 25) != 0;
        cpu && request_tile_state()
    })
}

/// Asks Linux for this process's leave to use the AMX tile data.
#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request about this process's extended state; it changes no memory of ours, and
    // its only effect is the leave (or not) to use the tile registers.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// The tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): each tile's rows and bytes
/// per row.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    /// Whole blocks: `tmm0`, `tmm1` the `hi` and `lo` activations (16 rows × 32 bytes), `tmm2` the
    /// weights (8 rows × 64 bytes), `tmm3`, `tmm4` their sums (16 rows × 16 i32); odd blocks the
    /// weights `tmm7` and the sums `tmm5`, `tmm6`. Halves (`split`):
    /// the activations 16 × 16 bytes, the halves' weights `tmm2` and `tmm5` (4 rows × 64 bytes), the
    /// sums `tmm3`, `tmm4` (first half) and `tmm6`, `tmm7` (last).
    fn new(split: bool) -> Config {
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        let (x_bytes, w_rows) = if split { (16, 4) } else { (32, 8) };
        let mut set = |t: usize, rows: u8, bytes: u16| (c.rows[t], c.colsb[t]) = (rows, bytes);
        set(0, PANEL as u8, x_bytes);
        set(1, PANEL as u8, x_bytes);
        set(2, w_rows, 64);
        set(3, PANEL as u8, 64);
        set(4, PANEL as u8, 64);
        set(5, if split { w_rows } else { PANEL as u8 }, 64);
        set(6, PANEL as u8, 64);
        set(7, if split { PANEL as u8 } else { w_rows }, 64);
        c
    }
}

/// The tile state, configured while it lives and released when it drops.
struct Tiles;

impl Tiles {
    /// # Safety
    /// AMX-TILE is available and the process has the system's leave ([`granted`]).
    unsafe fn configure(split: bool) -> Tiles {
        let cfg = Config::new(split);
        // SAFETY: a valid palette-1 configuration (rows ≤ 16, bytes ≤ 64 a row) read from
        // memory the call owns; AMX is available (the caller).
        unsafe { asm!("ldtilecfg [{}]", in(reg) &raw const cfg, options(nostack, readonly)) };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: only made by `configure`, so AMX is available; releasing the state touches no
        // memory.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// One block of a weight tile as the tile unit reads it: its 8 groups of quants (`B`: row `g`
/// is group `g`, 16 columns × 4 bytes) and the epilogue's 4 scale vectors.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Decoded {
    w: [[u8; 64]; 8],
    sc: [[f32; 16]; 4],
}

const EMPTY: Decoded = Decoded { w: [[0; 64]; 8], sc: [[0.0; 16]; 4] };

thread_local! {
    /// Each thread's decoded weight tile, kept from job to job.
    static DECODED: RefCell<Vec<Decoded>> = const { RefCell::new(Vec::new()) };
}

/// The sums of one block for a panel: `hi` then `lo` rows of the whole block or its first
/// half, then (halves) the last half's `hi` and `lo` rows.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Sums([[i32; 16]; 4 * PANEL]);

/// How many blocks ahead of the epilogue the tile unit works, and the buffers that takes.
const AHEAD: usize = 2;
const RING: usize = 4;

/// Half a panel's sums of a block as the epilogue reads them: the [`Sums`] and the first of its
/// [`HALF`] rows.
struct Stored(*const [i32; 16], usize);

/// Rows of a panel one epilogue call scales: 8 accumulators and 8 sums live at once, with the
/// other half's accumulators, within the 32 vector registers.
const HALF: usize = PANEL / 2;

impl Dots<S, HALF> for Stored {
    #[inline(always)]
    unsafe fn dots<F: Format>(&self, part: Part) -> [__m512i; HALF] {
        let at = self.1 + if part == Part::Last { 2 * PANEL } else { 0 };
        // Loops rather than `array::from_fn`: a closure would not inherit the caller's
        // instruction sets, and the intrinsics in it would not be inlined.
        // SAFETY: rows of one `Sums`, 64-byte aligned (the maker); AVX-512F.
        unsafe {
            let mut sums = [_mm512_setzero_si512(); HALF];
            for (r, v) in sums.iter_mut().enumerate() {
                let hi = _mm512_load_si512(self.0.add(at + r).cast());
                let lo = _mm512_load_si512(self.0.add(at + PANEL + r).cast());
                *v = S::combine(hi, lo);
            }
            sums
        }
    }
}

/// The tile unit's sums of a whole block (see [`sums`]) through the sum tiles `$hi`, `$lo` and
/// the weight tile `$w`.
macro_rules! whole_block {
    ($x:expr, $w:expr, $c:expr, $hi:literal, $lo:literal, $wt:literal) => {
        asm!(
            concat!("tilezero ", $hi),
            concat!("tilezero ", $lo),
            "tileloadd tmm0, [{x} + {s32}]",
            "tileloadd tmm1, [{xl} + {s32}]",
            concat!("tileloadd ", $wt, ", [{w} + {s64}]"),
            concat!("tdpbsud ", $hi, ", tmm0, ", $wt),
            concat!("tdpbsud ", $lo, ", tmm1, ", $wt),
            concat!("tilestored [{c} + {s64}], ", $hi),
            concat!("tilestored [{c} + {s64} + {p1}], ", $lo),
            x = in(reg) $x,
            xl = in(reg) $x.add(LO),
            w = in(reg) $w,
            c = in(reg) $c,
            s32 = in(reg) 32usize,
            s64 = in(reg) 64usize,
            p1 = const 64 * PANEL,
            options(nostack),
        )
    };
}

/// The tile unit's sums of a panel's block `x` (its `hi` quants; `lo` [`LO`] bytes on, rows 32
/// bytes apart) with the decoded weights `w`, into `c` (`odd`: whole blocks through the second
/// set of tiles).
///
/// # Safety
/// The tiles are configured for `split`; `x` reaches the panel's block, `w` one [`Decoded`], `c`
/// the rows of a [`Sums`] it writes (2 · PANEL, or 4 · PANEL for halves).
#[inline(always)]
unsafe fn sums(split: bool, odd: bool, x: *const i8, w: *const u8, c: *mut [i32; 16]) {
    // SAFETY: every load reads the panel's rows, at most 32 bytes each, 32 apart, from its block
    // (or at most 8 rows of 64 bytes of `w`), and every store the panel's rows of 64 bytes into
    // `c` (the caller).
    unsafe {
        if split {
            asm!(
                "tilezero tmm3",
                "tilezero tmm4",
                "tilezero tmm6",
                "tilezero tmm7",
                "tileloadd tmm0, [{x} + {s32}]",
                "tileloadd tmm1, [{xl} + {s32}]",
                "tileloadd tmm2, [{w} + {s64}]",
                "tdpbsud tmm3, tmm0, tmm2",
                "tdpbsud tmm4, tmm1, tmm2",
                "tileloadd tmm0, [{x} + {s32} + 16]",
                "tileloadd tmm1, [{xl} + {s32} + 16]",
                "tileloadd tmm5, [{w} + {s64} + 256]",
                "tdpbsud tmm6, tmm0, tmm5",
                "tdpbsud tmm7, tmm1, tmm5",
                "tilestored [{c} + {s64}], tmm3",
                "tilestored [{c} + {s64} + {p1}], tmm4",
                "tilestored [{c} + {s64} + {p2}], tmm6",
                "tilestored [{c} + {s64} + {p3}], tmm7",
                x = in(reg) x,
                xl = in(reg) x.add(LO),
                w = in(reg) w,
                c = in(reg) c,
                s32 = in(reg) 32usize,
                s64 = in(reg) 64usize,
                p1 = const 64 * PANEL,
                p2 = const 128 * PANEL,
                p3 = const 192 * PANEL,
                options(nostack),
            );
        } else if odd {
            whole_block!(x, w, c, "tmm5", "tmm6", "tmm7");
        } else {
            whole_block!(x, w, c, "tmm3", "tmm4", "tmm2");
        }
    }
}

/// Tile `t` of the segment decoded into `out` (one [`Decoded`] a block).
///
/// # Safety
/// Tile `t` holds `nb` blocks of `F`; AVX-512 VNNI is available.
#[inline(always)]
unsafe fn decode<F: Format>(tile: *const u8, nb: usize, out: &mut Vec<Decoded>) {
    // Every field of every block is written below: sized, not cleared.
    out.resize(nb, EMPTY);
    out.truncate(nb);
    let subs = F::L.subs;
    // SAFETY: record `sb < nb / subs` of the tile, whole (the caller), all 16 columns.
    unsafe {
        for sb in 0..nb / subs {
            let r = tile.add(sb * F::L.bytes);
            let sbs = F::sb::<S>(r, 0);
            for s in 0..subs {
                let (w, sc) = F::sub::<S>(r, 0, s, &sbs);
                let d = &mut out[sb * subs + s];
                for (g, v) in w.iter().enumerate() {
                    _mm512_store_si512(d.w[g].as_mut_ptr().cast(), *v);
                }
                for (i, v) in sc.iter().enumerate() {
                    _mm512_store_ps(d.sc[i].as_mut_ptr(), *v);
                }
            }
        }
    }
}

/// One panel ([`PANEL`] rows from `x` and `meta`, its block-0 quants and [`Meta`]) against a
/// decoded tile, into its rows of `cols` outputs from `y` (`ldy` apart), through the ring of
/// buffers `bufs`.
///
/// # Safety
/// The tiles are configured for `F`; the panel has `w.len()` blocks; its rows of `cols <= 16`
/// outputs are writable and nobody else's; AVX-512 VNNI is available.
#[inline(always)]
unsafe fn panel<F: Format>(
    w: &[Decoded],
    bufs: &mut [Sums; RING],
    x: *const i8,
    meta: *const Meta,
    (y, ldy, cols): (*mut f32, usize, usize),
) {
    let split = matches!(F::KIND, Kind::Split(_) | Kind::SplitMin);
    // A ring of `RING` buffers, the tile unit `AHEAD` blocks ahead of the epilogue. Whole blocks
    // use half a `Sums` each, so the ring's buffers lie as close as they can.
    let step = if split { 4 * PANEL } else { 2 * PANEL };
    let base = bufs.as_mut_ptr().cast::<[i32; 16]>();
    let c = |b: usize| base.wrapping_add(step * (b % RING));
    // SAFETY: block `b < w.len()` of the panel, its decoded weights, and one of the ring's
    // buffers (the caller's conditions); the epilogue reads the buffer the tile unit wrote
    // `AHEAD` blocks before.
    unsafe {
        let mut acc = [[S::zero(); HALF]; 2];
        for (b, wb) in w.iter().enumerate().take(AHEAD) {
            sums(split, b % 2 == 1, x.add(BLOCK * b), wb.w.as_ptr().cast(), c(b));
        }
        for b in 0..w.len() {
            let a = b + AHEAD;
            if a < w.len() {
                sums(split, a % 2 == 1, x.add(BLOCK * a), w[a].w.as_ptr().cast(), c(a));
            }
            let d = &w[b].sc;
            let sc = [
                _mm512_load_ps(d[0].as_ptr()),
                _mm512_load_ps(d[1].as_ptr()),
                _mm512_load_ps(d[2].as_ptr()),
                _mm512_load_ps(d[3].as_ptr()),
            ];
            for (h, acc) in acc.iter_mut().enumerate() {
                block::<S, F, HALF>(acc, &Stored(c(b), h * HALF), &sc, meta.add(b), h * HALF);
            }
        }
        for (r, a) in acc.iter().flatten().enumerate() {
            let y = y.add(r * ldy);
            if cols == TN {
                S::store(y, *a);
            } else {
                let mut edge = [0f32; TN];
                S::store(edge.as_mut_ptr(), *a);
                std::ptr::copy_nonoverlapping(edge.as_ptr(), y, cols);
            }
        }
    }
}

/// One job of type `F`: each tile decoded once, then the job's whole panels on the tile unit and
/// its other rows on the vector kernel.
///
/// # Safety
/// As `run` checked: the job is inside the segment, the activations and the output, nobody else
/// writes its rectangle; AVX-512 VNNI and AMX are available with the system's leave.
#[inline(always)]
unsafe fn job_of<F: Format>(s: &Seg<'_>, act: &Act, out: Out, j: &Job, mut pf: Ahead<'_>) {
    let split = matches!(F::KIND, Kind::Split(_) | Kind::SplitMin);
    let nb = act.nb();
    let rec = nb / F::L.subs * F::L.bytes;
    let per_tile = pf.left().div_ceil(j.t1 - j.t0);
    // SAFETY: the tile state is configured for `F` while `_tiles` lives (AMX: the caller); each
    // tile `t` and row `i` is inside the job, and panels are whole and inside it.
    unsafe {
        let _tiles = Tiles::configure(split);
        // Taken out rather than borrowed in a closure: a closure would not inherit the
        // function's instruction sets, and its intrinsics would not be inlined.
        let mut w = DECODED.take();
        let mut bufs = [Sums([[0; 16]; 4 * PANEL]); RING];
        for t in j.t0..j.t1 {
            decode::<F>(s.tiles.as_ptr().add(t * rec), nb, &mut w);
            let (at, lines) = pf.take(per_tile);
            for l in 0..lines {
                _mm_prefetch::<_MM_HINT_T0>((at + l * super::LINE) as *const i8);
            }
            let cols = (s.n - t * TN).min(TN);
            let mut i = j.m0;
            while i < j.m1 {
                let (xo, mo, slot) = act.at(i);
                if slot == 0 && i + PANEL <= j.m1 {
                    let y = out.ptr.add(i * out.ldy + s.col0 + t * TN);
                    panel::<F>(&w, &mut bufs, act.qs.as_ptr().add(xo), act.meta.as_ptr().add(mo), (y, out.ldy, cols));
                    i += PANEL;
                } else {
                    i += tile_rows::<S, F, 1>(s, act, out, (t, 0), (i, j.m1), (0, 0));
                }
            }
        }
        DECODED.set(w);
    }
}

/// [`job_of`] for the segment's type.
///
/// # Safety
/// As for [`job_of`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn job(s: &Seg<'_>, act: &Act, out: Out, j: &Job, pf: Ahead<'_>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match s.qt {
            QuantType::Q4_0 => job_of::<Q4_0>(s, act, out, j, pf),
            QuantType::Q4_1 => job_of::<Q4_1>(s, act, out, j, pf),
            QuantType::Q5_0 => job_of::<Q5_0>(s, act, out, j, pf),
            QuantType::Q5_1 => job_of::<Q5_1>(s, act, out, j, pf),
            QuantType::Q8_0 => job_of::<Q8_0>(s, act, out, j, pf),
            QuantType::Q2K => job_of::<Q2K>(s, act, out, j, pf),
            QuantType::Q3K => job_of::<Q3K>(s, act, out, j, pf),
            QuantType::Q4K => job_of::<Q4K>(s, act, out, j, pf),
            QuantType::Q5K => job_of::<Q5K>(s, act, out, j, pf),
            QuantType::Q6K => job_of::<Q6K>(s, act, out, j, pf),
        }
    }
}
