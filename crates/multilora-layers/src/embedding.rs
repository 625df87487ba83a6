//! `LoraEmbedding`: the input embedding (a tensor, or GGUF blocks dequantized row by row as tokens
//! look them up) plus PEFT's embedding LoRA (`lora_embedding_A: [r, vocab]`,
//! `lora_embedding_B: [hidden, r]`).
//!
//! For a token `t` of a row with slot `k`: `y = E[t, :] + B_k · A_k[:, t]`. The "shrink" of an
//! embedding is a gather — A is stored transposed, `[max_loras, vocab, max_rank]`, so a token's
//! column is one contiguous row — and the expand is the same segmented op the linears use.

use candle_core::{DType, Tensor};
use multilora_adapter::{LoraAdapter, ModuleId, SlotSink};
use multilora_types::SlotId;

use crate::error::{Error, Result};
use crate::linear::LinearWeight;
use crate::mapping::LoraMapping;
use crate::ops::expand::lora_expand;
use crate::slots::{LoraSlots, SlotConfig};

/// An embedding table with per-slot LoRA deltas.
#[derive(Clone, Debug)]
pub struct LoraEmbedding {
    weight: LinearWeight,
    lora: Option<LoraSlots>,
    /// The dtype rows come out in (the table's own unless set).
    out_dtype: DType,
}

impl LoraEmbedding {
    /// An embedding over `weight: [vocab, hidden]`; `lora: None` means no slot buffers.
    pub fn new(weight: Tensor, lora: Option<&SlotConfig>) -> Result<LoraEmbedding> {
        let id = ModuleId::embed_tokens();
        weight.dims2().map_err(|_| Error::shape(id, "weight", weight.dims(), &[0, 0]))?;
        LoraEmbedding::from_weight(LinearWeight::Dense(weight), lora)
    }

    /// An embedding over a table as the model read it: a tensor, or GGUF blocks whose rows are
    /// dequantized as tokens look them up (rows come out in f32 unless set otherwise).
    pub fn from_weight(weight: LinearWeight, lora: Option<&SlotConfig>) -> Result<LoraEmbedding> {
        let (vocab, hidden) = weight.dims()?;
        let id = ModuleId::embed_tokens();
        let lora = match lora {
            Some(cfg) if cfg.max_loras > 0 => Some(LoraSlots::zeros_embedding(id, vocab, hidden, cfg)?),
            _ => None,
        };
        let out_dtype = match &weight {
            LinearWeight::Dense(t) => t.dtype(),
            _ => DType::F32,
        };
        Ok(LoraEmbedding { weight, lora, out_dtype })
    }

    /// Rows come out in `dtype` (e.g. f32 activations over a bf16 table, which stays bf16); the
    /// LoRA deltas are added in it.
    pub fn output_dtype(mut self, dtype: DType) -> LoraEmbedding {
        self.out_dtype = dtype;
        self
    }

    /// `ids: [rows]` (u32, or `[..]` flattened) → `[rows, hidden]`.
    pub fn forward(&self, ids: &Tensor, mapping: &LoraMapping) -> Result<Tensor> {
        let ids = ids.flatten_all()?;
        let y = match &self.weight {
            LinearWeight::Dense(t) => t.index_select(&ids, 0)?,
            LinearWeight::Quant(q) => q.dequantize_rows(&ids.to_dtype(DType::U32)?.to_vec1::<u32>()?)?,
            LinearWeight::Device(q) => q.embedding(&ids)?,
        };
        let y = if y.dtype() == self.out_dtype { y } else { y.to_dtype(self.out_dtype)? };
        let Some(slots) = &self.lora else { return Ok(y) };
        if mapping.no_lora() {
            return Ok(y);
        }
        #[cfg(feature = "cuda")]
        if ids.device().is_cuda() {
            return cuda_lora(&ids, y, slots, mapping);
        }
        let s = self.shrink(&ids, slots, mapping)?;
        lora_expand(y, &[s], &[slots], mapping)
    }

