//! CPU expand ([`Expand`]'s `cpu_fwd`): each segment's `[n, out_i]` product (candle's CPU GEMM on
//! strided views of the slot buffer, at the true rank) is added straight into its rows of `y` by a
//! small in-place op, so the output is never copied and no packed delta is built. The segments'
//! GEMMs are each too small for `gemm` to split over cores, so they run side by side on the rayon
//! pool.
//!
//! The layer's path ([`crate::lora_apply`]) runs `cpu_fused_fwd`: the shrink folded into the
//! expand, each (slice, segment) task computing both products, so the rank-width intermediate
//! never leaves the task.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Tensor, WithDType};

use half::{bf16, f16};

use super::Expand;
use crate::error::Result;
use crate::mapping::LoraMapping;
use crate::ops::gemm::StorageElem;
use crate::ops::{cpu_values, run_tasks};
use crate::slots::LoraSlots;
use multilora_cpu::Isa;
use multilora_cpu::float::{LORA_ROWS, lora_rows, matmul_into, matmul_t_into};

impl Expand<'_> {
    /// The CPU forward: `y` (contiguous) plus every slice's delta from the shrink outputs `s`, in
    /// place.
    pub(super) fn cpu_fwd(&self, y: &Tensor, s: &[Tensor]) -> Result<()> {
        expand_in_place(y, s, self.slices, self.mapping)
    }

    /// The layer's CPU forward, the shrink of `x: [rows, in]` folded in: `y` (contiguous) plus
    /// every LoRA row's `x · Aᵀ · Bᵀ`, in place. The crate's kernel straight on the slot buffers
    /// when `x`, `y` and the slots allow it ([`shrink_expand_fused`]), candle's GEMMs per task
    /// otherwise.
    pub(crate) fn cpu_fused_fwd(&self, x: &Tensor, y: &Tensor) -> Result<()> {
        let (slices, mapping) = (self.slices, self.mapping);
        if shrink_expand_fused(x, y, slices, mapping)? {
            return Ok(());
        }
        if let Some(xs) = mapping.gather_lora_rows(x)? {
            shrink_expand_in_place(&xs.to_dtype(DType::F32)?, y, slices, mapping)?;
        }
        Ok(())
    }
}

