//! The kernels' launch parameters: `#[repr(C)]` mirrors of `params.h`, field for field, and the
//! constants the host plans launches with. `tests/layout.rs` compares every size and offset with
//! what the host C++ compiler makes of the header, so the two can never drift apart.
//!
//! Pointer fields are device addresses; the host emulator reads them as buffer references
//! ([`crate::emulate::Memory`]). Sizes are in elements.

/// Slices of a fused layer one launch covers (`ML_MAX_SLICES`).
pub const MAX_SLICES: usize = 4;
/// Segments one launch covers (`ML_MAX_SEGS`); a step with more is split into launches.
pub const MAX_SEGS: usize = 64;
/// Rows of one tile (`ML_TILE_ROWS`).
pub const TILE_ROWS: usize = 8;
/// Largest rank the expand kernel can stage (`ML_MAX_RANK`).
pub const MAX_RANK: usize = 512;
/// Ranks (warps) per shrink block (`ML_SHRINK_WARPS`).
pub const SHRINK_WARPS: u32 = 8;
/// Threads per expand block (`ML_EXPAND_THREADS`).
pub const EXPAND_THREADS: u32 = 128;
/// Output columns per expand thread (`ML_EXPAND_COLS_PER_THREAD`).
pub const EXPAND_COLS_PER_THREAD: u32 = 8;
/// Warps per decode-attention block (`ML_ATTN_WARPS`).
pub const ATTN_WARPS: u32 = 4;
/// Threads per KV-write block (`ML_KV_WRITE_THREADS`).
pub const KV_WRITE_THREADS: u32 = 128;
/// Threads per BGMV expand block (`ML_BGMV_EXPAND_THREADS`), each owning 8 columns.
pub const BGMV_EXPAND_THREADS: u32 = 64;
/// Columns of one BGMV expand block (`ML_BGMV_EXPAND_COLS`).
pub const BGMV_EXPAND_COLS: usize = 512;
/// A BGMV shrink's K chunk is a multiple of this (`ML_BGMV_K_ALIGN`).
pub const BGMV_K_ALIGN: usize = 256;
/// Warps per split decode-attention block (`ML_SPLIT_WARPS`).
pub const SPLIT_WARPS: u32 = 4;
/// The most query heads one split decode-attention block covers (`ML_SPLIT_GROUP`).
pub const SPLIT_GROUP: usize = 8;
/// The query heads per block the split decode attention is built for (its `G`).
pub const SPLIT_GROUPS: [usize; 4] = [1, 2, 4, 8];
/// Tokens of one context partition of the split decode attention (`ML_SPLIT_PART_TOKENS`).
pub const SPLIT_PART_TOKENS: usize = 512;
/// The ranks the BGMV kernels are built for (`R`): a step's largest slot rank rounded up.
pub const BGMV_RANKS: [usize; 4] = [8, 16, 32, 64];

/// A field type of a parameter struct: little-endian bytes in declaration order, and zero.
trait Field: Copy {
    const ZERO: Self;
    fn put(&self, out: &mut Vec<u8>);
}

