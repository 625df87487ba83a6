//! The launch plan of the decode-shaped (BGMV) LoRA kernels (`lora_bgmv.cu`): a grid over every
//! slot the mapping can name and every row block the batch could hold, each block finding its
//! rows in the step's fixed-size slot table on the device and returning at once when it has none
//! (vLLM's approach). What a launch depends on is the batch size, `max_loras`, the slots' ranks
//! and the layer's shapes, never which rows use which adapter: the step's launches stay the same
//! from one step to the next (what CUDA-graph capture needs), and no memset precedes the shrink,
//! which writes every element of its output.
//!
//! Used for the fused layer path (`lora_apply`) when a step is small enough for it
//! ([`BGMV_MAX_BLOCKS`]) and every rank fits one of [`BGMV_RANKS`]; otherwise the segmented
//! (SGMV) plan of `plan.rs` runs, as for prefill.

use multilora_kernels::params::{
    BGMV_EXPAND_COLS, BGMV_EXPAND_THREADS, BGMV_K_ALIGN, BGMV_RANKS, BgmvExpandParams, BgmvShrinkParams, MAX_SEGS,
    MAX_SLICES, SHRINK_WARPS, TILE_ROWS,
};

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::mapping::LoraMapping;
use crate::ops::check_y;
use crate::ops::plan::{Launch, SliceShape, u32_of};
use crate::ops::shrink::Shrink;
use crate::slots::LoraSlots;

/// At most this many (slot, row block) pairs: past it most blocks would find no rows, and the
/// segmented kernels, whose grid follows the batch, take over.
pub(crate) const BGMV_MAX_BLOCKS: usize = 512;
/// Blocks with rows a shrink launch aims for (live slot and row-block pairs × slices × K splits).
pub(crate) const BGMV_TARGET_BLOCKS: usize = 256;

/// The plan of one layer call on the decode-shaped kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BgmvPlan {
    /// The kernels' compile-time rank: the slots' largest rank over the slices, rounded up.
    pub(crate) rank: usize,
    /// Per slice: its shrink output's columns (the largest rank of its slots).
    pub(crate) active: Vec<usize>,
    /// Per slice: its first column in the shared shrink buffer of `s_width` columns.
    pub(crate) s_offsets: Vec<usize>,
    pub(crate) s_width: usize,
    pub(crate) k_split: usize,
    pub(crate) k_chunk: usize,
    /// Row blocks of [`TILE_ROWS`] rows the batch could hold (`⌈rows / TILE_ROWS⌉`).
    pub(crate) row_blocks: usize,
    /// Column chunks of [`BGMV_EXPAND_COLS`] of the widest slice.
    pub(crate) col_chunks: usize,
    ranks: [[u16; MAX_SEGS]; MAX_SLICES],
    max_loras: usize,
    in_features: usize,
    max_rank: usize,
    widths: Vec<usize>,
}

