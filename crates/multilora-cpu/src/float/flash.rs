//! Causal prefill attention that streams: one sequence's new queries against its paged context,
//! in tiles of queries × blocks of keys with an online softmax, nothing of size `len × ctx`
//! ever held (flash attention's scheme on the CPU).
//!
//! A task is one KV head and one tile of [`query_tile`] consecutive queries. The tile's `group`
//! query heads of that KV head are the columns of one matrix `Qᵀ` (`[hd, cols]`: query `t`, head
//! `g` in column `t · group + g`, padded with zero columns to a multiple of 32), so every per-query
//! step below runs along the columns, a vector of queries at a time. The keys the tile sees, from
//! its first query's window start to its last query, are taken [`KEY_BLOCK`] positions at a time,
//! each block's keys and values read from the cache rows its positions name and widened to f32
//! (`K`, `V`: `[KEY_BLOCK, hd]`, as they lie). Per block:
//! - `Sᵀ = K · Qᵀ` (`[KEY_BLOCK, cols]`), the outer-product tiles with `K`'s values broadcast;
//! - the causal mask and the window, where the block has keys some query does not see: `−∞` by
//!   comparing positions, never a stored mask;
//! - each column's running maximum `m` and sum `l`: on a larger maximum the column's `l` and `Oᵀ`
//!   are scaled by `2^(m_old − m_new)`; `P = 2^(Sᵀ − m_new)` (scores in base 2: `Qᵀ` is scaled by
//!   `log₂ e` once, [`pow2`]), its column sums added to `l`;
//! - `Oᵀ += Vᵀ · P` (`[hd, cols]`), the same tiles with `V` read `k`-major.
//!
//! At the end each query's output is its column of `Oᵀ` over `l`. Everything accumulates in f32.
//! Key blocks start at multiples of [`KEY_BLOCK`] in absolute positions, and a block a query does
//! not see changes nothing of its column (a scale of exactly 1, weights of exactly 0), so a query's
//! result is the same bits whichever tile, chunk or step it is computed in: prefill in one step,
//! chunked over several and continued from a cached prefix agree exactly, as do all thread counts.
//!
//! The workspace is per thread ([`Work`]), at most [`causal_workspace_bytes`] whatever the
//! prompt's length. Tasks run on the pool ([`crate::pool`]), the tiles that see the most keys
//! first; each writes its queries' columns of its KV head straight into the output.

use std::cell::RefCell;
use std::f32::consts::LOG2_E;
use std::ops::Range;

use super::{Elem, FloatSimd};
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::isa::{Avx2, Avx512F};
use crate::isa::{Isa, Portable};

/// Positions in a block of keys.
pub const KEY_BLOCK: usize = 128;

/// Columns of `Qᵀ` (a tile's queries times the group) a task aims for over a short context and
/// over a long one (past [`LONG_CONTEXT`] positions). Each block of keys and values is gathered
/// once per task, so the wider tile halves that traffic where it matters; over a short context the
/// narrower one halves the keys computed and masked on the diagonal, and gives the threads twice
/// the tasks to share (measured: `cpu_attention` bench, docs/BENCHMARKS.md).
const TILE_COLS: [usize; 2] = [128, 256];

/// Context length past which a sequence takes the wider tiles.
const LONG_CONTEXT: usize = 2048;

/// Queries in a task's tile for `group` query heads per KV head over a context of `ctx`
/// positions: `TILE_COLS` columns of `Qᵀ`, at least 8 queries. The tile changes no result.
pub fn query_tile(group: usize, ctx: usize) -> usize {
    (TILE_COLS[usize::from(ctx > LONG_CONTEXT)] / group.max(1)).max(8)
}

/// The most bytes one thread's workspace takes for `group` query heads per KV head of `hd`,
/// whatever the prompt's length: `Qᵀ` and `Oᵀ` (`hd` rows of the widest tile's columns), a block
/// of scores, a block of keys and one of values, and the per-column vectors.
pub fn causal_workspace_bytes(group: usize, hd: usize) -> usize {
    let cols = (query_tile(group, usize::MAX) * group).next_multiple_of(COL_ALIGN);
    4 * (2 * hd * cols + KEY_BLOCK * cols + 2 * KEY_BLOCK * hd) + 5 * 8 * cols
}

