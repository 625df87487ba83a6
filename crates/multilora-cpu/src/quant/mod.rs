//! Quantized CPU products for GGUF weights: `y = x · Wᵀ` with `W: [n, k]` held in GGML blocks
//! ([`QuantType`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K … Q6_K), `x: [m, k]` and
//! `y: [m, n]` f32.
//!
//! ```text
//! y[i, j] = Σ_b Σ_{t<32} W[j, 32b + t] · d_x[i, b] · Q_x[i, 32b + t]
//! ```
//!
//! Each row of `x` is quantized in blocks of 32 (integer quants `Q_x` of about 16 bits held as two
//! i8 planes, an f32 scale `d_x` and the quants' sums: GGML's Q8_0 / Q8_1 with a second plane for
//! what the first one leaves, [`kernel::act`]), then every 32-value block of every output is an
//! exact integer dot product of weight quants and activation quants (one per plane: `vpdpbusd`
//! on AVX-512 VNNI / AVX-VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2, i32 in portable Rust, combined
//! as `254 · hi + lo`), scaled into an f32 accumulator block after block in `k`'s order. So each
//! output is the same chain of operations whatever the batch, the tile or the thread: a row's
//! result is bit for bit independent of the other rows, and the same on every instruction set
//! (the quantizer and the f32 operations are the same IEEE operations everywhere). The only
//! error against the exact product with the dequantized weight is that of quantizing `x` (at
//! most `d_x / 2 = max|x| / 64,516` a value, 254 times less than GGML's 8-bit activations) and
//! the f32 roundings of the block sums.
//!
//! The weight stays quantized ([`mod@layout`]: GGML's blocks regrouped by 16 output columns so one
//! vector instruction multiplies 16 columns by 4 values of `k`, about the GGUF file's bytes), in
//! chunks backed by huge pages where the system gives them ([`mod@arena`]). One kernel serves
//! every batch size: a tile of 16 columns (the whole of `k`, read as one stream) is
//! decoded into registers once per row tile of up to 8 rows and multiplied against all of them.
//! Up to 64 rows (decode) every tile goes through all rows at once, so `W` is read from memory
//! once; above, rows are cut into blocks whose quantized activations (panels of 8 rows) stay in
//! L2 while each tile stays in L1. The tiles are cut into column ranges that run on the current
//! rayon pool ([`kernel`]); `k` is never split. The product's tasks themselves quantize the
//! activations before their first job (`kernel::act::Deferred`: each panel by the first thread
//! to take it), one parallel region a product rather than two.

// The weights' memory: huge-page chunks (`unsafe`: the allocation and its ranges).
#[allow(unsafe_code)]
mod arena;
mod dequant;
// The kernels (`unsafe`: vector loads, `#[target_feature]` entry points, the output pointer).
#[allow(unsafe_code)]
mod kernel;
mod layout;
mod types;

use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::isa::Isa;
use kernel::{Job, Seg};
use layout::{TN, layout};
pub use types::QuantType;

#[cfg(target_arch = "x86_64")]
pub(crate) use kernel::amx_granted;

/// One run of output columns of one type, as tiles ([`mod@layout`]).
#[derive(Debug)]
struct Segment {
    qt: QuantType,
    n: usize,
    tiles: arena::Lines,
}

/// A product of `m` rows on `threads` threads cut for the threads ([`QuantMatrix::plan`]).
#[derive(Debug)]
struct Plan {
    m: usize,
    threads: usize,
    cut: kernel::Cut,
}

/// A GGML-quantized weight `W: [n, k]` (PyTorch's `[out, in]`), held in its blocks and multiplied
/// by [`QuantMatrix::forward`] without dequantizing. Several weights of the same `k` and any types
/// stack into one ([`QuantMatrix::stack`]: fused q/k/v or gate/up) without copying. Cloning is
/// cheap (the blocks are shared).
#[derive(Clone)]
pub struct QuantMatrix {
    n: usize,
    k: usize,
    /// The segments in output-column order, each shared with the weights it was stacked from.
    segs: Arc<Vec<Arc<Segment>>>,
    /// The last two plans made on several threads ([`QuantMatrix::plan`]), the newer first, for
    /// the next product of as many rows on as many threads: a decode step's products repeat their
    /// shapes step after step, and a step's two row groups may differ by a row.
    last_plans: Arc<Mutex<[Option<Arc<Plan>>; 2]>>,
    /// The plans on one thread of `1..=DECODE_ROWS` rows, each made once: a step's row groups (each
    /// thread its own rows through every layer) read them side by side without a lock.
    solo_plans: Arc<[OnceLock<Arc<Plan>>; DECODE_ROWS]>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let types: Vec<&str> = self.types().iter().map(|t| t.name()).collect();
        write!(f, "QuantMatrix[{}, {}, {}]", self.n, self.k, types.join("+"))
    }
}