impl BgmvPlan {
    /// Plans a call over `num_rows` batch rows and `max_loras` slots for slices of
    /// `in_features` inputs and slot stride `max_rank`, or `None` where the decode-shaped
    /// kernels do not apply (too many rows or slots, a rank above 64, or no rank at all).
    pub(crate) fn new(
        num_rows: usize,
        max_loras: usize,
        slices: &[SliceShape<'_>],
        in_features: usize,
        max_rank: usize,
    ) -> Option<BgmvPlan> {
        if slices.is_empty() || slices.len() > MAX_SLICES || max_loras == 0 || max_loras > MAX_SEGS || num_rows == 0 {
            return None;
        }
        let row_blocks = num_rows.div_ceil(TILE_ROWS);
        if row_blocks * max_loras > BGMV_MAX_BLOCKS {
            return None;
        }
        let rank_of = |i: usize, s: usize| slices[i].ranks.get(s).copied().unwrap_or(0);
        let active: Vec<usize> =
            (0..slices.len()).map(|i| (0..max_loras).map(|s| rank_of(i, s)).max().unwrap_or(0)).collect();
        let top = active.iter().copied().max().unwrap_or(0);
        let rank = *BGMV_RANKS.iter().find(|&&r| r >= top && top > 0)?;
        debug_assert!(rank.is_multiple_of(SHRINK_WARPS as usize));
        let mut ranks = [[0u16; MAX_SEGS]; MAX_SLICES];
        for (i, row) in ranks.iter_mut().enumerate().take(slices.len()) {
            for (s, r) in row.iter_mut().enumerate().take(max_loras) {
                *r = rank_of(i, s) as u16;
            }
        }
        let mut s_offsets = Vec::with_capacity(slices.len());
        let mut s_width = 0;
        for &w in &active {
            s_offsets.push(s_width);
            s_width += w;
        }
        // Rows spread over the slots fill about max(slots, row blocks) (slot, row block) pairs;
        // K is split until those reach the target, and no further (a long prefill of one
        // adapter has blocks enough without partials to sum).
        let live = max_loras.max(row_blocks) * slices.len();
        let wanted = BGMV_TARGET_BLOCKS.div_ceil(live);
        let k_split = wanted.min(in_features / BGMV_K_ALIGN).max(1);
        let k_chunk = in_features.div_ceil(k_split).next_multiple_of(BGMV_K_ALIGN).max(BGMV_K_ALIGN);
        let k_split = in_features.div_ceil(k_chunk).max(1);
        let widths: Vec<usize> = slices.iter().map(|s| s.width).collect();
        let col_chunks = widths.iter().copied().max().unwrap_or(0).div_ceil(BGMV_EXPAND_COLS).max(1);
        Some(BgmvPlan {
            rank,
            active,
            s_offsets,
            s_width,
            k_split,
            k_chunk,
            row_blocks,
            col_chunks,
            ranks,
            max_loras,
            in_features,
            max_rank,
            widths,
        })
    }

    /// Plans `slices` (one layer's, all of one input width and slot rank) over `mapping`.
    pub(crate) fn for_layer(mapping: &LoraMapping, slices: &[&LoraSlots]) -> Option<BgmvPlan> {
        let first = slices.first()?;
        if slices.iter().any(|s| s.max_rank() != first.max_rank() || s.in_features() != first.in_features()) {
            return None;
        }
        let shapes: Vec<SliceShape<'_>> =
            slices.iter().map(|s| SliceShape { ranks: s.ranks(), width: s.out_features() }).collect();
        BgmvPlan::new(mapping.num_rows(), mapping.max_loras(), &shapes, first.in_features(), first.max_rank())
    }

    /// The shrink launch into one buffer `[k_split, n_lora, s_width]` at `out` (slice `i` at
    /// column `s_offsets[i]`), every element of which it writes.
    pub(crate) fn shrink(
        &self,
        (x, x_stride): (u64, usize),
        (rows, slot_meta): (u64, u64),
        a: &[u64],
        out: u64,
        n_lora: usize,
    ) -> Result<Launch<BgmvShrinkParams>> {
        let mut p = BgmvShrinkParams::zeroed();
        p.x = x;
        p.rows = rows;
        p.slot_meta = slot_meta;
        for (i, &ptr) in a.iter().enumerate().take(MAX_SLICES) {
            p.a[i] = ptr;
            p.out[i] = out + 4 * self.s_offsets[i] as u64;
            p.width[i] = self.active[i] as u32;
        }
        p.x_stride = u32_of("x stride", x_stride)?;
        p.in_features = u32_of("in_features", self.in_features)?;
        p.max_rank = u32_of("max_rank", self.max_rank)?;
        p.max_loras = self.max_loras as u32;
        p.out_stride = u32_of("shrink output stride", self.s_width)?;
        p.out_split_stride = u32_of("shrink split stride", n_lora * self.s_width)?;
        p.k_chunk = u32_of("k chunk", self.k_chunk)?;
        p.k_split = self.k_split as u32;
        p.rank = self.ranks;
        Ok(Launch {
            grid: [
                self.max_loras as u32,
                self.widths.len() as u32,
                u32_of("shrink grid", self.row_blocks * self.k_split)?,
            ],
            block: [SHRINK_WARPS * 32, 1, 1],
            params: p,
        })
    }

    /// The expand launch reading [`BgmvPlan::shrink`]'s buffer `s`; slice `i` goes to columns
    /// `col_off[i]..` of `y`.
    pub(crate) fn expand(
        &self,
        (y, y_stride): (u64, usize),
        (rows, slot_meta): (u64, u64),
        b: &[u64],
        s: u64,
        n_lora: usize,
        col_off: &[usize],
    ) -> Result<Launch<BgmvExpandParams>> {
        let mut p = BgmvExpandParams::zeroed();
        p.y = y;
        p.rows = rows;
        p.slot_meta = slot_meta;
        for (i, &ptr) in b.iter().enumerate().take(MAX_SLICES) {
            p.b[i] = ptr;
            p.s[i] = s + 4 * self.s_offsets[i] as u64;
            p.width[i] = u32_of("slice width", self.widths[i])?;
            p.col_off[i] = u32_of("column offset", col_off[i])?;
        }
        p.s_stride = u32_of("shrink output stride", self.s_width)?;
        p.s_split_stride = u32_of("shrink split stride", n_lora * self.s_width)?;
        p.y_stride = u32_of("y stride", y_stride)?;
        p.max_rank = u32_of("max_rank", self.max_rank)?;
        p.max_loras = self.max_loras as u32;
        p.k_split = self.k_split as u32;
        p.col_chunks = self.col_chunks as u32;
        p.rank = self.ranks;
        Ok(Launch {
            grid: [
                self.max_loras as u32,
                self.widths.len() as u32,
                u32_of("expand grid", self.row_blocks * self.col_chunks)?,
            ],
            block: [BGMV_EXPAND_THREADS, 1, 1],
            params: p,
        })
    }
}

fn not_decode_shaped() -> Error {
    Error::InvalidLayer {
        module: "lora_bgmv".to_string(),
        reason: "the step is not decode-shaped (too many rows or slots, or a rank above 64)".to_string(),
    }
}

/// The decode-shaped shrink alone, as `lora_apply` runs it on CUDA (for the device check's
/// per-kernel times): `[k_split, n_lora, s_width]` f32 partial sums, or `None` when the step is
/// not decode-shaped (`lora_apply` then runs the segmented kernels). CUDA tensors only.
pub fn lora_bgmv_shrink(x: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Option<Tensor>> {
    let shrink = Shrink::new("lora_bgmv_shrink", x, slices, mapping)?;
    let Some(plan) = BgmvPlan::for_layer(mapping, slices) else { return Ok(None) };
    if mapping.no_lora() {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return Ok(Some(shrink.cuda_bgmv(x, &plan)?));
    }
    let _ = (shrink, plan);
    Err(Error::InvalidLayer {
        module: "lora_bgmv_shrink".to_string(),
        reason: format!("runs on CUDA, not {:?}", x.device()),
    })
}

/// The decode-shaped expand alone: `y += expand(s)` in place, `y` contiguous and `s` what
/// [`lora_bgmv_shrink`] returned for the same slices and mapping. CUDA tensors only.
pub fn lora_bgmv_expand(y: &Tensor, s: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<()> {
    check_y("lora_bgmv_expand", y, slices, mapping)?;
    let plan = BgmvPlan::for_layer(mapping, slices).ok_or_else(not_decode_shaped)?;
    let n = mapping.num_lora_rows();
    if s.dims() != [plan.k_split, n, plan.s_width] {
        return Err(Error::shape("lora_bgmv_expand", "shrink output", s.dims(), &[plan.k_split, n, plan.s_width]));
    }
    if !y.is_contiguous() {
        return Err(Error::InvalidLayer {
            module: "lora_bgmv_expand".to_string(),
            reason: "the output is updated in place and must be contiguous".to_string(),
        });
    }
    #[cfg(feature = "cuda")]
    if y.device().is_cuda() {
        return crate::ops::expand::cuda::bgmv_expand(y, s, &plan, slices, mapping);
    }
    Err(Error::InvalidLayer {
        module: "lora_bgmv_expand".to_string(),
        reason: format!("runs on CUDA, not {:?}", y.device()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_do_not_depend_on_the_batch_content() {
        // qkv of Llama-3-8B, 8 slots of ranks up to 16: 64 rows whatever their slots are.
        let ranks = [16, 8, 16, 4, 0, 16, 16, 12];
        let s = |w| SliceShape { ranks: &ranks, width: w };
        let plan = BgmvPlan::new(64, 8, &[s(4096), s(1024), s(1024)], 4096, 16).unwrap();
        assert_eq!((plan.rank, plan.row_blocks, plan.col_chunks), (16, 8, 8));
        assert_eq!(plan.active, vec![16, 16, 16]);
        assert_eq!(plan.k_chunk % BGMV_K_ALIGN, 0);
        assert!(plan.k_split * plan.k_chunk >= 4096 && (plan.k_split - 1) * plan.k_chunk < 4096);
        let l = plan.shrink((1, 4096), (2, 3), &[4, 5, 6], 7, 40).unwrap();
        assert_eq!(l.grid, [8, 3, (8 * plan.k_split) as u32]);
        assert_eq!(l.params.rank[0][..8], [16, 8, 16, 4, 0, 16, 16, 12]);
        let e = plan.expand((9, 6144), (2, 3), &[4, 5, 6], 7, 40, &[0, 4096, 5120]).unwrap();
        assert_eq!(e.grid, [8, 3, 64]);
        assert_eq!(e.block, [BGMV_EXPAND_THREADS, 1, 1]);
    }

    #[test]
    fn large_steps_and_ranks_take_the_segmented_kernels() {
        let ranks = [16; 8];
        let s = SliceShape { ranks: &ranks, width: 512 };
        // A 4096-row prefill of one adapter: 512 row blocks, no K split.
        let one = [16];
        let plan = BgmvPlan::new(4096, 1, &[SliceShape { ranks: &one, width: 512 }], 4096, 16).unwrap();
        assert_eq!((plan.row_blocks, plan.k_split), (512, 1));
        // 8 slots × 65 row blocks is past the limit.
        assert!(BgmvPlan::new(520, 8, &[s], 512, 16).is_none());
        assert!(BgmvPlan::new(512, 8, &[s], 512, 16).is_some());
        let big = [128; 2];
        assert!(BgmvPlan::new(4, 2, &[SliceShape { ranks: &big, width: 64 }], 512, 128).is_none());
        let none = [0; 2];
        assert!(BgmvPlan::new(4, 2, &[SliceShape { ranks: &none, width: 64 }], 512, 16).is_none());
        // Ranks 20 round up to the rank-32 kernel.
        let r20 = [20, 3];
        assert_eq!(BgmvPlan::new(4, 2, &[SliceShape { ranks: &r20, width: 64 }], 100, 32).unwrap().rank, 32);
    }
}
