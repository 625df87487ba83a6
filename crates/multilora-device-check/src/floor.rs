//! What each timed kernel must move at the device check's decode shapes, and the time that takes
//! at the device's memory bandwidth ([`crate::bandwidth`]; an H200's 4.8 TB/s in the tests and
//! the computed tables): the floor every kernel time is printed against.
//!
//! A floor counts each byte a kernel cannot avoid once: its inputs read once, its outputs written
//! once (read too where it accumulates). Anything a kernel reads twice, or an index it reads
//! beside the data, is above the floor; that is what `measured / floor` shows. The tables in
//! `docs/BENCHMARKS.md` ("GPU", its floors paragraph) come from these functions at
//! [`DECODE`]'s shapes; the tests below hold the two together.

/// The time `bytes` take at the floors' bandwidth ([`crate::bandwidth::bytes_per_sec`]).
pub(crate) fn floor_secs(bytes: u64) -> f64 {
    bytes as f64 / crate::bandwidth::bytes_per_sec()
}

/// A decode step's LoRA shape: rows (one new token each), adapters among them, their rank, and
/// the bytes of one activation or weight element.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeShape {
    pub(crate) rows: usize,
    pub(crate) adapters: usize,
    pub(crate) rank: usize,
    pub(crate) elem: usize,
}

/// The timed decode step: 64 rows over 8 rank-16 adapters in bf16 (the shrink writes f32).
pub(crate) const DECODE: DecodeShape = DecodeShape { rows: 64, adapters: 8, rank: 16, elem: 2 };

/// The f32 rank-wide intermediate the shrink writes and the expand reads.
const F32: usize = 4;

/// `lora_shrink` of one layer (`outs.len()` slices of input width `inp`): `x` read once, every
/// used adapter's `A` at its rank, the `[rows, rank]` f32 result of each slice written.
pub(crate) fn shrink_bytes(s: DecodeShape, inp: usize, outs: &[usize]) -> u64 {
    let n = outs.len();
    (s.rows * inp * s.elem + n * s.adapters * s.rank * inp * s.elem + n * s.rows * s.rank * F32) as u64
}

/// `lora_expand` of one layer: the shrink's results read, every used adapter's `B` at its rank,
/// and the `[rows, Σ outs]` output read and written (it accumulates).
pub(crate) fn expand_bytes(s: DecodeShape, outs: &[usize]) -> u64 {
    let total: usize = outs.iter().sum();
    (outs.len() * s.rows * s.rank * F32 + s.adapters * s.rank * total * s.elem + 2 * s.rows * total * s.elem) as u64
}

/// The base GEMM `y = x · Wᵀ` of `rows` rows through an `[out, inp]` weight.
pub(crate) fn gemm_bytes(rows: usize, inp: usize, out: usize, elem: usize) -> u64 {
    ((out * inp + rows * inp + rows * out) * elem) as u64
}

/// Writing a step's new keys and values (`rows` tokens of `kv_width`) into both caches: each
/// read once and written once. The row index `scatter_set` reads beside them is not counted.
pub(crate) fn kv_write_bytes(rows: usize, kv_width: usize, elem: usize) -> u64 {
    (2 * 2 * rows * kv_width * elem) as u64
}

/// The shapes of a decode attention call: `n` sequences of `ctx` tokens each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnShape {
    pub(crate) n: usize,
    pub(crate) ctx: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
    pub(crate) elem: usize,
}

impl AttnShape {
    /// The attention kernels' dimensions of this shape.
    pub(crate) fn dims(&self) -> multilora_layers::PagedDecodeDims {
        let a = self;
        multilora_layers::PagedDecodeDims {
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            block_size: a.block_size,
        }
    }
}

/// Paged decode attention: every context's keys and values read once per KV head (under GQA
/// a KV head's query heads share that read), the queries read, the outputs written, and the
/// block tables and context lengths (u32).
pub(crate) fn attention_bytes(a: AttnShape) -> u64 {
    let kv = 2 * a.n * a.ctx * a.kv_heads * a.head_dim * a.elem;
    let q_out = 2 * a.n * a.heads * a.head_dim * a.elem;
    let meta = a.n * (a.ctx.div_ceil(a.block_size) + 1) * 4;
    (kv + q_out + meta) as u64
}

/// Llama-3-8B's decoder layer as the LoRA kernels see it: `(name, input width, slice widths)`.
pub(crate) const LLAMA3_8B_LAYERS: [(&str, usize, &[usize]); 4] = [
    ("qkv", 4096, &[4096, 1024, 1024]),
    ("o", 4096, &[4096]),
    ("gate_up", 4096, &[14336, 14336]),
    ("down", 14336, &[4096]),
];

/// Llama-3-8B's hidden and MLP widths.
pub(crate) const LLAMA3_8B_HIDDEN: usize = 4096;
pub(crate) const LLAMA3_8B_INTERMEDIATE: usize = 14336;

/// The fused RoPE + query scale + K/V write of `a.n` tokens: each token's q, k and v read from
/// the projection's output, its angles' cos and sin read, the scaled q written, its k and v rows
/// written into the caches, its slot read.
pub(crate) fn rope_kv_bytes(a: AttnShape) -> u64 {
    let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    (a.n * ((q + 2 * kv) + a.head_dim + q + 2 * kv) * a.elem + a.n * 4) as u64
}

