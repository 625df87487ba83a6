//! The quantized product's kernels: activation quantization ([`act`]), the generic tile loop
//! ([`tile`]) over each weight type ([`mod@format`]) on each instruction set ([`simd`]: portable;
//! [`x86`]: AVX2, AVX-VNNI, AVX-512 VNNI), the tile unit's loop for many rows (`amx`: AMX-INT8,
//! the same sums and the same epilogue), and [`run`], the safe entry point.
//!
//! This module and its children are the quantized path's `unsafe` (with the weights' own memory,
//! `arena.rs`): raw-pointer vector loads and stores, the `#[target_feature]` entry points (called
//! only after run-time detection), and the one output pointer that threads write disjoint
//! rectangles through. [`run`] checks every
//! job against the weights, the activations and the output, and against each other, before any
//! of that runs.

pub(crate) mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
mod format;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod simd;
mod tile;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::ops::Range;

use super::QuantType;
use super::layout::{TN, layout};
use crate::isa::{Isa, Portable};
use act::{Act, Deferred};
use format::{Format, Q2K, Q3K, Q4_0, Q4_1, Q4K, Q5_0, Q5_1, Q5K, Q6K, Q8_0};
use simd::DotSimd;
use tile::{RowTile, rows_any};

#[cfg(target_arch = "x86_64")]
pub(crate) use amx::granted as amx_granted;

/// Bytes of a cache line: the unit of the read-ahead hints.
const LINE: usize = 64;

/// One weight segment: `n` output columns from `col0`, of one type, as tiles of `k` each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seg<'a> {
    pub(crate) qt: QuantType,
    pub(crate) tiles: &'a [u8],
    pub(crate) n: usize,
    pub(crate) col0: usize,
}

/// One task: tiles `t0..t1` of segment `seg` against rows `m0..m1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Job {
    pub(crate) seg: usize,
    pub(crate) t0: usize,
    pub(crate) t1: usize,
    pub(crate) m0: usize,
    pub(crate) m1: usize,
}

/// A product's jobs cut for the threads, made once per shape and kept with the weight: the jobs,
/// the runs of them that make one parallel task each (together every job once, in order), and the
/// outputs before each job (a job's share of the read-ahead lines follows its outputs).
#[derive(Debug)]
pub(crate) struct Cut {
    jobs: Vec<Job>,
    tasks: Vec<Range<usize>>,
    /// `before[i]`: the outputs of jobs `0..i` (`jobs.len() + 1` of them).
    before: Vec<usize>,
}

impl Cut {
    /// The jobs over `segs`, run as `tasks`.
    ///
    /// # Panics
    /// When the tasks do not take every job once, in order, or a job names no segment.
    pub(crate) fn new(jobs: Vec<Job>, tasks: Vec<Range<usize>>, segs: &[Seg<'_>]) -> Cut {
        let mut next = 0;
        for t in &tasks {
            assert!(t.start == next && t.start <= t.end && t.end <= jobs.len(), "quant kernel: task {t:?}");
            next = t.end;
        }
        assert!(next == jobs.len(), "quant kernel: the tasks take {next} of {} jobs", jobs.len());
        let mut before = Vec::with_capacity(jobs.len() + 1);
        before.push(0);
        for j in &jobs {
            let (c0, c1) = cols(segs.get(j.seg).expect("quant kernel: job of no segment"), j);
            before.push(before[before.len() - 1] + (j.m1 - j.m0) * c1.saturating_sub(c0));
        }
        Cut { jobs, tasks, before }
    }

    /// The jobs, in order.
    #[cfg(test)]
    pub(crate) fn jobs(&self) -> &[Job] {
        &self.jobs
    }

    /// The runs of jobs that make one parallel task each.
    #[cfg(test)]
    pub(crate) fn tasks(&self) -> &[Range<usize>] {
        &self.tasks
    }
}

/// The output, shared by the threads; each writes only its own jobs' rectangles.
#[derive(Clone, Copy, Debug)]
struct Out {
    ptr: *mut f32,
    ldy: usize,
}

// SAFETY: `Out` is only handed to jobs whose output rectangles `run` checked to be disjoint, so
// no two threads ever write, or read, the same element.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

/// A job's share of the lines to bring into the caches ([`run`]'s `ahead`): lines `from..to` of the
/// ranges laid end to end, handed out a contiguous run at a time.
#[derive(Clone, Copy, Debug)]
struct Ahead<'a> {
    ranges: &'a [(usize, usize)],
    /// The current range and the next line of it.
    at: usize,
    line: usize,
    left: usize,
}