/// One prefill sequence's operands: `len` new queries at positions `start .. start + len` over
/// the context positions `lo .. start + len`, whose cache rows are `rows`.
#[derive(Clone, Copy, Debug)]
pub struct Causal<'a, E> {
    /// The new queries, `[len, heads · hd]`, already scaled.
    pub q: &'a [f32],
    /// The key cache, `[cache rows, kv_heads · hd]`.
    pub k: &'a [E],
    /// The value cache, like `k`.
    pub v: &'a [E],
    /// The cache row of each context position from `lo`, in order, through the last query's.
    pub rows: &'a [u32],
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// The head dimension.
    pub hd: usize,
    /// The first query's position.
    pub start: usize,
    /// The position of `rows[0]`: at most the first query's window start.
    pub lo: usize,
    /// The sliding window the keys are seen through (the query and `window − 1` before it).
    pub window: Option<usize>,
}

impl<E> Causal<'_, E> {
    /// New queries.
    pub fn len(&self) -> usize {
        self.q.len() / (self.heads * self.hd).max(1)
    }

    /// Whether there are no new queries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first position the query at position `p` sees.
    fn first(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }

    /// Every shape and row checked, so that the kernel reads and writes only inside the slices.
    fn check(&self, out: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::Attention { reason });
        let width = self.kv_heads * self.hd;
        if self.kv_heads == 0 || self.hd == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("{} query heads over {} kv heads of {}", self.heads, self.kv_heads, self.hd));
        }
        let len = self.len();
        if self.q.len() != len * self.heads * self.hd || out != self.q.len() {
            return bad(format!(
                "{} query values and {out} outputs for heads of {}",
                self.q.len(),
                self.heads * self.hd
            ));
        }
        if len == 0 {
            return Ok(());
        }
        if self.lo > self.first(self.start) || self.window == Some(0) {
            return bad(format!("context from {} for a first query at {}", self.lo, self.start));
        }
        if self.rows.len() != self.start + len - self.lo {
            return bad(format!("{} context rows for positions {}..{}", self.rows.len(), self.lo, self.start + len));
        }
        let cache_rows = (self.k.len() / width).min(self.v.len() / width);
        if let Some(p) = self.rows.iter().position(|&r| r as usize >= cache_rows) {
            return bad(format!("position {} names cache row {}, past {cache_rows}", self.lo + p, self.rows[p]));
        }
        Ok(())
    }
}

/// A thread's workspace, kept from task to task: `Qᵀ` (`[hd, cols]`), a block of keys and one of
/// values (`[KEY_BLOCK, hd]`), the block's scores then weights (`[KEY_BLOCK, cols]`), `Oᵀ`
/// (`[hd, cols]`), and per column the running maximum, sum and rescale, and the first and last
/// positions its query sees.
#[derive(Default)]
struct Work {
    qt: Vec<f32>,
    kb: Vec<f32>,
    vb: Vec<f32>,
    st: Vec<f32>,
    ot: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    scale: Vec<f32>,
    first: Vec<usize>,
    last: Vec<usize>,
}

thread_local! {
    static WORK: RefCell<Work> = RefCell::new(Work::default());
}

/// The bytes this thread's workspace holds now (its buffers' capacities).
#[cfg(test)]
pub(crate) fn workspace_bytes() -> usize {
    WORK.with_borrow(|w| {
        let floats =
            [&w.qt, &w.kb, &w.vb, &w.st, &w.ot, &w.m, &w.l, &w.scale].map(|v| v.capacity()).iter().sum::<usize>();
        4 * floats + 8 * (w.first.capacity() + w.last.capacity())
    })
}

/// The output, shared by the tasks: each writes its own queries' columns of its own KV head.
#[derive(Clone, Copy)]
struct Out(*mut f32);