fn expand_in_place(y: &Tensor, s: &[Tensor], slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<()> {
    let lora_rows = mapping.lora_rows();
    // (shrink output, slots, slot, packed start, len, column offset) for every (slice, segment).
    let mut tasks = Vec::new();
    let mut work = 0;
    let mut offset = 0;
    for (t, sl) in s.iter().zip(slices) {
        for seg in mapping.lora_segments() {
            let r = sl.rank(seg.slot.index());
            if r > 0 {
                work += seg.len * r * sl.out_features();
                tasks.push((t, *sl, seg.slot.index(), mapping.packed_start(seg), seg.len, offset));
            }
        }
        offset += sl.out_features();
    }
    // Each task adds into its own rows and columns; the in-place op takes the output's write
    // lock only for the add itself, so the GEMMs of different segments overlap.
    run_tasks(&tasks, work, |&(t, sl, slot, p, len, col_offset)| {
        if let Some(d) = super::segment_delta(t, sl, slot, p, len, false)? {
            y.inplace_op2(&d, &AddRows { rows: &lora_rows[p..p + len], col_offset })?;
        }
        Ok(())
    })?;
    Ok(())
}

/// Shrink and expand fused per segment, for a layer's forward on the CPU: each (slice, segment)
/// task computes `x_seg · Aᵀ` and at once `· Bᵀ`, adding into `y`, so the whole LoRA part is one
/// parallel phase and the rank-width intermediate never leaves the task. `xs` are the gathered
/// LoRA rows (`[lora_rows, in]`, f32).
fn shrink_expand_in_place(xs: &Tensor, y: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<()> {
    let lora_rows = mapping.lora_rows();
    let in_features = xs.dim(1)?;
    let mut tasks = Vec::new();
    let mut work = 0;
    let mut offset = 0;
    for sl in slices {
        for seg in mapping.lora_segments() {
            let r = sl.rank(seg.slot.index());
            if r > 0 {
                work += seg.len * r * (in_features + sl.out_features());
                tasks.push((*sl, seg.slot.index(), mapping.packed_start(seg), seg.len, offset));
            }
        }
        offset += sl.out_features();
    }
    run_tasks(&tasks, work, |&(sl, slot, p, len, col_offset)| {
        let Some((a, b)) = sl.slot_ab(slot)? else { return Ok(()) };
        let s = xs.narrow(0, p, len)?.matmul(&a.to_dtype(candle_core::DType::F32)?.t()?)?;
        let d = s.matmul(&b.to_dtype(candle_core::DType::F32)?.t()?)?;
        y.inplace_op2(&d, &AddRows { rows: &lora_rows[p..p + len], col_offset })?;
        Ok(())
    })?;
    Ok(())
}

/// The fast case of [`shrink_expand_in_place`] on plain slices (`x` and `y` f32, the slots f32,
/// bf16 or f16, widened as they are read), as one in-place op on `y`, reading the LoRA rows of
/// `x` (`[rows, in]`, not gathered) in place, a run of consecutive rows at a time (a prefill
/// sequence is one run): each
/// (slice, segment) task owns its rows' columns of that slice in `y` and runs both products with
/// the crate's kernel straight on the slot buffers at the true rank (`x_seg · Aᵀ`, then `· Bᵀ`
/// as outer products over the rank-major `Bᵀ`), [`DELTA_ROWS`] rows at a time through a small
/// scratch block it adds into its rows. No candle op runs per segment, and no delta as large as
/// the output is allocated and added in a second pass. Returns `false`, doing nothing, when `x`
/// or `y` is not f32 or the slots are not all of one of those dtypes.
fn shrink_expand_fused(x: &Tensor, y: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<bool> {
    let Some(first) = slices.first() else { return Ok(true) };
    let dt = first.a().dtype();
    let same = slices.iter().all(|s| s.a().dtype() == dt && s.b().dtype() == dt);
    if x.dtype() != DType::F32 || y.dtype() != DType::F32 || !same {
        return Ok(false);
    }
    match dt {
        DType::F32 => shrink_expand_with::<f32>(x, y, slices, mapping),
        DType::BF16 => shrink_expand_with::<bf16>(x, y, slices, mapping),
        DType::F16 => shrink_expand_with::<f16>(x, y, slices, mapping),
        _ => Ok(false),
    }
}

/// [`shrink_expand_fused`] with slots of element `E`.
fn shrink_expand_with<E: StorageElem>(
    x: &Tensor,
    y: &Tensor,
    slices: &[&LoraSlots],
    mapping: &LoraMapping,
) -> Result<bool> {
    let xs = x.contiguous()?;
    let (rows, in_features) = xs.dims2()?;
    let (x_guard, x_layout) = xs.storage_and_layout();
    let Some(x) = cpu_values::<f32>(&x_guard, x_layout).and_then(|v| v.get(..rows * in_features)) else {
        return Ok(false);
    };
    if rows != mapping.num_rows() {
        return Ok(false);
    }
    let guards: Vec<_> = slices.iter().map(|s| (s.a().storage_and_layout(), s.b().storage_and_layout())).collect();
    let mut ab = Vec::with_capacity(slices.len());
    for ((a, al), (b, bl)) in &guards {
        let (Some(a), Some(b)) = (cpu_values::<E>(a, al), cpu_values::<E>(b, bl)) else { return Ok(false) };
        ab.push((a, b));
    }
    let mut tasks = Vec::with_capacity(slices.len() * mapping.lora_segments().len());
    let mut work = 0;
    for (i, sl) in slices.iter().enumerate() {
        for seg in mapping.lora_segments() {
            let r = sl.rank(seg.slot.index());
            if r > 0 {
                work += seg.len * r * (in_features + sl.out_features());
                tasks.push(Task { slice: i, slot: seg.slot.index(), start: mapping.packed_start(seg), len: seg.len });
            }
        }
    }
    let op = AddDeltas { x, in_features, ab, slices, tasks, rows: mapping.lora_rows(), work };
    y.inplace_op1(&op)?;
    drop(op);
    drop(guards);
    drop(x_guard);
    Ok(true)
}

thread_local! {
    /// Each compute thread's shrink output and delta block, reused from task to task (fresh
    /// allocations of a prefill's blocks would each cost page faults).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Rows of a segment whose delta is computed at a time into a task's scratch block (which stays
/// in L2 for the widest projections) before it is added into `y`.
const DELTA_ROWS: usize = 24;

/// One (slice, segment) product: the segment's entries `start..start + len` of the mapping's
/// LoRA rows, through slot `slot` of slice `slice`.
#[derive(Clone, Copy, Debug)]
struct Task {
    slice: usize,
    slot: usize,
    start: usize,
    len: usize,
}

/// The in-place op of [`shrink_expand_fused`]: `y[rows[start + j], offset + c] += (x[rows[start + j]]
/// · Aᵀ · Bᵀ)[c]` for every task (`x` all rows, `[rows, in]`).
struct AddDeltas<'a, E> {
    x: &'a [f32],
    in_features: usize,
    ab: Vec<(&'a [E], &'a [E])>,
    slices: &'a [&'a LoraSlots],
    tasks: Vec<Task>,
    rows: &'a [u32],
    work: usize,
}

impl<E: StorageElem> AddDeltas<'_, E> {
    /// Runs one task into its cells of `y` (one per row of the segment, in order).
    fn run(&self, t: &Task, cells: &mut [&mut [f32]]) {
        let sl = self.slices[t.slice];
        let (a, b) = self.ab[t.slice];
        let (k, r, max_r, out) = (self.in_features, sl.rank(t.slot), sl.max_rank(), sl.out_features());
        // A[slot, 0..r, :] is `r` rows of `in`; Bᵀ[slot, 0..r, :] is `r` rows of `out`.
        let a = &a[t.slot * max_r * k..][..r * k];
        let bt = &b[t.slot * max_r * out..][..r * out];
        let rows = &self.rows[t.start..t.start + t.len];
        if rows.len() <= LORA_ROWS {
            // A decode step's segment: both products in one pass over the slot.
            let mut xs: [&[f32]; LORA_ROWS] = [&[]; LORA_ROWS];
            for (x, &row) in xs.iter_mut().zip(rows) {
                *x = &self.x[row as usize * k..][..k];
            }
            SCRATCH.with_borrow_mut(|(s, _)| {
                s.resize(rows.len() * r, 0.0);
                lora_rows(Isa::best(), &xs[..rows.len()], (a, bt, r), cells, s);
            });
            return;
        }
        SCRATCH.with_borrow_mut(|(s, d)| {
            s.resize(t.len * r, 0.0);
            d.resize(t.len.min(DELTA_ROWS) * out, 0.0);
            // x · Aᵀ, one run of consecutive rows at a time.
            let mut j = 0;
            while j < rows.len() {
                let r0 = rows[j] as usize;
                let run = rows[j..].iter().enumerate().take_while(|&(q, &row)| row as usize == r0 + q).count();
                matmul_t_into(&self.x[r0 * k..], k, a, k, (run, r, k), &mut s[j * r..], r);
                j += run;
            }
            for (j0, chunk) in (0..t.len).step_by(DELTA_ROWS).zip(cells.chunks_mut(DELTA_ROWS)) {
                let n = chunk.len();
                matmul_into(&s[j0 * r..], r, bt, out, (n, out, r), d, out, false);
                for (cell, delta) in chunk.iter_mut().zip(d.chunks_exact(out)) {
                    // Two plain slices of equal length: the compiler vectorises the add.
                    for (o, &v) in cell.iter_mut().zip(delta) {
                        *o += v;
                    }
                }
            }
        });
    }
}

impl<E: StorageElem> InplaceOp1 for AddDeltas<'_, E> {
    fn name(&self) -> &'static str {
        "lora-add-deltas"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(dst) = storage else {
            candle_core::bail!("lora deltas: the output must be f32, got {:?}", storage.dtype());
        };
        let (n, width) = layout.shape().dims2()?;
        let total: usize = self.slices.iter().map(|s| s.out_features()).sum();
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("lora deltas: the output must be contiguous");
        };
        if total != width || end - start != n * width {
            candle_core::bail!("lora deltas: output [{n}, {width}] for slices {total} wide");
        }
        if self.x.len() < n * self.in_features {
            candle_core::bail!("lora deltas: {} input values for {n} rows of {}", self.x.len(), self.in_features);
        }
        // Each row cut at the slices' offsets: cells[row · slices + slice], each handed to one task.
        let ns = self.slices.len();
        let mut cells: Vec<Option<&mut [f32]>> = Vec::with_capacity(n * ns);
        for mut row in dst[start..end].chunks_exact_mut(width.max(1)) {
            for s in self.slices {
                let (cell, rest) = row.split_at_mut(s.out_features());
                cells.push(Some(cell));
                row = rest;
            }
        }
        // Every task's cells, task after task, then cut into each task's run of them.
        let mut mine: Vec<&mut [f32]> = Vec::with_capacity(self.tasks.iter().map(|t| t.len).sum());
        for t in &self.tasks {
            let Some(rows) = self.rows.get(t.start..t.start + t.len) else {
                candle_core::bail!("lora deltas: a segment of {} rows past the mapping's {}", t.len, self.rows.len());
            };
            for &row in rows {
                // Past the last row the index is past the cells (`t.slice < ns`).
                let Some(cell) = cells.get_mut(row as usize * ns + t.slice).and_then(Option::take) else {
                    candle_core::bail!("lora deltas: row {row} of {n} missing or in two segments");
                };
                mine.push(cell);
            }
        }
        let mut jobs = Vec::with_capacity(self.tasks.len());
        let mut rest = mine.as_mut_slice();
        for t in &self.tasks {
            let (cells, tail) = rest.split_at_mut(t.len);
            jobs.push((t, cells));
            rest = tail;
        }
        if self.work < crate::ops::PARALLEL_WORK || jobs.len() < 2 {
            jobs.into_iter().for_each(|(t, mine)| self.run(t, mine));
        } else {
            multilora_cpu::pool::for_each_part(jobs, |_, (t, mine)| self.run(t, mine));
        }
        Ok(())
    }
}

