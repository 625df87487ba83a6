//! `LoraAdapter`: a validated adapter in memory (per-module A and B with the scale folded into B),
//! its content `Fingerprint`, and the `SlotSink` trait through which it is written into device slots.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use multilora_types::{Fingerprint, ModuleKind, SlotId};

use crate::config::AdapterConfig;
use crate::error::Result;
use crate::module::ModuleId;
use crate::shapes::ModelShapes;

/// One adapted module: `delta(x) = b · (a · x)` with PEFT's scaling already folded into `b`.
///
/// `b` is held transposed, rank-major (`b_t`), the layout the slot buffers and the CPU expand
/// read, so that placing an adapter in a slot inside a model step is a plain copy: the transpose
/// is done once, when the adapter is loaded.
#[derive(Clone, Debug)]
pub struct LoraModule {
    /// `[rank, in_features]` (for `embed_tokens`: `[rank, vocab]`).
    pub a: Tensor,
    /// `Bᵀ`: `[rank, out_features]`, multiplied by `scaling` at load, contiguous.
    pub b_t: Tensor,
    /// This module's rank (after `rank_pattern`).
    pub rank: usize,
    /// This module's alpha (after `alpha_pattern`).
    pub alpha: f64,
    /// The scale folded into `b`: `alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA.
    pub scaling: f64,
}

impl LoraModule {
    /// A module from PEFT's `a: [rank, in]` and `b: [out, rank]` (`scaling` already folded in);
    /// `b` is stored transposed.
    pub fn new(a: Tensor, b: &Tensor, rank: usize, alpha: f64, scaling: f64) -> candle_core::Result<LoraModule> {
        Ok(LoraModule { a, b_t: transposed(b)?, rank, alpha, scaling })
    }

    /// The module held in `dtype`: `A`, and `B` with `scaling` folded in (in f32), both
    /// converted and then checked to be finite there (a large scale, or values past f16's
    /// range, overflow), `B` transposed.
    pub(crate) fn held(
        a: &Tensor,
        b: &Tensor,
        (rank, alpha, scaling): (usize, f64, f64),
        dtype: DType,
    ) -> std::result::Result<LoraModule, Unheld> {
        let finite = |t: &Tensor| -> candle_core::Result<bool> {
            Ok(t.to_dtype(DType::F32)?.abs()?.max_all()?.to_scalar::<f32>()?.is_finite())
        };
        let a = a.to_dtype(dtype).map_err(|e| Unheld::Candle("convert lora_A", e))?;
        if !finite(&a).map_err(|e| Unheld::Candle("check lora_A", e))? {
            return Err(Unheld::A);
        }
        let b = b
            .to_dtype(DType::F32)
            .and_then(|b| b.affine(scaling, 0.0))
            .and_then(|b| b.to_dtype(dtype))
            .map_err(|e| Unheld::Candle("fold scaling into lora_B", e))?;
        if !scaling.is_finite() || !finite(&b).map_err(|e| Unheld::Candle("check lora_B", e))? {
            return Err(Unheld::B);
        }
        LoraModule::new(a, &b, rank, alpha, scaling).map_err(|e| Unheld::Candle("transpose lora_B", e))
    }

    /// `B` as PEFT lays it out, `[out_features, rank]`: a transposed view of `b_t`.
    pub fn b(&self) -> candle_core::Result<Tensor> {
        self.b_t.t()
    }

    /// `(in_features, out_features)` of the module, read off the tensors.
    pub fn in_out(&self) -> (usize, usize) {
        let (_, i) = self.a.dims2().unwrap_or((0, 0));
        let (_, o) = self.b_t.dims2().unwrap_or((0, 0));
        (i, o)
    }
}

/// Why [`LoraModule::held`] could not hold a module.
#[derive(Debug)]
pub(crate) enum Unheld {
    /// `A` is not finite in the dtype.
    A,
    /// `B · scaling` is not finite in the dtype (or the scale itself is not).
    B,
    /// A tensor op failed: what it was doing, and its error.
    Candle(&'static str, candle_core::Error),
}

/// `b: [rows, cols]` → a contiguous `[cols, rows]` copy: for f32, bf16 and f16 on the CPU a
/// blocked transpose (candle's strided copy of a transposed view moves one element at a time),
/// otherwise candle's.
fn transposed(b: &Tensor) -> candle_core::Result<Tensor> {
    use candle_core::CpuStorage;
    let (rows, cols) = b.dims2()?;
    if !b.device().is_cpu() || !matches!(b.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return b.t()?.contiguous();
    }
    let b = b.contiguous()?;
    let (guard, layout) = b.storage_and_layout();
    let range = layout.start_offset()..layout.start_offset() + rows * cols;
    let t = match &*guard {
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => block_transpose(&v[range], rows, cols, b.device()),
        candle_core::Storage::Cpu(CpuStorage::BF16(v)) => block_transpose(&v[range], rows, cols, b.device()),
        candle_core::Storage::Cpu(CpuStorage::F16(v)) => block_transpose(&v[range], rows, cols, b.device()),
        _ => None,
    };
    drop(guard);
    match t {
        Some(t) => t,
        None => b.t()?.contiguous(),
    }
}

/// The `[cols, rows]` transpose of `src: [rows, cols]`, `BLOCK` rows at a time (so the reads of a
/// block stay in cache while its columns are written out).
fn block_transpose<T: candle_core::WithDType>(
    src: &[T],
    rows: usize,
    cols: usize,
    dev: &candle_core::Device,
) -> Option<candle_core::Result<Tensor>> {
    const BLOCK: usize = 32;
    let mut dst = vec![T::zero(); rows * cols];
    for i0 in (0..rows).step_by(BLOCK) {
        let i1 = (i0 + BLOCK).min(rows);
        for j in 0..cols {
            for (o, i) in dst[j * rows + i0..j * rows + i1].iter_mut().zip(i0..i1) {
                *o = src[i * cols + j];
            }
        }
    }
    Some(Tensor::from_vec(dst, (cols, rows), dev))
}

/// A validated LoRA adapter held in memory (on the CPU, in the LoRA dtype).
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    name: String,
    config: AdapterConfig,
    modules: BTreeMap<ModuleId, LoraModule>,
    fingerprint: Fingerprint,
    dtype: DType,
}