/// Up to this many rows a product takes all rows in one block (`W` read from memory once);
/// above it, rows are cut into blocks whose quantized activations fit in L2.
const DECODE_ROWS: usize = 64;

/// Bytes of quantized activations one block of rows may take.
const X_BLOCK_BYTES: usize = 1 << 20;

/// Below this many multiply-adds in one product, threads cost more than they save.
const PARALLEL_WORK: usize = 1 << 19;

/// Column ranges per thread, so a thread slowed by another process is caught up on.
const TASKS_PER_THREAD: usize = 4;

impl QuantMatrix {
    /// A weight over `segs` (in output-column order, `n` columns in all), no plan kept yet.
    fn with_segs(n: usize, k: usize, segs: Vec<Arc<Segment>>) -> QuantMatrix {
        QuantMatrix {
            n,
            k,
            segs: Arc::new(segs),
            last_plans: Arc::default(),
            solo_plans: Arc::new(std::array::from_fn(|_| OnceLock::new())),
        }
    }

    /// One `[n, k]` weight from GGML block bytes, rows in order, each row `k / block_elems`
    /// blocks (the GGUF layout). The bytes are regrouped, not kept.
    pub fn from_bytes(qtype: QuantType, n: usize, k: usize, bytes: &[u8]) -> Result<QuantMatrix> {
        let shape_err = |reason: String| Error::QuantShape { qtype: qtype.name(), n, k, reason };
        let be = qtype.block_elems();
        if n == 0 || k == 0 {
            return Err(shape_err("both dimensions must be positive".into()));
        }
        if !k.is_multiple_of(be) {
            return Err(shape_err(format!("k is not a multiple of the block size {be}")));
        }
        let nsb = k / be;
        let expected = n.checked_mul(nsb).and_then(|b| b.checked_mul(qtype.block_bytes()));
        let Some(expected) = expected else { return Err(shape_err("the shape is too large".into())) };
        if bytes.len() != expected {
            return Err(Error::QuantBytes { qtype: qtype.name(), n, k, got: bytes.len(), expected });
        }
        let l = layout(qtype);
        let rec = nsb * l.bytes;
        let tiles_len = n.div_ceil(TN).checked_mul(rec).ok_or_else(|| shape_err("the shape is too large".into()))?;
        let mut tiles = arena::Lines::zeroed(tiles_len);
        let bb = qtype.block_bytes();
        tiles.par_chunks_mut(rec).enumerate().for_each(|(t, tile)| {
            for (sb, r) in tile.chunks_exact_mut(l.bytes).enumerate() {
                for c in 0..TN.min(n - t * TN) {
                    let at = ((t * TN + c) * nsb + sb) * bb;
                    layout::write_parts(qtype, r, c, &layout::ggml_parts(qtype, &bytes[at..at + bb]));
                }
            }
        });
        Ok(QuantMatrix::with_segs(n, k, vec![Arc::new(Segment { qt: qtype, n, tiles })]))
    }

    /// The weights' rows one after another (e.g. q, k and v of a fused projection): one weight
    /// whose output columns are the parts' in order. The parts may have different types (Q4_K_M
    /// files mix Q4_K and Q6_K) but must share `k`; their blocks are shared, not copied.
    pub fn stack(parts: Vec<QuantMatrix>) -> Result<QuantMatrix> {
        let Some(first) = parts.first() else {
            return Err(Error::QuantStack { reason: "no weights to stack".into() });
        };
        let k = first.k;
        if let Some((i, p)) = parts.iter().enumerate().find(|(_, p)| p.k != k) {
            return Err(Error::QuantStack { reason: format!("part {i} has k = {}, part 0 has k = {k}", p.k) });
        }
        let n = parts.iter().map(|p| p.n).sum();
        let segs = parts.iter().flat_map(|p| p.segs.iter().cloned()).collect();
        Ok(QuantMatrix::with_segs(n, k, segs))
    }

