//! The kernels' entry-point names and the source module each lives in: what the host asks the
//! driver (or the emulator) for. Names are `<op>_<dtype>…`: `lora_shrink_<tx>_<tw>` and
//! `lora_expand_<tx>_<tw>` (activations `tx`, slot weights `tw`), `lora_embed_shrink_<tw>`,
//! `paged_decode_<t>_d<head_dim>`, [`PAGED_KV_WRITE`].

/// The element types the kernels are built for (all arithmetic is f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelDtype {
    /// `float`.
    F32,
    /// `__nv_bfloat16`.
    Bf16,
    /// `__half`.
    F16,
}

impl KernelDtype {
    /// The suffix used in entry-point names.
    pub fn suffix(self) -> &'static str {
        match self {
            KernelDtype::F32 => "f32",
            KernelDtype::Bf16 => "bf16",
            KernelDtype::F16 => "f16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KernelDtype::F32 => 4,
            KernelDtype::Bf16 | KernelDtype::F16 => 2,
        }
    }
}

/// A `.cu` source file: one module (one fatbin).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// `lora_shrink.cu`.
    LoraShrink,
    /// `lora_expand.cu`.
    LoraExpand,
    /// `lora_embed.cu`.
    LoraEmbed,
    /// `paged_attention.cu`.
    PagedAttention,
    /// `kv_write.cu`.
    KvWrite,
    /// `lora_bgmv.cu`.
    LoraBgmv,
    /// `paged_decode_split.cu`.
    PagedDecodeSplit,
    /// `fused.cu`.
    Fused,
}

impl Module {
    /// Every module, one per `.cu` file.
    pub const ALL: [Module; 8] = [
        Module::LoraShrink,
        Module::LoraExpand,
        Module::LoraEmbed,
        Module::PagedAttention,
        Module::KvWrite,
        Module::LoraBgmv,
        Module::PagedDecodeSplit,
        Module::Fused,
    ];

    /// A name unique to the module, under which a device caches it once loaded.
    pub fn name(self) -> &'static str {
        match self {
            Module::LoraShrink => "multilora_lora_shrink",
            Module::LoraExpand => "multilora_lora_expand",
            Module::LoraEmbed => "multilora_lora_embed",
            Module::PagedAttention => "multilora_paged_attention",
            Module::KvWrite => "multilora_kv_write",
            Module::LoraBgmv => "multilora_lora_bgmv",
            Module::PagedDecodeSplit => "multilora_paged_decode_split",
            Module::Fused => "multilora_fused",
        }
    }

    /// The module's fatbin: SASS for each of [`crate::fatbins::SASS`], PTX for newer GPUs.
    #[cfg(feature = "cuda")]
    pub fn fatbin(self) -> &'static [u8] {
        match self {
            Module::LoraShrink => crate::fatbins::LORA_SHRINK,
            Module::LoraExpand => crate::fatbins::LORA_EXPAND,
            Module::LoraEmbed => crate::fatbins::LORA_EMBED,
            Module::PagedAttention => crate::fatbins::PAGED_ATTENTION,
            Module::KvWrite => crate::fatbins::KV_WRITE,
            Module::LoraBgmv => crate::fatbins::LORA_BGMV,
            Module::PagedDecodeSplit => crate::fatbins::PAGED_DECODE_SPLIT,
            Module::Fused => crate::fatbins::FUSED,
        }
    }
}

/// `lora_shrink_<tx>_<tw>`.
pub fn lora_shrink(tx: KernelDtype, tw: KernelDtype) -> String {
    format!("lora_shrink_{}_{}", tx.suffix(), tw.suffix())
}

/// `lora_expand_<tx>_<tw>`.
pub fn lora_expand(tx: KernelDtype, tw: KernelDtype) -> String {
    format!("lora_expand_{}_{}", tx.suffix(), tw.suffix())
}

/// `lora_embed_shrink_<tw>`.
pub fn lora_embed_shrink(tw: KernelDtype) -> String {
    format!("lora_embed_shrink_{}", tw.suffix())
}