// SAFETY: every task writes only the columns of its KV head in the rows of its tile's queries,
// which no other task writes (the tasks are distinct (tile, head) pairs) and none reads.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// The output from value `at` on (a method: a closure then captures the whole `Out`).
    fn at(self, at: usize) -> *mut f32 {
        self.0.wrapping_add(at)
    }
}

/// Columns of `Qᵀ` are padded to a multiple of this (two AVX-512 vectors): the products then have
/// no scalar tail; the padding's queries are zero and their outputs never read.
const COL_ALIGN: usize = 32;

/// `out` (`[len, heads · hd]`) `= softmax(Q · Kᵀ + causal mask) · V` for every query of `c`, on
/// `isa` (portable where the CPU lacks it), the tasks on the pool's threads.
///
/// # Errors
/// [`Error::Attention`] when the shapes disagree, `out` is not the queries' size, the context
/// does not run from `lo` through the last query, or a position names a row past the caches.
pub fn causal_attention<E: Elem>(isa: Isa, c: Causal<'_, E>, out: &mut [f32]) -> Result<()> {
    c.check(out.len())?;
    let len = c.len();
    if len == 0 {
        return Ok(());
    }
    let group = c.heads / c.kv_heads;
    let tile = query_tile(group, c.start + len);
    let tiles = len.div_ceil(tile);
    let o = Out(out.as_mut_ptr());
    crate::pool::for_each_index(tiles * c.kv_heads, |i| {
        // The last tiles (which see the most keys) first.
        let (t, head) = (tiles - 1 - i / c.kv_heads, i % c.kv_heads);
        let rows = t * tile..(t * tile + tile).min(len);
        WORK.with_borrow_mut(|w| {
            let cols = run_task(isa, &c, head, rows.clone(), w);
            let (row, hd) = (c.heads * c.hd, c.hd);
            for (j, r) in rows.enumerate() {
                // SAFETY: `out` holds `len · heads · hd` values (checked); this task alone writes
                // the `group · hd` columns of `head` in the rows of its queries.
                let dst = unsafe { std::slice::from_raw_parts_mut(o.at(r * row + head * group * hd), group * hd) };
                for (g, dst) in dst.chunks_exact_mut(hd).enumerate() {
                    let i = j * group + g;
                    let inv = 1.0 / w.l[i];
                    dst.iter_mut().zip(w.ot[i..].iter().step_by(cols)).for_each(|(y, &x)| *y = x * inv);
                }
            }
        });
    });
    Ok(())
}

/// [`task`] on `isa`'s kernels; the columns of the task's `Oᵀ`.
fn run_task<E: Elem>(isa: Isa, c: &Causal<'_, E>, head: usize, rows: Range<usize>, w: &mut Work) -> usize {
    /// # Safety
    /// AVX-512F must be available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512<E: Elem>(c: &Causal<'_, E>, head: usize, rows: Range<usize>, w: &mut Work) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { task::<Avx512F, E>(c, head, rows, w) }
    }
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<E: Elem>(c: &Causal<'_, E>, head: usize, rows: Range<usize>, w: &mut Work) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { task::<Avx2, E>(c, head, rows, w) }
    }
    match isa.float() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected (`available`).
        Isa::Avx512 => unsafe { avx512(c, head, rows, w) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected.
        Isa::Avx2 => unsafe { avx2(c, head, rows, w) },
        // SAFETY: the portable set needs nothing.
        _ => unsafe { task::<Portable, E>(c, head, rows, w) },
    }
}