    /// The gather that stands in for shrink: `s[j, 0..r] = A_k[:, id_j]`, packed in sorted order.
    fn shrink(&self, ids: &Tensor, slots: &LoraSlots, mapping: &LoraMapping) -> Result<Tensor> {
        let n = mapping.num_lora_rows();
        let width = slots.active_rank(mapping);
        let s = Tensor::zeros((n, width), DType::F32, ids.device())?;
        let Some(ids) = mapping.gather_lora_rows(ids)? else { return Ok(s) };
        for seg in mapping.lora_segments() {
            let slot = seg.slot.index();
            let r = slots.rank(slot);
            if r == 0 {
                continue;
            }
            let p = mapping.packed_start(seg);
            let rows = slots.a().get(slot)?.index_select(&ids.narrow(0, p, seg.len)?, 0)?;
            let rows = rows.narrow(1, 0, r)?.to_dtype(DType::F32)?.contiguous()?;
            s.narrow(0, p, seg.len)?.slice_set(&rows, 1, 0)?;
        }
        Ok(s)
    }

    /// The base table `[vocab, hidden]` as it was given (a tensor, or quantized blocks).
    pub fn table(&self) -> &LinearWeight {
        &self.weight
    }

    /// Whether the layer has slot buffers.
    pub fn has_lora(&self) -> bool {
        self.lora.is_some()
    }

    /// The slot buffers (A stored as `[max_loras, vocab, max_rank]`).
    pub fn lora_slots(&self) -> Option<&LoraSlots> {
        self.lora.as_ref()
    }

    fn slots_mut(&mut self) -> Result<&mut LoraSlots> {
        self.lora.as_mut().ok_or(Error::NoSlots { module: ModuleId::embed_tokens().to_string() })
    }

    /// Writes the adapter's `embed_tokens` module into `slot`, or zeroes the slot if it has none.
    pub fn write_slot(&mut self, slot: usize, adapter: &LoraAdapter) -> Result<()> {
        let wrap = |e: Error| Error::SlotWrite { slot, adapter: adapter.name().to_string(), source: Box::new(e) };
        let slots = self.slots_mut().map_err(wrap)?;
        match adapter.module(&ModuleId::embed_tokens()) {
            Some(m) => slots.write(slot, m),
            None => slots.clear(slot),
        }
        .map_err(wrap)
    }

    /// Zeroes `slot`.
    pub fn clear_slot(&mut self, slot: usize) -> Result<()> {
        self.slots_mut()?.clear(slot)
    }
}

/// The embedding's LoRA on CUDA: `y` (the gathered base rows) plus `B_k · A_k[:, id]` for every
/// LoRA row, the gather kernel writing the expand's shared buffer.
#[cfg(feature = "cuda")]
fn cuda_lora(ids: &Tensor, y: Tensor, slots: &LoraSlots, mapping: &LoraMapping) -> Result<Tensor> {
    if ids.dim(0)? != mapping.num_rows() {
        return Err(Error::RowMismatch {
            op: "lora_embedding".to_string(),
            input: ids.dim(0)?,
            mapping: mapping.num_rows(),
        });
    }
    let slices = [slots];
    let plan = crate::ops::plan::SegmentedPlan::for_layer(mapping, &slices, Some(1))?;
    if !plan.has_work() {
        return Ok(y);
    }
    let s = crate::ops::shrink::cuda::embed_shrink(ids, slots, mapping, &plan)?;
    // `y` is the rows this layer gathered, `[rows, hidden]` by construction.
    crate::ops::expand::Expand { slices: &slices, mapping }.cuda_shared_fwd(y, &plan, &s)
}

impl SlotSink for LoraEmbedding {
    fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> multilora_adapter::Result<()> {
        Ok(LoraEmbedding::write_slot(self, slot.index(), adapter)?)
    }

    fn clear_slot(&mut self, slot: SlotId) -> multilora_adapter::Result<()> {
        Ok(LoraEmbedding::clear_slot(self, slot.index())?)
    }
}