/// `lora_shrink_bgmv_<tx>_<tw>_r<rank>`: the decode-shaped shrink, built for the ranks of
/// [`crate::params::BGMV_RANKS`].
pub fn lora_shrink_bgmv(tx: KernelDtype, tw: KernelDtype, rank: usize) -> String {
    format!("lora_shrink_bgmv_{}_{}_r{rank}", tx.suffix(), tw.suffix())
}

/// `lora_expand_bgmv_<tx>_<tw>_r<rank>`: the decode-shaped expand.
pub fn lora_expand_bgmv(tx: KernelDtype, tw: KernelDtype, rank: usize) -> String {
    format!("lora_expand_bgmv_{}_{}_r{rank}", tx.suffix(), tw.suffix())
}

/// `rope_kv_write_<t>`: a decode layer's RoPE, query scale and K/V cache write in one launch.
pub fn rope_kv_write(t: KernelDtype) -> String {
    format!("rope_kv_write_{}", t.suffix())
}

/// `add_rms_norm_<t>`: the residual add and the RMS norm in one launch.
pub fn add_rms_norm(t: KernelDtype) -> String {
    format!("add_rms_norm_{}", t.suffix())
}

/// `greedy_rows_f32`: greedy picks and their logprobs from chosen f32 logit rows, in `Module::Fused`.
pub const GREEDY_ROWS: &str = "greedy_rows_f32";

/// `silu_mul_<t>`: SiLU of the gate times the up projection in one launch.
pub fn silu_mul(t: KernelDtype) -> String {
    format!("silu_mul_{}", t.suffix())
}

/// The KV-cache write (one entry for every dtype: it copies bytes).
pub const PAGED_KV_WRITE: &str = "paged_kv_write";

/// Head sizes the decode-attention kernel is built for: the multiples of 32 up to 256.
pub const DECODE_HEAD_DIMS: [usize; 8] = [32, 64, 96, 128, 160, 192, 224, 256];

/// `paged_decode_<t>_d<head_dim>`, or `None` for a head size it is not built for.
pub fn paged_decode(t: KernelDtype, head_dim: usize) -> Option<String> {
    DECODE_HEAD_DIMS.contains(&head_dim).then(|| format!("paged_decode_{}_d{head_dim}", t.suffix()))
}

/// Head sizes the split decode attention is built for (one 8-element vector a lane).
pub const SPLIT_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];

/// `(paged_decode_split_<t>_d<head_dim>_g<heads>, paged_decode_reduce_<t>_d<head_dim>)`, the
/// split kernel covering `heads` query heads per block (one of
/// [`crate::params::SPLIT_GROUPS`]), or `None` for a head size or group they are not built for.
pub fn paged_decode_split(t: KernelDtype, head_dim: usize, heads: usize) -> Option<(String, String)> {
    (SPLIT_HEAD_DIMS.contains(&head_dim) && crate::params::SPLIT_GROUPS.contains(&heads)).then(|| {
        (
            format!("paged_decode_split_{}_d{head_dim}_g{heads}", t.suffix()),
            format!("paged_decode_reduce_{}_d{head_dim}", t.suffix()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(lora_shrink(KernelDtype::Bf16, KernelDtype::F32), "lora_shrink_bf16_f32");
        assert_eq!(lora_expand(KernelDtype::F16, KernelDtype::F16), "lora_expand_f16_f16");
        assert_eq!(lora_embed_shrink(KernelDtype::Bf16), "lora_embed_shrink_bf16");
        assert_eq!(paged_decode(KernelDtype::F32, 128).as_deref(), Some("paged_decode_f32_d128"));
        assert_eq!(paged_decode(KernelDtype::F32, 80), None);
        assert_eq!(lora_expand_bgmv(KernelDtype::Bf16, KernelDtype::F16, 32), "lora_expand_bgmv_bf16_f16_r32");
        let (split, reduce) = paged_decode_split(KernelDtype::F16, 128, 4).unwrap();
        assert_eq!(
            (split.as_str(), reduce.as_str()),
            ("paged_decode_split_f16_d128_g4", "paged_decode_reduce_f16_d128")
        );
        assert_eq!(paged_decode_split(KernelDtype::F16, 96, 4), None);
        assert_eq!(paged_decode_split(KernelDtype::F16, 128, 3), None);
    }
}