/// One task: the queries `rows` (indices into the new queries) for KV head `head`, over every key
/// block they see. Leaves `Oᵀ` in `w.ot` (`[hd, cols]`, column `t · group + g` for query `t` of
/// the tile and head `g` of the group) and the sums in `w.l`, and returns `cols`. Written for the
/// compiler to vectorise at `S`'s instruction set (the loops over columns), the two products on
/// `S`'s outer-product tiles.
///
/// # Safety
/// `S`'s instruction set must be available.
#[inline(always)]
unsafe fn task<S: FloatSimd, E: Elem>(c: &Causal<'_, E>, head: usize, rows: Range<usize>, w: &mut Work) -> usize {
    let (hd, group) = (c.hd, c.heads / c.kv_heads);
    let (width, col) = (c.kv_heads * hd, head * hd);
    let used = rows.len() * group;
    let cols = used.next_multiple_of(COL_ALIGN);
    let (p0, p1) = (c.start + rows.start, c.start + rows.end - 1);
    let reset = |v: &mut Vec<f32>, n: usize, x: f32| {
        v.clear();
        v.resize(n, x);
    };
    reset(&mut w.qt, hd * cols, 0.0);
    for (t, r) in rows.clone().enumerate() {
        let q = &c.q[r * c.heads * hd + col * group..][..group * hd];
        for (g, q) in q.chunks_exact(hd).enumerate() {
            w.qt[t * group + g..].iter_mut().step_by(cols).zip(q).for_each(|(y, &x)| *y = x * LOG2_E);
        }
    }
    reset(&mut w.ot, hd * cols, 0.0);
    reset(&mut w.m, cols, f32::NEG_INFINITY);
    reset(&mut w.l, cols, 0.0);
    // Written before they are read, block by block: sized, not cleared.
    w.scale.resize(cols, 0.0);
    w.st.resize(KEY_BLOCK * cols, 0.0);
    w.kb.resize(KEY_BLOCK * hd, 0.0);
    w.vb.resize(KEY_BLOCK * hd, 0.0);
    // Each column's query position (the padding's: the first query's) and its window start.
    w.last.clear();
    w.last.extend((0..cols).map(|i| if i < used { p0 + i / group } else { p0 }));
    w.first.clear();
    w.first.extend(w.last.iter().map(|&p| c.first(p)));
    let seen = c.first(p0)..p1 + 1;
    for block in seen.start / KEY_BLOCK..=p1 / KEY_BLOCK {
        let base = block * KEY_BLOCK;
        let keys = seen.start.max(base)..seen.end.min(base + KEY_BLOCK);
        let n = keys.len();
        for (j, p) in keys.clone().enumerate() {
            let at = c.rows[p - c.lo] as usize * width + col;
            // SAFETY: the caller vouched for `S`'s instruction set.
            unsafe {
                widen::<S, E>(&c.k[at..][..hd], &mut w.kb[j * hd..][..hd]);
                widen::<S, E>(&c.v[at..][..hd], &mut w.vb[j * hd..][..hd]);
            }
            // The next block's rows asked for while this one is computed (the cache rows are
            // scattered blocks, which the hardware's prefetcher does not follow).
            if let Some(&next) = c.rows.get(p + KEY_BLOCK - c.lo).filter(|_| p + KEY_BLOCK <= p1) {
                let at = next as usize * width + col;
                for line in (0..hd * size_of::<E>()).step_by(64) {
                    S::prefetch(c.k.as_ptr().wrapping_add(at).cast::<u8>().wrapping_add(line).cast());
                    S::prefetch(c.v.as_ptr().wrapping_add(at).cast::<u8>().wrapping_add(line).cast());
                }
            }
        }
        // SAFETY: `kb` holds `n` rows of `hd`, `qt` `hd` rows of `cols`, `st` `n` rows of `cols`
        // (sized above, `n <= KEY_BLOCK`); `cols` is a multiple of `2 · LANES` for every set; the
        // caller vouched for `S`'s instruction set.
        unsafe {
            let args = (w.kb.as_ptr(), hd, w.qt.as_ptr(), cols, (n, cols, hd), w.st.as_mut_ptr(), cols, false);
            super::outer_rows::<S, f32, false>(args);
        }
        let st = &mut w.st[..n * cols];
        // The causal mask and the window, where some key of the block is hidden from some query.
        if keys.end - 1 > p0 || keys.start < c.first(p1) {
            for (row, p) in st.chunks_exact_mut(cols).zip(keys.clone()) {
                for ((s, &first), &last) in row.iter_mut().zip(&w.first).zip(&w.last) {
                    *s = if p < first || p > last { f32::NEG_INFINITY } else { *s };
                }
            }
        }
        // Each column's new maximum; its sum and outputs so far rescaled (by 1 where it stays,
        // by 0 while the column has seen nothing: `exp(NaN)` is 0).
        w.scale.copy_from_slice(&w.m);
        for row in st.chunks_exact(cols) {
            w.scale.iter_mut().zip(row).for_each(|(m, &s)| *m = if s > *m { s } else { *m });
        }
        for ((m, s), l) in w.m.iter_mut().zip(w.scale.iter_mut()).zip(w.l.iter_mut()) {
            let new = *s;
            *s = pow2(*m - new, S::FMA);
            *m = new;
            *l *= *s;
        }
        for row in w.ot.chunks_exact_mut(cols) {
            row.iter_mut().zip(&w.scale).for_each(|(o, &s)| *o *= s);
        }
        for row in st.chunks_exact_mut(cols) {
            for ((s, &m), l) in row.iter_mut().zip(&w.m).zip(w.l.iter_mut()) {
                *s = pow2(*s - m, S::FMA);
                *l += *s;
            }
        }
        // SAFETY: `vb` holds `n` rows of `hd` (read `k`-major: `hd` outputs at each of `n` steps),
        // `st` `n` rows of `cols`, `ot` `hd` rows of `cols`; as above for `cols` and the set.
        unsafe {
            let args = (w.vb.as_ptr(), hd, w.st.as_ptr(), cols, (hd, cols, n), w.ot.as_mut_ptr(), cols, true);
            super::outer_rows::<S, f32, true>(args);
        }
    }
    cols
}