    /// `(n, k)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The distinct types of its row segments, in order of first appearance.
    pub fn types(&self) -> Vec<QuantType> {
        let mut out = Vec::new();
        for s in self.segs.iter() {
            if !out.contains(&s.qt) {
                out.push(s.qt);
            }
        }
        out
    }

    /// Bytes it holds in memory (its blocks; about the GGUF bytes of the weight).
    pub fn storage_bytes(&self) -> usize {
        self.segs.iter().map(|s| s.tiles.len()).sum()
    }

    /// `x: [m, k]` (row-major f32) · `Wᵀ` → `[m, n]` f32 on `isa` (an error when the CPU lacks
    /// it; every set gives the same bits), asking along the way, a little at each block, for the
    /// bytes of `ahead` (`(address, bytes)` ranges of what the caller reads next) to be brought
    /// into the caches. The product runs on the current rayon pool ([`crate::pool`]).
    pub fn product(&self, xs: &[f32], m: usize, isa: Isa, ahead: &[(usize, usize)]) -> Result<Vec<f32>> {
        if !isa.available() {
            return Err(Error::IsaUnavailable { op: "quantized linear".into(), isa: isa.describe().into() });
        }
        let (n, k) = (self.n, self.k);
        if Some(xs.len()) != m.checked_mul(k) {
            return Err(Error::QuantShape {
                qtype: self.segs[0].qt.name(),
                n,
                k,
                reason: format!("the input has {} values, not {m} rows of {k}", xs.len()),
            });
        }
        if m == 0 {
            return Ok(Vec::new());
        }
        // A decode step's products read the weight once for all rows on the vector units; the AMX
        // tile unit takes the larger ones (`kernel/amx.rs`), for the same bits.
        let isa = if m <= DECODE_ROWS && isa.quant() == Isa::Amx { Isa::Avx512Vnni } else { isa };
        let threads = crate::pool::threads();
        let parallel = threads > 1 && m.saturating_mul(n).saturating_mul(k) >= PARALLEL_WORK;
        let plan = self.plan_for(m, if parallel { threads } else { 1 });
        let segs = self.seg_views();
        // The product's tasks quantize the activations before their first job (one region, not two).
        let act = kernel::act::Deferred::new(isa, xs, m, k);
        Ok(kernel::run(isa, &act, &segs, n, &plan.cut, parallel, ahead))
    }

