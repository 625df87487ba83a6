//! The launch plan of the segmented LoRA kernels, computed on the host from the step's mapping
//! and the layer's slots: which tiles, which slots at what true rank per slice, how K is split,
//! how big the grids are, and every field of the kernels' parameters but the pointers. Pure data
//! in, data out, so it is tested on every machine; the CUDA glue only fills in device addresses,
//! and the host emulation fills in buffer references, from the same plan.
//!
//! One plan serves a fused layer (qkv, gate_up) in one launch per kernel: the slices are
//! `blockIdx.y`. A step with more than [`MAX_SEGS`] adapters is planned as several launches, each
//! covering whole segments.

use multilora_kernels::params::{
    EXPAND_COLS_PER_THREAD, EXPAND_THREADS, ExpandParams, MAX_RANK, MAX_SEGS, MAX_SLICES, SHRINK_WARPS, ShrinkParams,
    Tile,
};

use crate::error::{Error, Result};
use crate::mapping::LoraMapping;
use crate::slots::LoraSlots;

/// Blocks a shrink launch aims for before splitting K (a little over the SMs of an H100/H200).
pub(crate) const TARGET_BLOCKS: usize = 256;
/// The shortest stretch of K a split covers (elements).
pub(crate) const MIN_K_CHUNK: usize = 512;
/// K chunks are a multiple of this (the shrink kernel's unrolled stride: 4 loads of 32 lanes).
pub(crate) const K_CHUNK_ALIGN: usize = 128;

/// What the plan needs to know of one slice of a layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SliceShape<'a> {
    /// True rank of every slot (0: empty, or not a target of that slot's adapter).
    pub(crate) ranks: &'a [usize],
    /// Output columns of the slice.
    pub(crate) width: usize,
}

/// One launch's share of the step: a run of whole segments and their tiles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LaunchGroup {
    /// First tile and number of tiles (`gridDim.x`).
    pub(crate) tile_base: u32,
    pub(crate) num_tiles: u32,
    /// First segment; `rank[i][s]` is segment `seg_base + s`'s true rank in slice `i`.
    pub(crate) seg_base: u32,
    pub(crate) rank: [[u16; MAX_SEGS]; MAX_SLICES],
}

/// The plan of one layer call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SegmentedPlan {
    /// Per slice: the largest true rank among the step's segments (its shrink output's width).
    pub(crate) active: Vec<usize>,
    /// Per slice: its first column in a shared shrink buffer of `s_width` columns.
    pub(crate) s_offsets: Vec<usize>,
    /// Columns of the shared shrink buffer (the sum of `active`).
    pub(crate) s_width: usize,
    /// K-split partials of the shrink, and the elements of K each covers.
    pub(crate) k_split: usize,
    pub(crate) k_chunk: usize,
    /// Rank groups of [`SHRINK_WARPS`] ranks.
    pub(crate) rank_groups: usize,
    /// Column chunks of the widest slice for the expand.
    pub(crate) col_chunks: usize,
    pub(crate) groups: Vec<LaunchGroup>,
    in_features: usize,
    max_rank: usize,
    widths: Vec<usize>,
}

/// Pointers of a shrink launch: the input, the mapping's device rows and tiles, A and the output
/// per slice.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ShrinkPtrs {
    pub(crate) x: u64,
    pub(crate) x_stride: usize,
    pub(crate) rows: u64,
    pub(crate) tiles: u64,
    pub(crate) a: [u64; MAX_SLICES],
    pub(crate) out: [u64; MAX_SLICES],
    /// Elements between rows of every slice's output.
    pub(crate) out_stride: usize,
    /// Elements between K-split partials of every slice's output.
    pub(crate) out_split_stride: usize,
}

/// Pointers of an expand launch.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ExpandPtrs {
    pub(crate) y: u64,
    pub(crate) y_stride: usize,
    pub(crate) rows: u64,
    pub(crate) tiles: u64,
    pub(crate) b: [u64; MAX_SLICES],
    pub(crate) s: [u64; MAX_SLICES],
    pub(crate) s_stride: [usize; MAX_SLICES],
    pub(crate) s_split_stride: [usize; MAX_SLICES],
    /// The shrink's K split the `s` buffers hold (1 for a reduced shrink output).
    pub(crate) k_split: usize,
}