/// `dst = src` widened to f32, `S::LANES` values at a time with `S`'s loads (f16 through F16C,
/// bf16 by a shift), the tail one by one.
///
/// # Safety
/// `S`'s instruction set must be available.
#[inline(always)]
unsafe fn widen<S: FloatSimd, E: Elem>(src: &[E], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let full = n / S::LANES * S::LANES;
    for i in (0..full).step_by(S::LANES) {
        // SAFETY: `i + LANES <= n` values of both slices; the set is the caller's.
        unsafe { S::store(dst.as_mut_ptr().add(i), S::load_elem(src.as_ptr().add(i))) };
    }
    dst[full..n].iter_mut().zip(&src[full..n]).for_each(|(y, &x)| *y = x.to_f32());
}

/// `2ˣ` for `x ≤ 0`, within about 1e-7 relative: `x = n + f` with `n` the nearest integer and `|f|
/// ≤ ½`, `2ᶠ` by a degree-6 polynomial fitted for relative error (Horner's scheme, fused where the
/// set has FMA), times `2ⁿ` built in the exponent bits; 0 below −126 and for NaN (so a column that
/// has seen no key yet, `−∞ − (−∞)`, weighs 0). Branch-free, so a loop of it vectorises. The
/// scores are in base 2 (the queries times `log₂ e`), which saves [`super::exp`]'s reduction by
/// `ln 2`; a softmax in base 2 of scores times `log₂ e` is the softmax.
#[inline(always)]
fn pow2(x: f32, fma: bool) -> f32 {
    // 1.5 · 2²³: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const C: [f32; 7] =
        [1.0, std::f32::consts::LN_2, 0.240_226_46, 0.055_503_286, 0.009_618_483, 0.001_339_994_4, 0.000_153_472_8];
    let xc = x.clamp(-126.0, 0.0);
    let t = xc + ROUND;
    let f = xc - (t - ROUND);
    let mut p = C[6];
    for &c in C[..6].iter().rev() {
        p = if fma { p.mul_add(f, c) } else { p * f + c };
    }
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits((n.wrapping_add(127).clamp(0, 255) as u32) << 23);
    if x >= -126.0 { p * scale } else { 0.0 }
}