/// The fused residual add + RMS norm of `rows` rows of `width`: both inputs read, the sum and its
/// norm written, the norm's weight read.
pub(crate) fn add_norm_bytes(rows: usize, width: usize, elem: usize) -> u64 {
    ((4 * rows * width + width) * elem) as u64
}

/// The fused SiLU · up of `rows` rows: the gate and up halves (`2 · inter`) read, `inter` written.
pub(crate) fn silu_mul_bytes(rows: usize, inter: usize, elem: usize) -> u64 {
    (3 * rows * inter * elem) as u64
}

/// Llama-3-8B's attention at the timed shapes (32 heads over 8 KV heads of 128, blocks of 16).
pub(crate) const fn llama3_8b_attention(n: usize, ctx: usize) -> AttnShape {
    AttnShape { n, ctx, heads: 32, kv_heads: 8, head_dim: 128, block_size: 16, elem: 2 }
}

/// The attention shapes the timing section runs: the decode step's batch, and long contexts.
pub(crate) const ATTENTION_CASES: [(usize, usize); 3] = [(64, 512), (16, 2048), (1, 8192)];

/// A decode step of the bf16 Llama-3-8B-shaped model (`layers` layers, `batch` sequences at
/// context `ctx`): every weight read once (the embedding only at the batch's rows), each
/// sequence's keys and values read once per layer, and with `lora` the used adapters'
/// matrices on all seven projections. Activations are small beside these and not counted.
pub(crate) fn decode_step_bytes(layers: usize, batch: usize, ctx: usize, lora: Option<DecodeShape>) -> u64 {
    let (h, vocab, kv_width) = (4096usize, 128_256usize, 1024usize);
    let per_layer: usize = LLAMA3_8B_LAYERS.iter().map(|(_, inp, outs)| inp * outs.iter().sum::<usize>()).sum();
    let weights = (layers * per_layer + vocab * h + batch * h + 2 * layers * h + h) * 2;
    let kv = layers * batch * ctx * kv_width * 2 * 2;
    let adapters = lora.map_or(0, |s| {
        let used = s.adapters.min(batch);
        let per_layer: usize =
            LLAMA3_8B_LAYERS.iter().map(|(_, inp, outs)| outs.iter().map(|o| inp + o).sum::<usize>()).sum();
        layers * used * s.rank * per_layer * s.elem
    });
    (weights + kv + adapters) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figures `docs/BENCHMARKS.md` states, from the functions above.
    #[test]
    fn docs_table_matches_the_shapes() {
        let mb = |b: u64| (b as f64 / 1e6 * 100.0).round() / 100.0;
        let us = |b: u64| (floor_secs(b) * 1e6 * 100.0).round() / 100.0;
        let shrink: u64 = LLAMA3_8B_LAYERS.iter().map(|(_, i, o)| shrink_bytes(DECODE, *i, o)).sum();
        let expand: u64 = LLAMA3_8B_LAYERS.iter().map(|(_, _, o)| expand_bytes(DECODE, o)).sum();
        let gemm: u64 =
            LLAMA3_8B_LAYERS.iter().map(|(_, i, o)| gemm_bytes(DECODE.rows, *i, o.iter().sum(), DECODE.elem)).sum();
        assert_eq!((mb(shrink), us(shrink)), (13.4, 2.79));
        assert_eq!((mb(expand), us(expand)), (22.05, 4.59));
        assert_eq!((mb(gemm), us(gemm)), (445.12, 92.73));
        let kv = kv_write_bytes(DECODE.rows, 1024, DECODE.elem);
        assert_eq!((mb(kv), us(kv)), (0.52, 0.11));
        let attn: Vec<(f64, f64)> = ATTENTION_CASES
            .iter()
            .map(|&(n, ctx)| {
                let b = attention_bytes(llama3_8b_attention(n, ctx));
                (mb(b), us(b))
            })
            .collect();
        assert_eq!(attn, [(135.27, 28.18), (134.49, 28.02), (33.57, 6.99)]);
        let step = |batch, lora| {
            let b = decode_step_bytes(32, batch, 512, lora);
            // Microseconds.
            (floor_secs(b) * 1e6).round() as u64
        };
        assert_eq!([step(1, None), step(64, None), step(64, Some(DECODE))], [3141, 4022, 4162]);
    }

    #[test]
    fn floors_scale_with_bytes() {
        assert_eq!(floor_secs(4_800_000_000_000), 1.0);
        // GQA: the keys and values are read once per KV head, whatever the query heads.
        let a = llama3_8b_attention(1, 1024);
        let b = AttnShape { heads: 8, ..a };
        assert_eq!(attention_bytes(a) - attention_bytes(b), (2 * 24 * 128 * 2) as u64);
        // A token's fused RoPE + KV write reads q, k, v (6144 wide), cos and sin (64 each), writes
        // q (4096) and k, v (2048), reads its slot.
        assert_eq!(rope_kv_bytes(llama3_8b_attention(1, 512)), ((6144 + 128 + 4096 + 2048) * 2 + 4) as u64);
        assert_eq!(add_norm_bytes(1, 4096, 2), ((4 * 4096 + 4096) * 2) as u64);
        assert_eq!(silu_mul_bytes(1, 14336, 2), (3 * 14336 * 2) as u64);
    }
}