impl ShrinkPtrs {
    /// Pointers for a shrink into one shared f32 buffer `[k_split, n_lora, s_width]` at `out`,
    /// slice `i` at column `plan.s_offsets[i]`. Pointers are plain numbers here (device
    /// addresses, or the emulator's buffer references), so offsets are added in bytes.
    pub(crate) fn shared_output(
        plan: &SegmentedPlan,
        (x, x_stride): (u64, usize),
        (rows, tiles): (u64, u64),
        a: &[u64],
        out: u64,
        n_lora: usize,
    ) -> ShrinkPtrs {
        let mut p = ShrinkPtrs {
            x,
            x_stride,
            rows,
            tiles,
            out_stride: plan.s_width,
            out_split_stride: n_lora * plan.s_width,
            ..ShrinkPtrs::default()
        };
        for (i, &ptr) in a.iter().enumerate().take(MAX_SLICES) {
            p.a[i] = ptr;
            p.out[i] = out + 4 * plan.s_offsets[i] as u64;
        }
        p
    }
}

impl ExpandPtrs {
    /// Pointers for an expand reading the shared shrink buffer of [`ShrinkPtrs::shared_output`].
    pub(crate) fn shared_input(
        plan: &SegmentedPlan,
        (y, y_stride): (u64, usize),
        (rows, tiles): (u64, u64),
        b: &[u64],
        s: u64,
        n_lora: usize,
    ) -> ExpandPtrs {
        let mut p = ExpandPtrs { y, y_stride, rows, tiles, k_split: plan.k_split, ..ExpandPtrs::default() };
        for (i, &ptr) in b.iter().enumerate().take(MAX_SLICES) {
            p.b[i] = ptr;
            p.s[i] = s + 4 * plan.s_offsets[i] as u64;
            p.s_stride[i] = plan.s_width;
            p.s_split_stride[i] = n_lora * plan.s_width;
        }
        p
    }
}

/// A kernel launch: grid, block and parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Launch<P> {
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) params: P,
}

/// `v` as a kernel parameter's `u32`, or the error of `module` that says `what` does not fit.
pub(crate) fn kernel_u32(module: &str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidLayer {
        module: module.to_string(),
        reason: format!("{what} of {v} does not fit the kernels' 32-bit sizes"),
    })
}

/// [`kernel_u32`] for the LoRA kernels' plans.
pub(crate) fn u32_of(what: &str, v: usize) -> Result<u32> {
    kernel_u32("lora kernels", what, v)
}