impl<'a> Ahead<'a> {
    fn new(ranges: &'a [(usize, usize)], from: usize, to: usize) -> Ahead<'a> {
        let (mut at, mut line) = (0, from);
        while at < ranges.len() && line >= ranges[at].1.div_ceil(LINE) {
            line -= ranges[at].1.div_ceil(LINE);
            at += 1;
        }
        Ahead { ranges, at, line, left: to.saturating_sub(from) }
    }

    fn left(&self) -> usize {
        self.left
    }

    /// Up to `max` lines from the current one, all in one range: `(address, lines)`.
    fn take(&mut self, max: usize) -> (usize, usize) {
        while self.left > 0 && self.at < self.ranges.len() {
            let (addr, bytes) = self.ranges[self.at];
            let rest = bytes.div_ceil(LINE) - self.line;
            if rest == 0 {
                (self.at, self.line) = (self.at + 1, 0);
                continue;
            }
            let n = max.min(rest).min(self.left);
            let a = addr.wrapping_add(self.line * LINE);
            self.line += n;
            self.left -= n;
            return (a, n);
        }
        (0, 0)
    }
}

/// The output columns of a job.
fn cols(s: &Seg<'_>, j: &Job) -> (usize, usize) {
    (s.col0 + (j.t0 * TN).min(s.n), s.col0 + (j.t1 * TN).min(s.n))
}

/// Checks what makes the jobs sound: every segment's tiles hold `k` of its columns, inside the
/// output; every job inside its segment and the activations, and no two overlapping.
///
/// # Panics
/// When one does not hold.
fn check(act: &Deferred<'_>, segs: &[Seg<'_>], ldy: usize, jobs: &[Job]) {
    let (m, k, qs, meta) = act.shape();
    let (panels, nb) = (m.div_ceil(act::PANEL), k / 32);
    let holds = qs >= panels * nb * act::BLOCK && meta >= panels * nb;
    assert!(k.is_multiple_of(32) && holds, "quant kernel: activations");
    for s in segs {
        let l = layout(s.qt);
        assert!(k.is_multiple_of(l.sb), "quant kernel: k = {k} for {}", s.qt.name());
        assert!(s.tiles.len() >= s.n.div_ceil(TN) * (k / l.sb) * l.bytes, "quant kernel: {} tile bytes", s.tiles.len());
        assert!(s.col0 + s.n <= ldy, "quant kernel: segment columns past the output");
    }
    for (i, j) in jobs.iter().enumerate() {
        let s = segs.get(j.seg).expect("quant kernel: job of no segment");
        assert!(j.t0 <= j.t1 && j.t1 <= s.n.div_ceil(TN) && j.m0 <= j.m1 && j.m1 <= m, "quant kernel: job {j:?}");
        let (c0, c1) = cols(s, j);
        let overlaps = |o: &Job| {
            let (d0, d1) = cols(&segs[o.seg], o);
            j.m0 < o.m1 && o.m0 < j.m1 && c0 < d1 && d0 < c1
        };
        assert!(!jobs[..i].iter().any(overlaps), "quant kernel: job {j:?} overlaps another");
    }
    let area: usize = jobs
        .iter()
        .map(|j| {
            let (c0, c1) = cols(&segs[j.seg], j);
            (j.m1 - j.m0) * (c1 - c0)
        })
        .sum();
    assert!(area == m * ldy, "quant kernel: the jobs cover {area} of {} outputs", m * ldy);
}