impl LoraAdapter {
    /// Assembles an adapter from parts. The loader is the usual way in; this exists for adapters
    /// built in memory (tests, synthetic workloads). `b` must already carry the scaling.
    pub fn new(
        name: impl Into<String>,
        config: AdapterConfig,
        modules: BTreeMap<ModuleId, LoraModule>,
        fingerprint: Fingerprint,
    ) -> LoraAdapter {
        let dtype = modules.values().next().map(|m| m.a.dtype()).unwrap_or(DType::F32);
        LoraAdapter { name: name.into(), config, modules, fingerprint, dtype }
    }

    /// The name the adapter was loaded under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The parsed `adapter_config.json`.
    pub fn config(&self) -> &AdapterConfig {
        &self.config
    }

    /// Content fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The dtype of the held tensors.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Every adapted module, in model order.
    pub fn modules(&self) -> &BTreeMap<ModuleId, LoraModule> {
        &self.modules
    }

    /// One module, if adapted.
    pub fn module(&self, id: &ModuleId) -> Option<&LoraModule> {
        self.modules.get(id)
    }

    /// The kinds of module this adapter touches (e.g. to check a model has slots for them).
    pub fn target_kinds(&self) -> Vec<ModuleKind> {
        let mut kinds: Vec<ModuleKind> = self.modules.keys().map(|m| m.kind).collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    /// The largest rank over all modules (what a slot must hold).
    pub fn max_rank(&self) -> usize {
        self.modules.values().map(|m| m.rank).max().unwrap_or(0)
    }

    /// Bytes held at the adapter's own ranks.
    pub fn nbytes(&self) -> u64 {
        let size = self.dtype.size_in_bytes() as u64;
        self.modules
            .values()
            .map(|m| {
                let (i, o) = m.in_out();
                (m.rank * (i + o)) as u64 * size
            })
            .sum()
    }

    /// Bytes this adapter's modules occupy in slots padded to `slot_rank` with `dtype_bytes` per
    /// element (what a device slot of `max_lora_rank` costs for the modules it targets).
    pub fn nbytes_at_rank(&self, slot_rank: usize, dtype_bytes: usize) -> u64 {
        self.modules
            .values()
            .map(|m| {
                let (i, o) = m.in_out();
                (slot_rank * (i + o) * dtype_bytes) as u64
            })
            .sum()
    }
}

/// Where the store writes adapters: device slots, implemented by the model.
///
/// `write_slot` converts dtype, zero-pads the rank, copies to the device and zeroes every module
/// the adapter does not target; `clear_slot` zeroes the slot. It maps PEFT module names onto any
/// fused layout the model uses.
pub trait SlotSink {
    /// Places `adapter` in `slot`, replacing whatever was there.
    fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> Result<()>;
    /// Zeroes `slot`.
    fn clear_slot(&mut self, slot: SlotId) -> Result<()>;
}

/// A digest of a base embedding matrix `[vocab, hidden]`: blake3-256 over its values as f32
/// little-endian, row-major. The model fills [`ModelShapes::embed_digest`] with it, and the loader
/// compares an adapter's saved `embed_tokens.base_layer.weight` through the same function.
pub fn embedding_digest(embedding: &Tensor) -> candle_core::Result<[u8; 32]> {
    embedding_digest_of_rows(std::iter::once(Ok(embedding.clone())))
}

/// [`embedding_digest`] of the table whose rows are those of `blocks` in order (each a tensor of
/// whole rows): the same digest, without the whole table in memory at once (a quantized
/// embedding dequantized a block of rows at a time).
pub fn embedding_digest_of_rows(
    blocks: impl Iterator<Item = candle_core::Result<Tensor>>,
) -> candle_core::Result<[u8; 32]> {
    let mut hasher = blake3::Hasher::new();
    // The little-endian bytes of every value in order, hashed a few thousand values at a time
    // (one `update` per value costs more than the hashing of a large embedding).
    let mut buf = Vec::with_capacity(4 * 4096);
    for block in blocks {
        let values = block?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for chunk in values.chunks(4096) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            hasher.update(&buf);
        }
    }
    Ok(*hasher.finalize().as_bytes())
}

/// Shorthand used by [`ModelShapes`] users: the digest as an `Option` for `embed_digest`.
pub fn with_embedding_digest(mut shapes: ModelShapes, embedding: &Tensor) -> candle_core::Result<ModelShapes> {
    shapes.embed_digest = Some(embedding_digest(embedding)?);
    shapes.embed_dtype = Some(embedding.dtype());
    Ok(shapes)
}
