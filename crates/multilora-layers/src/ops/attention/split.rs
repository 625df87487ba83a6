//! The launch plan of the split decode attention (`paged_decode_split.cu`, flash-decoding): the
//! context cut into partitions of [`SPLIT_PART_TOKENS`] tokens, one block per (sequence, KV head,
//! group of up to [`SPLIT_GROUP`] query heads sharing it, partition), then one reduce block per
//! (sequence, head) when there is more than one partition. Pure, tested on every machine; the
//! CUDA glue fills in the pointers and the scratch buffers.

use multilora_kernels::params::{DecodeSplitParams, SPLIT_GROUP, SPLIT_GROUPS, SPLIT_PART_TOKENS, SPLIT_WARPS};

use super::PagedDecodeDims;
use crate::ops::plan::Launch;

/// Threads of a reduce block (each walks head elements, strided).
pub(crate) const REDUCE_THREADS: u32 = 128;

/// The split kernel's launch, the reduce's grid when it runs, and the scratch sizes (f32
/// elements of `part_acc` and `part_ml`; zero with one partition).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    /// Query heads per block: the kernel's `G`, the smallest of [`SPLIT_GROUPS`] that covers
    /// the heads sharing a KV head (up to [`SPLIT_GROUP`]).
    pub(crate) heads_per_block: usize,
    pub(crate) split: Launch<DecodeSplitParams>,
    pub(crate) reduce: Option<Launch<DecodeSplitParams>>,
    pub(crate) acc_len: usize,
    pub(crate) ml_len: usize,
}

/// The plan for `n` sequences whose block tables are `max_blocks` wide, or `None` for a head
/// size the split kernel is not built for. Every pointer is left null.
pub(crate) fn split_plan(n: usize, max_blocks: usize, d: PagedDecodeDims) -> Option<SplitPlan> {
    if !multilora_kernels::kernel::SPLIT_HEAD_DIMS.contains(&d.head_dim) || n == 0 {
        return None;
    }
    let group = d.heads / d.kv_heads;
    let heads_per_block = *SPLIT_GROUPS.iter().find(|&&g| g >= group.min(SPLIT_GROUP))?;
    let head_groups = group.div_ceil(heads_per_block);
    let parts = (max_blocks * d.block_size).div_ceil(SPLIT_PART_TOKENS).max(1);
    let mut p = DecodeSplitParams::zeroed();
    p.heads = d.heads as u32;
    p.kv_heads = d.kv_heads as u32;
    p.block_size = d.block_size as u32;
    p.max_blocks = max_blocks as u32;
    p.q_stride = (d.heads * d.head_dim) as u32;
    p.out_stride = (d.heads * d.head_dim) as u32;
    p.part_tokens = SPLIT_PART_TOKENS as u32;
    p.parts = parts as u32;
    p.head_groups = head_groups as u32;
    let split = Launch {
        grid: [n as u32, (d.kv_heads * head_groups) as u32, parts as u32],
        block: [SPLIT_WARPS * 32, 1, 1],
        params: p,
    };
    let scratch = if parts > 1 { n * d.heads * parts } else { 0 };
    let reduce =
        (parts > 1).then_some(Launch { grid: [n as u32, d.heads as u32, 1], block: [REDUCE_THREADS, 1, 1], params: p });
    Some(SplitPlan { heads_per_block, split, reduce, acc_len: scratch * d.head_dim, ml_len: scratch * 2 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_contexts_are_split_and_gqa_heads_grouped() {
        // Llama-3-8B: 32 heads over 8 KV heads, 8k context in blocks of 16, batch 1.
        let d = PagedDecodeDims { heads: 32, kv_heads: 8, head_dim: 128, block_size: 16 };
        let plan = split_plan(1, 512, d).unwrap();
        assert_eq!((plan.split.grid, plan.heads_per_block), ([1, 8, 16], 4));
        assert_eq!(plan.reduce.map(|r| r.grid), Some([1, 32, 1]));
        assert_eq!((plan.acc_len, plan.ml_len), (32 * 16 * 128, 32 * 16 * 2));
        // A short context: one partition, no reduce, no scratch.
        let plan = split_plan(64, 32, d).unwrap();
        assert_eq!((plan.split.grid, plan.reduce, plan.acc_len), ([64, 8, 1], None, 0));
        // 16 query heads on one KV head: two head groups.
        let d = PagedDecodeDims { heads: 16, kv_heads: 1, head_dim: 64, block_size: 16 };
        let plan = split_plan(2, 40, d).unwrap();
        assert_eq!((plan.split.grid, plan.heads_per_block), ([2, 2, 2], 8));
        // GQA 3 takes the 4-head kernel; plain multi-head attention the 1-head one.
        let gqa3 = PagedDecodeDims { heads: 12, kv_heads: 4, head_dim: 64, block_size: 16 };
        assert_eq!(split_plan(1, 4, gqa3).unwrap().heads_per_block, 4);
        let mha = PagedDecodeDims { heads: 4, kv_heads: 4, head_dim: 64, block_size: 16 };
        assert_eq!(split_plan(1, 4, mha).unwrap().heads_per_block, 1);
        assert!(split_plan(2, 40, PagedDecodeDims { head_dim: 96, ..d }).is_none());
    }
}