/// Computes every job of `cut` into a new `[m, ldy]` output, on the rayon pool when `parallel`
/// (one parallel task per run of the cut's tasks, its jobs in order). The jobs must cover the
/// output exactly: it is written once, never zeroed first.
///
/// # Panics
/// When a job reaches outside the weights, the activations or the output, overlaps another, or
/// the jobs leave an output uncovered.
pub(crate) fn run(
    isa: Isa,
    act: &Deferred<'_>,
    segs: &[Seg<'_>],
    ldy: usize,
    cut: &Cut,
    parallel: bool,
    ahead: &[(usize, usize)],
) -> Vec<f32> {
    let (jobs, before) = (&cut.jobs, &cut.before);
    check(act, segs, ldy, jobs);
    let len = act.shape().0 * ldy;
    let mut y: Vec<f32> = Vec::with_capacity(len);
    let isa = isa.quant();
    let out = Out { ptr: y.as_mut_ptr(), ldy };
    // Each job's share of the lines to ask for, by its outputs (`check`: they sum to `len`).
    let (total, all) = (ahead.iter().map(|&(_, b)| b.div_ceil(LINE)).sum::<usize>(), len.max(1));
    let go = |act: &Act, i: usize| {
        let j = &jobs[i];
        let s = &segs[j.seg];
        let pf = Ahead::new(ahead, before[i] * total / all, before[i + 1] * total / all);
        if j.m0 == j.m1 || j.t0 == j.t1 {
            return;
        }
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected, AMX-TILE and AMX-INT8
            // too with the system's leave to use them (`available`); `check` put the job inside
            // the operands and apart from every other.
            Isa::Amx => unsafe { amx::job(s, act, out, j, pf) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected (`available`); `check`
            // put the job inside the operands and apart from every other.
            Isa::Avx512Vnni => unsafe { job_avx512(s, act, out, j, pf) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-VNNI, AVX2, FMA and F16C were detected; bounds as above.
            Isa::AvxVnni => unsafe { job_avxvnni(s, act, out, j, pf) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2, FMA and F16C were detected; bounds as above.
            Isa::Avx2 => unsafe { job_avx2(s, act, out, j, pf) },
            // SAFETY: no instruction set needed; bounds as above.
            _ => unsafe { job::<Portable>(s, act, out, j, pf) },
        }
    };
    // The activations are quantized by the first tasks to start (each task has them from
    // `finish` only once they all are), inside the product's own region.
    if parallel && cut.tasks.len() > 1 {
        crate::pool::for_each_index(cut.tasks.len(), |t| {
            let a = act.finish();
            cut.tasks[t].clone().for_each(|i| go(a, i))
        });
    } else {
        let a = act.finish();
        (0..jobs.len()).for_each(|i| go(a, i));
    }
    // SAFETY: the capacity is `len`; the jobs are disjoint, inside `[m, ldy]` and their areas sum
    // to `m · ldy` (`check`), and each writes every output of its rectangle: all are initialized.
    unsafe { y.set_len(len) };
    y
}

/// One job of type `F`: for each tile, each `S::LANES`-column part of it, row tiles down the
/// job's rows. A 256-bit set's 16-column tile is two such parts; for a job of [`PAIR_ROWS`] rows
/// or fewer (decode) both go in one pass over the tile's records.
///
/// # Safety
/// As `run` checked: the job is inside the segment, the activations and the output, nobody else
/// writes its rectangle, and `S`'s instruction set is available.
#[inline(always)]
unsafe fn job_of<S: DotSimd, F: Format>(s: &Seg<'_>, act: &Act, out: Out, j: &Job, mut pf: Ahead<'_>) {
    let pair = S::LANES * 2 == TN && j.m1 - j.m0 <= PAIR_ROWS;
    let parts = if pair { 1 } else { TN.div_ceil(S::LANES) };
    let calls = (j.t1 - j.t0) * parts * (j.m1 - j.m0).div_ceil(S::RM.min(8));
    let per_call = pf.left().div_ceil(calls.max(1));
    let mut budget = 0;
    for t in j.t0..j.t1 {
        let tile_cols = (s.n - t * TN).min(TN);
        let both = pair && tile_cols == TN;
        let mut c0 = 0;
        while c0 < tile_cols {
            let mut i = j.m0;
            while i < j.m1 {
                budget += per_call;
                let ahead = pf.take(budget);
                budget -= ahead.1;
                // SAFETY: tile `t` and rows `i..j.m1` are inside the job (the caller); with
                // `both`, the tile's 16 columns are all the segment's.
                i += unsafe {
                    if both {
                        tile_rows::<S, F, 2>(s, act, out, (t, c0), (i, j.m1), ahead)
                    } else {
                        tile_rows::<S, F, 1>(s, act, out, (t, c0), (i, j.m1), ahead)
                    }
                };
            }
            c0 += if both { TN } else { S::LANES };
        }
    }
}

/// The most rows for which a 256-bit set takes both halves of a tile in one pass: the
/// accumulators of two halves of two rows, and one half's decoded weights, fit its 16 registers.
const PAIR_ROWS: usize = 2;

/// Rows from `i` (at most to `m1`, and within row `i`'s panel) of the activations against the
/// `H · S::LANES` columns from `c0` of tile `t` of the segment, asking along the way for the `ahead`
/// lines (`(address, lines)`): how many rows it took.
///
/// # Safety
/// As for [`job_of`], for a tile and rows inside the job, `c0` below the tile's columns.
#[inline(always)]
unsafe fn tile_rows<S: DotSimd, F: Format, const H: usize>(
    s: &Seg<'_>,
    act: &Act,
    out: Out,
    (t, c0): (usize, usize),
    (i, m1): (usize, usize),
    (ahead, ahead_lines): (usize, usize),
) -> usize {
    let nsb = act.k / F::L.sb;
    let tile_cols = (s.n - t * TN).min(TN);
    let (xo, mo, slot) = act.at(i);
    // SAFETY: tile `t` of the segment, rows `i..` of the activations (within row `i`'s panel:
    // `rows_any` stops at its end) and outputs `(i.., col0 + 16t + c0 ..)`, all inside the job
    // (see `run`'s checks).
    unsafe {
        let rt = RowTile {
            w: s.tiles.as_ptr().add(t * nsb * F::L.bytes),
            nsb,
            c0,
            x: act.qs.as_ptr().add(xo),
            meta: act.meta.as_ptr().add(mo),
            slot,
            y: out.ptr.add(i * out.ldy + s.col0 + t * TN + c0),
            ldy: out.ldy,
            cols: (tile_cols - c0).min(H * S::LANES),
            ahead,
            ahead_lines,
        };
        rows_any::<S, F, H>(m1 - i, rt)
    }
}

/// `$e` with `$F` the [`Format`] of quant type `$qt` (each format is named as its type).
macro_rules! with_format {
    ($qt:expr, $F:ident => $e:expr) => {
        with_format!(@ $qt, $F => $e; Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2K Q3K Q4K Q5K Q6K)
    };
    (@ $qt:expr, $F:ident => $e:expr; $($t:ident)*) => {
        match $qt {
            $(QuantType::$t => {
                type $F = $t;
                $e
            })*
        }
    };
}

/// [`job_of`] for the segment's type.
///
/// # Safety
/// As for [`job_of`].
#[inline(always)]
unsafe fn job<S: DotSimd>(s: &Seg<'_>, act: &Act, out: Out, j: &Job, pf: Ahead<'_>) {
    // SAFETY: forwarded from the caller.
    unsafe { with_format!(s.qt, F => job_of::<S, F>(s, act, out, j, pf)) }
}

/// # Safety
/// As for [`job_of`], with AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn job_avx512(s: &Seg<'_>, act: &Act, out: Out, j: &Job, pf: Ahead<'_>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { job::<crate::isa::Avx512Vnni>(s, act, out, j, pf) }
}

/// # Safety
/// As for [`job_of`], with AVX-VNNI, AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avxvnni,avx2,fma,f16c")]
unsafe fn job_avxvnni(s: &Seg<'_>, act: &Act, out: Out, j: &Job, pf: Ahead<'_>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe { job::<crate::isa::AvxVnni>(s, act, out, j, pf) }
}

/// # Safety
/// As for [`job_of`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn job_avx2(s: &Seg<'_>, act: &Act, out: Out, j: &Job, pf: Ahead<'_>) {
    // SAFETY: forwarded from the caller, which checked the features.
    unsafe {
        if lanes::takes(s.qt, j) {
            with_format!(s.qt, F => lanes::job::<F>(s, act, out, j, pf))
        } else {
            job::<crate::isa::Avx2>(s, act, out, j, pf)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Ahead;

    /// Every line of every range is handed out once, in order, whatever the jobs and the sizes
    /// asked for, and never past the job's share.
    #[test]
    fn the_jobs_shares_cover_every_line_once() {
        let ranges: [(usize, usize); 5] = [(1 << 20, 100), (2 << 20, 64), (3 << 20, 0), (4 << 20, 6400), (5 << 20, 1)];
        let want: Vec<usize> = ranges.iter().flat_map(|&(a, b)| (0..b.div_ceil(64)).map(move |l| a + 64 * l)).collect();
        let total = want.len();
        for jobs in [1, 2, 3, 7, 200] {
            for max in [1, 3, 50] {
                let mut got = Vec::new();
                for i in 0..jobs {
                    let mut a = Ahead::new(&ranges, i * total / jobs, (i + 1) * total / jobs);
                    let share = a.left();
                    let mut mine = 0;
                    loop {
                        let (addr, n) = a.take(max);
                        if n == 0 {
                            break;
                        }
                        assert!(n <= max);
                        got.extend((0..n).map(|l| addr + 64 * l));
                        mine += n;
                    }
                    assert_eq!(mine, share, "{jobs} jobs, job {i}");
                }
                assert_eq!(got, want, "{jobs} jobs, {max} lines at a time");
            }
        }
    }
}