    /// `[n, k]` f32, row-major: every value as ggml dequantizes it, bit for bit.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        w.par_chunks_mut(self.k).enumerate().for_each(|(j, row)| self.row_into(j, row));
        w
    }

    /// `[rows.len(), k]` f32: the rows `rows` of [`QuantMatrix::dequantize`] (the embedding
    /// gather of a quantized `token_embd`); every index is checked `< n` first.
    pub fn dequantize_rows(&self, rows: &[u32]) -> Result<Vec<f32>> {
        if let Some((position, &index)) = rows.iter().enumerate().find(|(_, r)| **r as usize >= self.n) {
            return Err(Error::QuantRowOutOfRange { index: index as usize, position, rows: self.n });
        }
        let mut w = vec![0f32; rows.len() * self.k];
        let gather = |(row, &j): (&mut [f32], &u32)| self.row_into(j as usize, row);
        if rows.len() >= 16 {
            w.par_chunks_mut(self.k).zip(rows).for_each(gather);
        } else {
            w.chunks_mut(self.k).zip(rows).for_each(gather);
        }
        Ok(w)
    }

    /// One line for the start-up log: per type, the kernel and the instruction set it runs on,
    /// e.g. `Q4_1: 16-bit activations, AVX-512 VNNI` (with AMX: which products run on the tile unit).
    pub fn describe(&self) -> String {
        let isa = match Isa::best().quant() {
            Isa::Amx => format!("{} for products of over {DECODE_ROWS} rows, {} below", Isa::Amx, Isa::Avx512Vnni),
            other => other.describe().to_string(),
        };
        let parts: Vec<String> =
            self.types().iter().map(|t| format!("{}: 16-bit activations, {isa}", t.name())).collect();
        parts.join("; ")
    }

    /// Dequantizes output row `j < n` into `out` (`k` values).
    fn row_into(&self, mut j: usize, out: &mut [f32]) {
        for s in self.segs.iter() {
            if j >= s.n {
                j -= s.n;
                continue;
            }
            let l = layout(s.qt);
            let rec = (self.k / l.sb) * l.bytes;
            let tile = &s.tiles[(j / TN) * rec..][..rec];
            for (r, o) in tile.chunks_exact(l.bytes).zip(out.chunks_exact_mut(l.sb)) {
                dequant::values(s.qt, &layout::read_parts(s.qt, r, j % TN), o);
            }
            return;
        }
    }

    /// The segments as the kernels see them, with their first output columns.
    fn seg_views(&self) -> Vec<Seg<'_>> {
        let mut col0 = 0;
        self.segs
            .iter()
            .map(|s| {
                let v = Seg { qt: s.qt, tiles: &s.tiles, n: s.n, col0 };
                col0 += s.n;
                v
            })
            .collect()
    }

    /// [`QuantMatrix::plan`]: on one thread the one kept for `m` rows, else one of the last two
    /// made when it was for the same rows and threads (a new one takes the older's place).
    fn plan_for(&self, m: usize, threads: usize) -> Arc<Plan> {
        if let Some(solo) = self.solo_plans.get(m.wrapping_sub(1)).filter(|_| threads == 1) {
            return Arc::clone(solo.get_or_init(|| Arc::new(self.plan(m, 1))));
        }
        let mut last = self.last_plans.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = last.iter().flatten().find(|p| p.m == m && p.threads == threads) {
            return Arc::clone(p);
        }
        let plan = Arc::new(self.plan(m, threads));
        last.swap(0, 1);
        last[0] = Some(Arc::clone(&plan));
        plan
    }

    /// How a product of `m` rows is cut: blocks of rows (all of them for a decode step), and in
    /// each the tiles of all segments cut into about `TASKS_PER_THREAD · threads` column ranges as
    /// equal as whole tiles allow. A range is one parallel task; it is one job, or one more for
    /// each segment boundary inside it (a job never crosses one), run one after the other, so
    /// the tasks stay even whatever the segments (q, k and v of a fused projection).
    fn plan(&self, m: usize, threads: usize) -> Plan {
        let row_bytes = 2 * self.k + self.k / 32 * std::mem::size_of::<kernel::act::Meta>() / kernel::act::PANEL;
        let mb = if m <= DECODE_ROWS {
            m
        } else {
            (X_BLOCK_BYTES / row_bytes).clamp(DECODE_ROWS, m) / kernel::act::PANEL * kernel::act::PANEL
        };
        let row_blocks: Vec<(usize, usize)> = (0..m).step_by(mb.max(1)).map(|m0| (m0, (m0 + mb).min(m))).collect();
        let tiles: Vec<usize> = self.segs.iter().map(|s| s.n.div_ceil(TN)).collect();
        let total: usize = tiles.iter().sum();
        let wanted = if threads > 1 { threads * TASKS_PER_THREAD } else { 1 };
        let chunks = wanted.div_ceil(row_blocks.len()).clamp(1, total);
        let mut jobs = Vec::with_capacity(row_blocks.len() * (chunks + tiles.len()));
        let mut tasks = Vec::with_capacity(row_blocks.len() * chunks);
        for &(m0, m1) in &row_blocks {
            for c in 0..chunks {
                // Global tiles [c·total/chunks, (c+1)·total/chunks): the chunks differ by one tile
                // at most, so that the threads' shares come out even.
                let (g0, g1) = (c * total / chunks, (c + 1) * total / chunks);
                let first = jobs.len();
                let mut base = 0;
                for (seg, &nt) in tiles.iter().enumerate() {
                    let (t0, t1) = (g0.max(base).min(base + nt) - base, g1.max(base).min(base + nt) - base);
                    if t0 < t1 {
                        jobs.push(Job { seg, t0, t1, m0, m1 });
                    }
                    base += nt;
                }
                tasks.push(first..jobs.len());
            }
        }
        Plan { m, threads, cut: kernel::Cut::new(jobs, tasks, &self.seg_views()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept plans are the ones for the rows and threads asked for: reused while they repeat
    /// (two shapes at a time), made anew when they change, shared by the weight's clones.
    #[test]
    fn the_kept_plan_follows_the_shape() -> anyhow::Result<()> {
        let w = QuantMatrix::from_bytes(QuantType::Q8_0, 40, 64, &vec![0u8; 40 * 2 * QuantType::Q8_0.block_bytes()])?;
        let a = w.plan_for(16, 2);
        anyhow::ensure!(Arc::ptr_eq(&a, &w.clone().plan_for(16, 2)), "reused, also by a clone");
        // Two shapes alternating (a step's two row groups, a row apart) both stay kept.
        let b = w.plan_for(17, 2);
        anyhow::ensure!(Arc::ptr_eq(&a, &w.plan_for(16, 2)) && Arc::ptr_eq(&b, &w.plan_for(17, 2)), "both kept");
        w.plan_for(18, 2);
        anyhow::ensure!(!Arc::ptr_eq(&a, &w.plan_for(16, 2)), "the older one gave way to a third");
        for (m, threads) in [(17, 2), (16, 1), (16, 2), (300, 3)] {
            let (got, want) = (w.plan_for(m, threads), w.plan(m, threads));
            anyhow::ensure!((got.m, got.threads) == (m, threads), "{m} rows, {threads} threads");
            anyhow::ensure!(
                got.cut.jobs() == want.cut.jobs() && got.cut.tasks() == want.cut.tasks(),
                "{m} rows, {threads} threads"
            );
        }
        Ok(())
    }

    /// A fused q/k/v as SmolLM2's (36, 12 and 12 tiles): the tasks are as even as whole tiles
    /// allow although the chunk boundaries fall inside segments, each task's jobs stay inside
    /// one segment each and follow each other, and together they take every tile once.
    #[test]
    fn tasks_are_even_across_segment_boundaries() -> anyhow::Result<()> {
        let part = |n: usize| -> anyhow::Result<QuantMatrix> {
            let bytes = vec![0u8; n * 2 * QuantType::Q8_0.block_bytes()];
            Ok(QuantMatrix::from_bytes(QuantType::Q8_0, n, 64, &bytes)?)
        };
        let w = QuantMatrix::stack(vec![part(576)?, part(192)?, part(192)?])?;
        let tiles = [36, 12, 12];
        for (m, threads) in [(16, 2), (1, 2), (16, 3), (200, 2), (16, 1)] {
            let plan = w.plan(m, threads);
            let mut next = 0;
            let mut seen = vec![vec![0usize; 60]; m];
            let mut sizes = Vec::new();
            for t in plan.cut.tasks() {
                anyhow::ensure!(t.start == next && t.start < t.end, "{m} rows, {threads} threads: task {t:?}");
                next = t.end;
                let (m0, m1) = (plan.cut.jobs()[t.start].m0, plan.cut.jobs()[t.start].m1);
                let mut size = 0;
                for j in &plan.cut.jobs()[t.clone()] {
                    anyhow::ensure!(j.t1 <= tiles[j.seg] && (j.m0, j.m1) == (m0, m1), "job {j:?}");
                    let base: usize = tiles[..j.seg].iter().sum();
                    for tile in base + j.t0..base + j.t1 {
                        seen[j.m0..j.m1].iter_mut().for_each(|r| r[tile] += 1);
                    }
                    size += j.t1 - j.t0;
                }
                sizes.push(size);
            }
            anyhow::ensure!(next == plan.cut.jobs().len(), "the tasks leave jobs out");
            anyhow::ensure!(seen.iter().flatten().all(|&c| c == 1), "{m} rows: every tile of every row once");
            let (lo, hi) = (sizes.iter().min().copied(), sizes.iter().max().copied());
            anyhow::ensure!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{m} rows, {threads} threads: {sizes:?}");
            if threads > 1 && m == 16 {
                anyhow::ensure!(
                    plan.cut.tasks().len() == threads * TASKS_PER_THREAD,
                    "{} tasks",
                    plan.cut.tasks().len()
                );
            }
        }
        Ok(())
    }
}