/// `dst[rows[j], col_offset + c] += src[j, c]`, with `dst: [rows, width]` contiguous and
/// `src: [rows.len(), w]` f32 contiguous; the sum is done in f32 and rounded once.
#[derive(Debug)]
struct AddRows<'a> {
    rows: &'a [u32],
    col_offset: usize,
}

impl AddRows<'_> {
    /// Adds `src` into `dst`; `add` combines one output element with one f32 delta.
    fn run<T>(
        &self,
        dst: &mut [T],
        dst_l: &Layout,
        src: &[f32],
        src_l: &Layout,
        add: impl Fn(&mut T, f32),
    ) -> candle_core::Result<()> {
        let (n, width) = dst_l.shape().dims2()?;
        let (m, w) = src_l.shape().dims2()?;
        if !dst_l.is_contiguous() || !src_l.is_contiguous() {
            candle_core::bail!("add_rows: both operands must be contiguous");
        }
        if m != self.rows.len() || self.col_offset + w > width {
            candle_core::bail!(
                "add_rows: source [{m}, {w}] does not fit {} rows at column {}",
                self.rows.len(),
                self.col_offset
            );
        }
        let dst = &mut dst[dst_l.start_offset()..];
        let src = &src[src_l.start_offset()..];
        for (j, &row) in self.rows.iter().enumerate() {
            let row = row as usize;
            if row >= n {
                candle_core::bail!("add_rows: row {row} out of range for {n} rows");
            }
            let start = row * width + self.col_offset;
            // Two plain slices of equal length: the compiler vectorises the f32 case.
            for (o, &v) in dst[start..start + w].iter_mut().zip(&src[j * w..(j + 1) * w]) {
                add(o, v);
            }
        }
        Ok(())
    }
}

fn add_rounded<T: WithDType>(o: &mut T, v: f32) {
    *o = T::from_f64(o.to_f64() + v as f64);
}

impl InplaceOp2 for AddRows<'_> {
    fn name(&self) -> &'static str {
        "lora-add-rows"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(src) = s2 else {
            candle_core::bail!("add_rows: the delta must be f32, got {:?}", s2.dtype());
        };
        match s1 {
            CpuStorage::F32(dst) => self.run(dst, l1, src, l2, |o, v| *o += v),
            CpuStorage::F16(dst) => self.run(dst, l1, src, l2, add_rounded),
            CpuStorage::BF16(dst) => self.run(dst, l1, src, l2, add_rounded),
            CpuStorage::F64(dst) => self.run(dst, l1, src, l2, |o, v| *o += v as f64),
            other => candle_core::bail!("add_rows: unsupported output dtype {:?}", other.dtype()),
        }
    }
}