macro_rules! scalar_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            const ZERO: Self = 0;
            fn put(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
scalar_field!(u16, u32, u64);

impl<T: Field, const N: usize> Field for [T; N] {
    const ZERO: Self = [T::ZERO; N];
    fn put(&self, out: &mut Vec<u8>) {
        for v in self {
            v.put(out);
        }
    }
}

/// Declares a `#[repr(C)]` parameter struct with its C name, a zeroed value, its bytes, and its
/// field offsets (for the layout test).
macro_rules! params {
    ($(#[$m:meta])* $name:ident = $cname:literal { $($(#[$fm:meta])* $f:ident : $t:ty,)* }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name {
            $($(#[$fm])* pub $f: $t,)*
        }

        impl $name {
            /// The struct's name in `params.h`.
            pub const C_NAME: &'static str = $cname;
            /// Every field's name and byte offset, in declaration order.
            pub const FIELDS: &'static [(&'static str, usize)] =
                &[$((stringify!($f), std::mem::offset_of!($name, $f)),)*];

            /// All fields zero (null pointers, zero sizes).
            pub const fn zeroed() -> $name {
                $name { $($f: <$t as Field>::ZERO,)* }
            }

            /// The struct's bytes as the kernel reads them (the struct has no padding: every
            /// field is naturally aligned by the order of declaration).
            pub fn to_bytes(&self) -> Vec<u8> {
                let mut out = Vec::with_capacity(std::mem::size_of::<$name>());
                $(Field::put(&self.$f, &mut out);)*
                debug_assert_eq!(out.len(), std::mem::size_of::<$name>());
                out
            }
        }

        impl Default for $name {
            fn default() -> $name {
                $name::zeroed()
            }
        }
    };
}

params!(
    /// One tile of a step's LoRA rows: `len ≤ TILE_ROWS` rows of segment `seg` (slot `slot`),
    /// from packed position `start` of the mapping's sorted LoRA rows.
    Tile = "MlTile" {
        /// The adapter slot.
        slot: u32,
        /// Index of the segment in the mapping's LoRA segments.
        seg: u32,
        /// First packed position.
        start: u32,
        /// Rows.
        len: u32,
    }
);

params!(
    /// `lora_shrink_<tx>_<tw>`: `s_i[z][p][j] = Σ_{k ∈ chunk z} x[rows[p], k] · A_i[slot, j, k]`.
    ShrinkParams = "MlShrinkParams" {
        /// The layer input, `[.., x_stride]`.
        x: u64,
        /// `u32 [n_lora]`: packed position → row of `x`.
        rows: u64,
        /// The mapping's [`Tile`]s.
        tiles: u64,
        /// Per slice: A slots `[max_loras, max_rank, in_features]`.
        a: [u64; MAX_SLICES],
        /// Per slice: f32 output `[k_split][n_lora][out_stride]`, zeroed.
        out: [u64; MAX_SLICES],
        /// Elements between rows of `x`.
        x_stride: u32,
        /// Input width.
        in_features: u32,
        /// Rank stride of a slot.
        max_rank: u32,
        /// Slices (`gridDim.y`).
        num_slices: u32,
        /// Elements between rows of `out`.
        out_stride: u32,
        /// Elements between K-split partials of `out`.
        out_split_stride: u32,
        /// Elements of K per split.
        k_chunk: u32,
        /// Rank groups of [`SHRINK_WARPS`] ranks (`gridDim.z = rank_groups · k_split`).
        rank_groups: u32,
        /// First tile of the launch.
        tile_base: u32,
        /// First segment of the launch.
        seg_base: u32,
        /// True rank per slice and segment of the launch.
        rank: [[u16; MAX_SEGS]; MAX_SLICES],
    }
);

params!(
    /// `lora_expand_<tx>_<tw>`: `y[rows[p], col_off_i + c] += Σ_j (Σ_z s_i[z][p][j]) · Bᵀ_i[slot, j, c]`.
    ExpandParams = "MlExpandParams" {
        /// The layer output, `[.., y_stride]`, updated in place.
        y: u64,
        /// `u32 [n_lora]`.
        rows: u64,
        /// The mapping's [`Tile`]s.
        tiles: u64,
        /// Per slice: Bᵀ slots `[max_loras, max_rank, width_i]`.
        b: [u64; MAX_SLICES],
        /// Per slice: f32 shrink output `[k_split][n_lora][s_stride]`.
        s: [u64; MAX_SLICES],
        /// Output columns of each slice.
        width: [u32; MAX_SLICES],
        /// First column of each slice in `y`.
        col_off: [u32; MAX_SLICES],
        /// Per slice: elements between rows of `s_i`.
        s_stride: [u32; MAX_SLICES],
        /// Per slice: elements between K-split partials of `s_i`.
        s_split_stride: [u32; MAX_SLICES],
        /// Elements between rows of `y`.
        y_stride: u32,
        /// Rank stride of a slot.
        max_rank: u32,
        /// Slices (`gridDim.y`).
        num_slices: u32,
        /// Partials to sum.
        k_split: u32,
        /// First tile of the launch.
        tile_base: u32,
        /// First segment of the launch.
        seg_base: u32,
        /// True rank per slice and segment of the launch.
        rank: [[u16; MAX_SEGS]; MAX_SLICES],
    }
);

params!(
    /// `lora_embed_shrink_<tw>`: `s[p][j] = Aᵀ[slot, ids[rows[p]], j]`.
    EmbedShrinkParams = "MlEmbedShrinkParams" {
        /// `u32 [rows]`: the step's token ids.
        ids: u64,
        /// `u32 [n_lora]`.
        rows: u64,
        /// The mapping's [`Tile`]s.
        tiles: u64,
        /// `lora_embedding_A` slots transposed, `[max_loras, vocab, max_rank]`.
        a_t: u64,
        /// f32 output `[n_lora][out_stride]`, zeroed.
        out: u64,
        /// Vocabulary size.
        vocab: u32,
        /// Rank stride.
        max_rank: u32,
        /// Elements between rows of `out`.
        out_stride: u32,
        /// First tile of the launch.
        tile_base: u32,
        /// First segment of the launch.
        seg_base: u32,
        /// Unused; keeps `rank` 8-byte aligned.
        pad: u32,
        /// True rank per segment of the launch.
        rank: [u16; MAX_SEGS],
    }
);

params!(
    /// `paged_decode_<t>_d<head_dim>`: one block per (sequence, query head) over the paged cache.
    DecodeAttnParams = "MlDecodeAttnParams" {
        /// `[n, heads, head_dim]`, already scaled by `1/√head_dim`.
        q: u64,
        /// `[num_blocks · block_size, kv_heads · head_dim]`.
        k_cache: u64,
        /// Same layout as `k_cache`.
        v_cache: u64,
        /// `u32 [n, max_blocks]`.
        block_tables: u64,
        /// `u32 [n]`: context length of each sequence (≥ 1).
        ctx_lens: u64,
        /// `[n, heads · head_dim]`.
        out: u64,
        /// Query heads.
        heads: u32,
        /// KV heads (divides `heads`).
        kv_heads: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Row stride of `block_tables`.
        max_blocks: u32,
        /// Elements between sequences of `q`.
        q_stride: u32,
        /// Elements between sequences of `out`.
        out_stride: u32,
    }
);

params!(
    /// `paged_kv_write`: `cache[slots[t]] = src[t]`, one block per token (once for K, once for V).
    KvWriteParams = "MlKvWriteParams" {
        /// `[tokens, src_stride]`: the new keys (or values), in the cache's dtype.
        src: u64,
        /// `[num_rows, width]`.
        cache: u64,
        /// `u32 [tokens]`: the cache row of each token (`≥ num_rows`: written nowhere).
        slots: u64,
        /// Elements of a cache row (`kv_heads · head_dim`).
        width: u32,
        /// Elements between rows of `src`.
        src_stride: u32,
        /// Bytes per element (2 or 4).
        elem_bytes: u32,
        /// Rows of the cache.
        num_rows: u32,
    }
);

params!(
    /// `lora_shrink_bgmv_<tx>_<tw>_r<R>`: the decode-shaped shrink over every slot and row block,
    /// every element of `out` written (zeros past a slot's rank).
    BgmvShrinkParams = "MlBgmvShrinkParams" {
        /// The layer input, `[.., x_stride]`.
        x: u64,
        /// `u32 [n_lora]`: packed position → row of `x`.
        rows: u64,
        /// `u32 [2 · max_loras]`: each slot's first packed position, then its row count.
        slot_meta: u64,
        /// Per slice: A slots `[max_loras, max_rank, in_features]`.
        a: [u64; MAX_SLICES],
        /// Per slice: f32 output `[k_split][n_lora][out_stride]`.
        out: [u64; MAX_SLICES],
        /// Per slice: output columns (the largest rank of its slots).
        width: [u32; MAX_SLICES],
        /// Elements between rows of `x`.
        x_stride: u32,
        /// Input width.
        in_features: u32,
        /// Rank stride of a slot.
        max_rank: u32,
        /// Slots (`gridDim.x`).
        max_loras: u32,
        /// Elements between rows of `out`.
        out_stride: u32,
        /// Elements between K-split partials of `out`.
        out_split_stride: u32,
        /// Elements of K per split (a multiple of [`BGMV_K_ALIGN`]).
        k_chunk: u32,
        /// K splits.
        k_split: u32,
        /// True rank of each slot, per slice.
        rank: [[u16; MAX_SEGS]; MAX_SLICES],
    }
);

params!(
    /// `lora_expand_bgmv_<tx>_<tw>_r<R>`: the decode-shaped expand over every slot and row block.
    BgmvExpandParams = "MlBgmvExpandParams" {
        /// The layer output, `[.., y_stride]`, updated in place.
        y: u64,
        /// `u32 [n_lora]`.
        rows: u64,
        /// `u32 [2 · max_loras]`.
        slot_meta: u64,
        /// Per slice: Bᵀ slots `[max_loras, max_rank, width_i]`.
        b: [u64; MAX_SLICES],
        /// Per slice: f32 shrink output `[k_split][n_lora][s_stride]`.
        s: [u64; MAX_SLICES],
        /// Output columns of each slice.
        width: [u32; MAX_SLICES],
        /// First column of each slice in `y`.
        col_off: [u32; MAX_SLICES],
        /// Elements between rows of `s`.
        s_stride: u32,
        /// Elements between K-split partials of `s`.
        s_split_stride: u32,
        /// Elements between rows of `y`.
        y_stride: u32,
        /// Rank stride of a slot.
        max_rank: u32,
        /// Slots (`gridDim.x`).
        max_loras: u32,
        /// Partials to sum.
        k_split: u32,
        /// Column chunks of [`BGMV_EXPAND_COLS`] (`gridDim.z = row_blocks · col_chunks`).
        col_chunks: u32,
        /// Unused.
        pad: u32,
        /// True rank of each slot, per slice.
        rank: [[u16; MAX_SEGS]; MAX_SLICES],
    }
);

params!(
    /// `paged_decode_split_<t>_d<head_dim>` and `paged_decode_reduce_<t>_d<head_dim>`: decode
    /// attention with the context cut into partitions, one block per (sequence, KV head, head
    /// group, partition), then a reduce over the partitions.
    DecodeSplitParams = "MlDecodeSplitParams" {
        /// `[n, heads, head_dim]`, already scaled by `1/√head_dim`.
        q: u64,
        /// `[num_blocks · block_size, kv_heads · head_dim]`.
        k_cache: u64,
        /// Same layout as `k_cache`.
        v_cache: u64,
        /// `u32 [n, max_blocks]`.
        block_tables: u64,
        /// `u32 [n]`: context length of each sequence (≥ 1).
        ctx_lens: u64,
        /// `[n, heads · head_dim]`.
        out: u64,
        /// f32 `[n, heads, parts, head_dim]`: each partition's output (unused with one partition).
        part_acc: u64,
        /// f32 `[n, heads, parts, 2]`: each partition's max and sum.
        part_ml: u64,
        /// Query heads.
        heads: u32,
        /// KV heads (divides `heads`).
        kv_heads: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Row stride of `block_tables`.
        max_blocks: u32,
        /// Elements between sequences of `q`.
        q_stride: u32,
        /// Elements between sequences of `out`.
        out_stride: u32,
        /// Tokens per partition.
        part_tokens: u32,
        /// Partitions (`gridDim.z`); 1: the blocks write `out` themselves.
        parts: u32,
        /// Head groups per KV head (of the kernel's `G` query heads each).
        head_groups: u32,
        /// Unused.
        pad: u32,
    }
);

/// Threads of a fused kernel's block (`ML_FUSED_THREADS`); `add_rms_norm` runs one warp a row.
pub const FUSED_THREADS: u32 = 128;
/// Threads of a `greedy_rows` block, one block a selected row (`ML_GREEDY_THREADS`).
pub const GREEDY_THREADS: u32 = 256;

params!(
    /// `rope_kv_write_<t>`: each token's q/k/v row rotated (RoPE, halves), q scaled into `q_out`,
    /// k and v into the token's cache row; one block per token.
    RopeKvParams = "MlRopeKvParams" {
        /// `[tokens, qkv_stride]`: q (`heads · head_dim`), k, v (`kv_heads · head_dim` each).
        qkv: u64,
        /// `[tokens, head_dim / 2]`.
        cos: u64,
        /// `[tokens, head_dim / 2]`.
        sin: u64,
        /// `[tokens, heads · head_dim]`.
        q_out: u64,
        /// `[num_rows, kv_heads · head_dim]`.
        k_cache: u64,
        /// `[num_rows, kv_heads · head_dim]`.
        v_cache: u64,
        /// `u32 [tokens]`: each token's cache row (`≥ num_rows`: none).
        slots: u64,
        /// Query heads.
        heads: u32,
        /// Key / value heads.
        kv_heads: u32,
        /// Elements of a head (even).
        head_dim: u32,
        /// Elements between rows of `qkv`.
        qkv_stride: u32,
        /// Rows of each cache.
        num_rows: u32,
        /// The queries' scale, as `f32` bits (`f32::to_bits`; a `float` in C).
        q_scale: u32,
    }
);

params!(
    /// `add_rms_norm_<t>`: `sum = x + residual`, `out = sum / rms(sum) · weight`, a warp a row.
    AddNormParams = "MlAddNormParams" {
        /// `[rows, x_stride]`.
        x: u64,
        /// `[rows, residual_stride]`.
        residual: u64,
        /// `[cols]`.
        weight: u64,
        /// `[rows, cols]`: the sum, rounded to the dtype.
        sum: u64,
        /// `[rows, cols]`: the normed sum.
        out: u64,
        /// Elements of a row.
        cols: u32,
        /// Elements between rows of `x`.
        x_stride: u32,
        /// Elements between rows of `residual`.
        residual_stride: u32,
        /// Added to the mean square, as `f32` bits (a `float` in C).
        eps: u32,
    }
);

params!(
    /// `silu_mul_<t>`: `out[r, j] = silu(gu[r, j]) · gu[r, inter + j]`.
    SiluMulParams = "MlSiluMulParams" {
        /// `[rows, gu_stride]`: gate, then up.
        gu: u64,
        /// `[rows, inter]`.
        out: u64,
        /// Columns of the output.
        inter: u32,
        /// Elements between rows of `gu`.
        gu_stride: u32,
    }
);

params!(
    /// `greedy_rows_f32`: each selected row's first index of its largest logit (NaN passed
    /// over; 0 for a row of NaN alone) and that logit's log probability (NaN where the max is
    /// not finite).
    GreedyParams = "MlGreedyParams" {
        /// f32 `[.., stride]`.
        logits: u64,
        /// `u32 [count]`: the rows to take.
        rows: u64,
        /// `u32 [count, 2]`: the index, then its log probability's `f32` bits.
        out: u64,
        /// Values of a row.
        vocab: u32,
        /// Elements between rows.
        stride: u32,
    }
);