impl SegmentedPlan {
    /// Plans a layer call over `tiles` (the mapping's) whose LoRA segments use `seg_slots` (slot of
    /// each segment, in order), for slices of `in_features` inputs and slot stride `max_rank`.
    /// `k_split` forces the shrink's K split (`Some(1)` for a reduced output); `None` picks one.
    pub(crate) fn new(
        tiles: &[Tile],
        seg_slots: &[usize],
        slices: &[SliceShape<'_>],
        in_features: usize,
        max_rank: usize,
        k_split: Option<usize>,
    ) -> Result<SegmentedPlan> {
        let bad = |reason: String| Error::InvalidLayer { module: "lora kernels".to_string(), reason };
        if slices.is_empty() || slices.len() > MAX_SLICES {
            return Err(bad(format!("{} slices in one layer; the kernels take 1 to {MAX_SLICES}", slices.len())));
        }
        if max_rank > MAX_RANK {
            return Err(bad(format!("max_lora_rank {max_rank} is above the kernels' {MAX_RANK}")));
        }
        let rank = |i: usize, seg: usize| slices[i].ranks.get(seg_slots[seg]).copied().unwrap_or(0);
        let active: Vec<usize> =
            (0..slices.len()).map(|i| (0..seg_slots.len()).map(|s| rank(i, s)).max().unwrap_or(0)).collect();
        let mut s_offsets = Vec::with_capacity(slices.len());
        let mut s_width = 0;
        for &w in &active {
            s_offsets.push(s_width);
            s_width += w;
        }
        let max_active = active.iter().copied().max().unwrap_or(0);
        let rank_groups = max_active.div_ceil(SHRINK_WARPS as usize).max(1);
        // Group whole segments, at most MAX_SEGS per launch; tiles come in segment order.
        let mut groups = Vec::new();
        let mut at = 0;
        while at < tiles.len() {
            let seg_base = tiles[at].seg as usize;
            let end =
                tiles[at..].iter().position(|t| t.seg as usize >= seg_base + MAX_SEGS).map_or(tiles.len(), |p| at + p);
            let mut table = [[0u16; MAX_SEGS]; MAX_SLICES];
            for t in &tiles[at..end] {
                let s = t.seg as usize;
                if s >= seg_slots.len() {
                    return Err(bad(format!("tile of segment {s}, but the mapping has {}", seg_slots.len())));
                }
                for (i, row) in table.iter_mut().enumerate().take(slices.len()) {
                    row[s - seg_base] = rank(i, s) as u16;
                }
            }
            groups.push(LaunchGroup {
                tile_base: u32_of("tile index", at)?,
                num_tiles: u32_of("tile count", end - at)?,
                seg_base: seg_base as u32,
                rank: table,
            });
            at = end;
        }
        let blocks = tiles.len() * slices.len() * rank_groups;
        let k_split = k_split.unwrap_or_else(|| {
            let wanted = TARGET_BLOCKS.div_ceil(blocks.max(1));
            wanted.min(in_features / MIN_K_CHUNK).max(1)
        });
        let k_chunk = in_features.div_ceil(k_split.max(1)).next_multiple_of(K_CHUNK_ALIGN).max(K_CHUNK_ALIGN);
        let k_split = in_features.div_ceil(k_chunk).max(1);
        let widths: Vec<usize> = slices.iter().map(|s| s.width).collect();
        let cols = (EXPAND_THREADS * EXPAND_COLS_PER_THREAD) as usize;
        let col_chunks = widths.iter().copied().max().unwrap_or(0).div_ceil(cols).max(1);
        Ok(SegmentedPlan {
            active,
            s_offsets,
            s_width,
            k_split,
            k_chunk,
            rank_groups,
            col_chunks,
            groups,
            in_features,
            max_rank,
            widths,
        })
    }

    /// Plans `slices` (one layer's, all of one input width and slot rank) over `mapping`.
    pub(crate) fn for_layer(
        mapping: &LoraMapping,
        slices: &[&LoraSlots],
        k_split: Option<usize>,
    ) -> Result<SegmentedPlan> {
        let first = slices.first().ok_or_else(|| Error::InvalidLayer {
            module: "lora kernels".to_string(),
            reason: "a layer call with no slices".to_string(),
        })?;
        if let Some(odd) =
            slices.iter().find(|s| s.max_rank() != first.max_rank() || s.in_features() != first.in_features())
        {
            return Err(Error::InvalidLayer {
                module: odd.module().to_string(),
                reason: format!(
                    "slices of one call must share the input and the slot rank ({}x{} vs {}x{})",
                    odd.in_features(),
                    odd.max_rank(),
                    first.in_features(),
                    first.max_rank()
                ),
            });
        }
        let seg_slots: Vec<usize> = mapping.lora_segments().map(|s| s.slot.index()).collect();
        let shapes: Vec<SliceShape<'_>> =
            slices.iter().map(|s| SliceShape { ranks: s.ranks(), width: s.out_features() }).collect();
        SegmentedPlan::new(mapping.tiles(), &seg_slots, &shapes, first.in_features(), first.max_rank(), k_split)
    }

    /// Whether any segment has work in any slice.
    pub(crate) fn has_work(&self) -> bool {
        self.s_width > 0 && !self.groups.is_empty()
    }

    fn num_slices(&self) -> usize {
        self.widths.len()
    }

    /// The shrink launches, one per group.
    pub(crate) fn shrink(&self, p: &ShrinkPtrs) -> Result<Vec<Launch<ShrinkParams>>> {
        self.groups
            .iter()
            .map(|g| {
                let mut params = ShrinkParams::zeroed();
                params.x = p.x;
                params.rows = p.rows;
                params.tiles = p.tiles;
                params.a = p.a;
                params.out = p.out;
                params.x_stride = u32_of("x stride", p.x_stride)?;
                params.in_features = u32_of("in_features", self.in_features)?;
                params.max_rank = self.max_rank as u32;
                params.num_slices = self.num_slices() as u32;
                params.out_stride = u32_of("shrink output stride", p.out_stride)?;
                params.out_split_stride = u32_of("shrink split stride", p.out_split_stride)?;
                params.k_chunk = u32_of("k chunk", self.k_chunk)?;
                params.rank_groups = self.rank_groups as u32;
                params.tile_base = g.tile_base;
                params.seg_base = g.seg_base;
                params.rank = g.rank;
                Ok(Launch {
                    grid: [
                        g.num_tiles,
                        self.num_slices() as u32,
                        u32_of("shrink grid", self.rank_groups * self.k_split)?,
                    ],
                    block: [SHRINK_WARPS * 32, 1, 1],
                    params,
                })
            })
            .collect()
    }

    /// The expand launches, one per group; slice `i` goes to columns `col_off[i]..` of `y`.
    pub(crate) fn expand(&self, p: &ExpandPtrs, col_off: &[usize]) -> Result<Vec<Launch<ExpandParams>>> {
        let mut width = [0u32; MAX_SLICES];
        let mut off = [0u32; MAX_SLICES];
        let mut s_stride = [0u32; MAX_SLICES];
        let mut s_split = [0u32; MAX_SLICES];
        for i in 0..self.num_slices() {
            width[i] = u32_of("slice width", self.widths[i])?;
            off[i] = u32_of("column offset", col_off[i])?;
            s_stride[i] = u32_of("shrink output stride", p.s_stride[i])?;
            s_split[i] = u32_of("shrink split stride", p.s_split_stride[i])?;
        }
        self.groups
            .iter()
            .map(|g| {
                let mut params = ExpandParams::zeroed();
                params.y = p.y;
                params.rows = p.rows;
                params.tiles = p.tiles;
                params.b = p.b;
                params.s = p.s;
                params.width = width;
                params.col_off = off;
                params.s_stride = s_stride;
                params.s_split_stride = s_split;
                params.y_stride = u32_of("y stride", p.y_stride)?;
                params.max_rank = self.max_rank as u32;
                params.num_slices = self.num_slices() as u32;
                params.k_split = p.k_split.max(1) as u32;
                params.tile_base = g.tile_base;
                params.seg_base = g.seg_base;
                params.rank = g.rank;
                Ok(Launch {
                    grid: [g.num_tiles, self.num_slices() as u32, u32_of("expand grid", self.col_chunks)?],
                    block: [EXPAND_THREADS, 1, 1],
                    params,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tile(slot: u32, seg: u32, start: u32, len: u32) -> Tile {
        Tile { slot, seg, start, len }
    }

    #[test]
    fn ranks_are_per_slice_and_segment() {
        // Two segments (slots 2 and 0); q targeted by both at ranks 8 and 16, v only by slot 0.
        let tiles = [tile(2, 0, 0, 3), tile(0, 1, 3, 8), tile(0, 1, 11, 1)];
        let q = [16, 0, 8, 0];
        let v = [4, 0, 0, 0];
        let slices = [SliceShape { ranks: &q, width: 64 }, SliceShape { ranks: &v, width: 32 }];
        let plan = SegmentedPlan::new(&tiles, &[2, 0], &slices, 4096, 16, None).unwrap();
        assert_eq!(plan.active, vec![16, 4]);
        assert_eq!((plan.s_offsets.clone(), plan.s_width), (vec![0, 16], 20));
        assert_eq!(plan.rank_groups, 2);
        assert_eq!(plan.groups.len(), 1);
        let g = &plan.groups[0];
        assert_eq!((g.tile_base, g.num_tiles, g.seg_base), (0, 3, 0));
        assert_eq!((g.rank[0][0], g.rank[0][1], g.rank[1][0], g.rank[1][1]), (8, 16, 0, 4));
        assert!(g.rank[2].iter().chain(&g.rank[3]).all(|&r| r == 0));
    }

    #[test]
    fn k_split_spreads_a_decode_step_and_leaves_prefill_alone() {
        let ranks = [16; 8];
        let slices = [SliceShape { ranks: &ranks, width: 4096 }];
        // Decode: 8 adapters, one tile each: 8 tiles · 2 rank groups = 16 blocks → split K.
        let decode: Vec<Tile> = (0..8).map(|s| tile(s, s, s * 8, 8)).collect();
        let seg_slots: Vec<usize> = (0..8).collect();
        let plan = SegmentedPlan::new(&decode, &seg_slots, &slices, 4096, 16, None).unwrap();
        assert_eq!((plan.k_split, plan.k_chunk), (8, 512));
        let launches = plan
            .shrink(&ShrinkPtrs { out_stride: 16, out_split_stride: 64 * 16, x_stride: 4096, ..Default::default() })
            .unwrap();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].grid, [8, 1, 16]);
        assert_eq!(launches[0].block, [256, 1, 1]);
        assert_eq!(launches[0].params.k_chunk, 512);
        // Prefill: 256 tiles already fill the device.
        let prefill: Vec<Tile> = (0..256).map(|t| tile(0, 0, t * 8, 8)).collect();
        let plan = SegmentedPlan::new(&prefill, &[0], &slices, 4096, 16, None).unwrap();
        assert_eq!(plan.k_split, 1);
        assert_eq!(plan.k_chunk, 4096);
        // A forced split of 1, and an odd K: one chunk covers it all, rounded to the kernel's stride.
        let plan = SegmentedPlan::new(&decode, &seg_slots, &slices, 1000, 16, Some(1)).unwrap();
        assert_eq!((plan.k_split, plan.k_chunk), (1, 1024));
        // Small K never splits below MIN_K_CHUNK.
        let plan = SegmentedPlan::new(&decode, &seg_slots, &slices, 700, 16, None).unwrap();
        assert_eq!(plan.k_split, 1);
    }

    #[test]
    fn many_adapters_are_split_into_launches_of_whole_segments() {
        // 150 one-row segments: launches of 64, 64 and 22 segments.
        let tiles: Vec<Tile> = (0..150).map(|s| tile(s, s, s, 1)).collect();
        let seg_slots: Vec<usize> = (0..150).collect();
        let ranks: Vec<usize> = (0..150).map(|s| 1 + s % 16).collect();
        let slices = [SliceShape { ranks: &ranks, width: 1024 }];
        let plan = SegmentedPlan::new(&tiles, &seg_slots, &slices, 1024, 16, None).unwrap();
        let spans: Vec<(u32, u32, u32)> = plan.groups.iter().map(|g| (g.tile_base, g.num_tiles, g.seg_base)).collect();
        assert_eq!(spans, vec![(0, 64, 0), (64, 64, 64), (128, 22, 128)]);
        assert_eq!(plan.groups[1].rank[0][5], (1 + 69 % 16) as u16);
        let launches = plan.expand(&ExpandPtrs { y_stride: 1024, ..Default::default() }, &[0]).unwrap();
        assert_eq!(launches.iter().map(|l| l.grid).collect::<Vec<_>>(), vec![[64, 1, 1], [64, 1, 1], [22, 1, 1]]);
        assert!(launches.iter().all(|l| l.params.tile_base + l.grid[0] <= 150));
    }

    #[test]
    fn expand_grid_covers_the_widest_slice() {
        let ranks = [8];
        // qkv of Llama-3-8B: 4096 + 1024 + 1024 columns; 1024 columns per block.
        let slices = [
            SliceShape { ranks: &ranks, width: 4096 },
            SliceShape { ranks: &ranks, width: 1024 },
            SliceShape { ranks: &ranks, width: 1024 },
        ];
        let plan = SegmentedPlan::new(&[tile(0, 0, 0, 5)], &[0], &slices, 4096, 8, None).unwrap();
        let l =
            plan.expand(&ExpandPtrs { y_stride: 6144, k_split: 4, ..Default::default() }, &[0, 4096, 5120]).unwrap();
        assert_eq!(l[0].grid, [1, 3, 4]);
        assert_eq!(l[0].block, [128, 1, 1]);
        assert_eq!(&l[0].params.width[..3], &[4096, 1024, 1024]);
        assert_eq!(&l[0].params.col_off[..3], &[0, 4096, 5120]);
        assert_eq!(l[0].params.k_split, 4);
    }

    #[test]
    fn refuses_what_the_kernels_cannot_do() {
        let r = [8];
        let s = SliceShape { ranks: &r, width: 8 };
        assert!(SegmentedPlan::new(&[], &[], &[s; 5], 8, 8, None).is_err());
        assert!(SegmentedPlan::new(&[], &[], &[], 8, 8, None).is_err());
        let e = SegmentedPlan::new(&[], &[], &[s], 8, 1024, None).unwrap_err();
        assert!(e.to_string().contains("max_lora_rank 1024"), "{e}");
        // No tiles: nothing to launch.
        let plan = SegmentedPlan::new(&[], &[], &[s], 8, 8, None).unwrap();
        assert!(!plan.has_work());
    }
}
