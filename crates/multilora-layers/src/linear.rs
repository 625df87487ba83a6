//! `LoraLinear`: a base linear layer (plain or fused, e.g. qkv or gate_up) plus the LoRA slot
//! buffers of each module it holds.
//!
//! `forward(x, mapping)` computes `y = x · Wᵀ (+ bias)` once for every row (on the CPU with the
//! crate's kernel over the weight packed at construction in its own dtype, f32, bf16 or f16,
//! [`PackedWeight`], in f32; otherwise candle's matmul), then adds each LoRA
//! row's own `B_k · A_k · x` with the segmented ops; rows without a slot keep the base output bit for
//! bit. `merge(slot)` folds one adapter into the weight for deployments where one tenant carries
//! nearly all the traffic.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};
use multilora_adapter::{LoraAdapter, ModuleId, SlotSink};
use multilora_types::SlotId;

use crate::ReadAhead;
use crate::error::{Error, Result};
use crate::mapping::LoraMapping;
use crate::ops::gemm::PackedWeight;
use crate::ops::lora_apply;
use crate::ops::quant::QuantWeight;
use crate::slots::{LoraSlots, SlotConfig};

/// A linear layer with per-slot LoRA deltas.
#[derive(Clone, Debug)]
pub struct LoraLinear {
    base: Base,
    bias: Option<Tensor>,
    slices: Vec<(ModuleId, usize)>,
    /// One per slice; `None` when the layer has no slots.
    lora: Option<Vec<LoraSlots>>,
    merged: Option<Merged>,
}

/// A projection's base weight as a layer is built from it: a tensor, or GGUF blocks kept
/// quantized.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    /// A tensor `[out, in]`: packed for the CPU kernel when it can be (f32, bf16, f16), else
    /// multiplied by candle's matmul.
    Dense(Tensor),
    /// GGUF blocks for the crate's quantized CPU kernels ([`QuantWeight`]).
    Quant(QuantWeight),
    /// GGUF blocks on a device (CUDA), multiplied by candle's quantized matmul.
    Device(Arc<QTensor>),
}

impl LinearWeight {
    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            LinearWeight::Dense(t) => Ok(t.dims2()?),
            LinearWeight::Quant(q) => Ok(q.dims()),
            LinearWeight::Device(q) => Ok(q.shape().dims2()?),
        }
    }

    /// The weight as a tensor of its values (dequantized as ggml does, in f32, when quantized),
    /// on the device it lives on.
    pub fn dense(&self) -> Result<Tensor> {
        match self {
            LinearWeight::Dense(t) => Ok(t.clone()),
            LinearWeight::Quant(q) => q.dequantize(),
            LinearWeight::Device(q) => Ok(q.dequantize(&q.device())?),
        }
    }
}

/// The base weight: packed for the CPU kernel (f32, bf16 or f16 on the CPU), quantized blocks
/// (the crate's CPU kernels, or candle's quantized matmul on a device, one per stacked part), or
/// the tensor as given.
#[derive(Clone, Debug)]
enum Base {
    Dense(Tensor),
    Packed(PackedWeight),
    Quant(QuantWeight),
    Device(Vec<DevicePart>),
}

/// One stacked part of a device weight: its blocks, and candle's product over them, made once
/// when the layer is built (for float GGUF types `QMatMul` dequantizes: never inside a step).
#[derive(Clone, Debug)]
struct DevicePart {
    q: Arc<QTensor>,
    mm: QMatMul,
}

impl DevicePart {
    fn new(q: Arc<QTensor>) -> Result<DevicePart> {
        Ok(DevicePart { mm: QMatMul::from_arc(q.clone())?, q })
    }
}

impl Base {
    /// Packs `w` when the CPU kernel can use it; keeps it as given otherwise, or when
    /// `keep_as_given` (its storage is someone else's too, e.g. a tied embedding, and packing
    /// would copy it).
    fn new(w: Tensor, keep_as_given: bool) -> Result<Base> {
        if keep_as_given {
            return Ok(Base::Dense(w));
        }
        Ok(match PackedWeight::pack(&w)? {
            Some(p) => Base::Packed(p),
            None => Base::Dense(w),
        })
    }

    /// `x · Wᵀ` in `x`'s dtype (a packed or quantized weight computes in f32, whatever its own
    /// dtype).
    fn forward(&self, x: &Tensor, ahead: &ReadAhead) -> Result<Tensor> {
        let back =
            |y: Tensor| -> Result<Tensor> { Ok(if y.dtype() == x.dtype() { y } else { y.to_dtype(x.dtype())? }) };
        match self {
            Base::Dense(w) => crate::ops::gemm::linear(x, w),
            Base::Packed(p) => back(p.forward(x)?),
            Base::Quant(q) => back(q.forward_ahead(x, multilora_cpu::Isa::best(), ahead.ranges())?),
            Base::Device(parts) => {
                let xf = x.to_dtype(DType::F32)?;
                let ys = parts.iter().map(|p| Ok(p.mm.forward(&xf)?)).collect::<Result<Vec<_>>>()?;
                back(if ys.len() == 1 { ys.into_iter().next().unwrap_or(xf) } else { Tensor::cat(&ys, 1)? })
            }
        }
    }

    /// `(out, in)`.
    fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Base::Dense(w) => Ok(w.dims2()?),
            Base::Packed(p) => Ok(p.dims()),
            Base::Quant(q) => Ok(q.dims()),
            Base::Device(parts) => {
                let dims = parts.iter().map(|p| p.q.shape().dims2()).collect::<candle_core::Result<Vec<_>>>()?;
                Ok((dims.iter().map(|d| d.0).sum(), dims.first().map_or(0, |d| d.1)))
            }
        }
    }

    fn dense(&self) -> Result<Tensor> {
        match self {
            Base::Dense(w) => Ok(w.clone()),
            Base::Packed(p) => p.unpack(),
            Base::Quant(q) => q.dequantize(),
            Base::Device(parts) => {
                let ts = parts.iter().map(|p| Ok(p.q.dequantize(&p.q.device())?)).collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&ts, 0)?)
            }
        }
    }
}

/// The adapter folded into the weight: the slot and a copy of each slice's `(A, B)` at its rank,
/// so `unmerge` subtracts exactly what was added even if the slot was rewritten since.
#[derive(Clone, Debug)]
struct Merged {
    slot: usize,
    parts: Vec<Option<(Tensor, Tensor)>>,
}

impl LoraLinear {
    /// A layer over `weight: [out, in]` (+ `bias: [out]`). `slices` names the PEFT modules the
    /// weight holds, in output order, with their output widths (they must sum to `out`): one for a
    /// plain projection, e.g. `[(q, 4096), (k, 1024), (v, 1024)]` for a fused qkv. `lora: None`
    /// means no slot buffers (the module is not a LoRA target, or `max_loras` is 0).
    ///
    /// An f32, bf16 or f16 weight on the CPU is packed for the crate's kernel in its dtype (the
    /// layer keeps the packed copy, not the tensor); `y` comes back in `x`'s dtype.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
    ) -> Result<LoraLinear> {
        Self::build(weight, bias, slices, lora, false)
    }

    /// [`LoraLinear::new`] over a weight whose storage is shared (an `lm_head` tied to the input
    /// embedding): kept as given, never packed, so no second copy of it is made. Its product
    /// runs with [`crate::linear`], reading the weight in place.
    pub fn new_shared(
        weight: Tensor,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
    ) -> Result<LoraLinear> {
        Self::build(weight, bias, slices, lora, true)
    }

    /// [`LoraLinear::new`] over the weight whose rows are those of `parts` in order (q, k and v
    /// of a fused projection, say): on the CPU packed straight from the parts, so the fused
    /// weight is never materialised as one more copy; elsewhere concatenated.
    pub fn new_fused(
        parts: Vec<Tensor>,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
    ) -> Result<LoraLinear> {
        match PackedWeight::pack_parts(&parts)? {
            Some(p) => Self::with_base(Base::Packed(p), bias, slices, lora),
            None => Self::new(Tensor::cat(&parts, 0)?, bias, slices, lora),
        }
    }

    /// A layer over `weight` as the model read it: a tensor (as [`LoraLinear::new`]), or
    /// quantized blocks multiplied without being dequantized.
    pub fn from_weight(
        weight: LinearWeight,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
    ) -> Result<LoraLinear> {
        match weight {
            LinearWeight::Dense(t) => Self::new(t, bias, slices, lora),
            LinearWeight::Quant(q) => Self::with_base(Base::Quant(q), bias, slices, lora),
            LinearWeight::Device(q) => Self::with_base(Base::Device(vec![DevicePart::new(q)?]), bias, slices, lora),
        }
    }

    /// [`LoraLinear::new_fused`] over parts as the model read them: quantized parts stay
    /// quantized and are stacked without a copy (their types may differ); a mix of quantized and
    /// dense parts is dequantized to the dense parts' dtype.
    pub fn from_parts(
        parts: Vec<LinearWeight>,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
    ) -> Result<LoraLinear> {
        if parts.iter().all(|p| matches!(p, LinearWeight::Quant(_))) {
            let qs = parts.into_iter().filter_map(|p| if let LinearWeight::Quant(q) = p { Some(q) } else { None });
            return Self::with_base(Base::Quant(QuantWeight::stack(qs.collect())?), bias, slices, lora);
        }
        if parts.iter().all(|p| matches!(p, LinearWeight::Device(_))) {
            let qs = parts.into_iter().filter_map(|p| if let LinearWeight::Device(q) = p { Some(q) } else { None });
            let parts = qs.map(DevicePart::new).collect::<Result<Vec<_>>>()?;
            return Self::with_base(Base::Device(parts), bias, slices, lora);
        }
        let dtype = parts
            .iter()
            .find_map(|p| if let LinearWeight::Dense(t) = p { Some(t.dtype()) } else { None })
            .unwrap_or(DType::F32);
        let dense = parts.iter().map(|p| Ok(p.dense()?.to_dtype(dtype)?)).collect::<Result<Vec<_>>>()?;
        Self::new_fused(dense, bias, slices, lora)
    }

    /// Which kernel the base product runs on, in words (for the start-up log): the quantized
    /// types and instruction set, or the dense dtype.
    pub fn base_kernel(&self) -> String {
        match &self.base {
            Base::Dense(w) => format!("{:?} weights, read in place", w.dtype()),
            Base::Packed(p) => format!("{:?} weights", p.dtype()),
            Base::Quant(q) => q.describe(),
            Base::Device(parts) => {
                let types: Vec<String> = parts.iter().map(|p| format!("{:?}", p.q.dtype())).collect();
                format!("{} (candle quantized matmul)", types.join("+"))
            }
        }
    }

    /// Bytes the base weight holds (quantized blocks, or the tensor's elements).
    pub fn base_bytes(&self) -> usize {
        match &self.base {
            Base::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Base::Packed(p) => {
                let (n, k) = p.dims();
                n * k * p.dtype().size_in_bytes()
            }
            Base::Quant(q) => q.storage_bytes(),
            Base::Device(parts) => parts.iter().map(|p| p.q.storage_size_in_bytes()).sum(),
        }
    }

    fn build(
        weight: Tensor,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
        shared: bool,
    ) -> Result<LoraLinear> {
        let name = slices.first().map(|s| s.0.to_string()).unwrap_or_else(|| "linear".to_string());
        weight.dims2().map_err(|_| Error::shape(&name, "weight", weight.dims(), &[0, 0]))?;
        Self::with_base(Base::new(weight, shared)?, bias, slices, lora)
    }

    fn with_base(
        base: Base,
        bias: Option<Tensor>,
        slices: Vec<(ModuleId, usize)>,
        lora: Option<&SlotConfig>,
    ) -> Result<LoraLinear> {
        let name = slices.first().map(|s| s.0.to_string()).unwrap_or_else(|| "linear".to_string());
        let (out, inp) = base.dims()?;
        if slices.is_empty() {
            return Err(Error::InvalidLayer {
                module: name,
                reason: "a linear layer needs at least one slice".to_string(),
            });
        }
        let total: usize = slices.iter().map(|s| s.1).sum();
        if total != out {
            return Err(Error::InvalidLayer {
                module: name,
                reason: format!("slice widths sum to {total}, but the weight has {out} output rows"),
            });
        }
        if let Some(b) = &bias
            && b.dims() != [out]
        {
            return Err(Error::shape(&name, "bias", b.dims(), &[out]));
        }
        let lora = match lora {
            Some(cfg) if cfg.max_loras > 0 => {
                Some(slices.iter().map(|&(id, o)| LoraSlots::zeros(id, inp, o, cfg)).collect::<Result<Vec<_>>>()?)
            }
            _ => None,
        };
        Ok(LoraLinear { base, bias, slices, lora, merged: None })
    }

    /// Wraps a `candle_nn::Linear` as one slice named `module`.
    pub fn from_linear(linear: candle_nn::Linear, module: ModuleId, lora: Option<&SlotConfig>) -> Result<LoraLinear> {
        let out = linear.weight().dim(0)?;
        LoraLinear::new(linear.weight().clone(), linear.bias().cloned(), vec![(module, out)], lora)
    }

    /// `x: [rows, in]` (or `[.., in]` with `rows` leading elements) → `[rows, out]`.
    pub fn forward(&self, x: &Tensor, mapping: &LoraMapping) -> Result<Tensor> {
        self.forward_ahead(x, mapping, &mut ReadAhead::new())
    }

    /// [`LoraLinear::forward`], its base product asking along the way for the bytes of `ahead`
    /// (what the step reads after this layer, e.g. the next attention's KV rows) and of the slots
    /// its own LoRA part reads next to be brought into the caches ([`ReadAhead`]; only the
    /// quantized CPU product asks, the others ignore it). `ahead` is left empty.
    pub fn forward_ahead(&self, x: &Tensor, mapping: &LoraMapping, ahead: &mut ReadAhead) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let x2 = if dims.len() == 2 { x.clone() } else { x.flatten_to(dims.len().saturating_sub(2))? };
        if matches!(self.base, Base::Quant(_)) {
            // The slots first: they are read first (right after the product), and they are what
            // the cap on a product's hints keeps.
            let given = ahead.len();
            self.read_ahead(mapping, ahead);
            ahead.move_to_front(given);
        }
        let y = self.base.forward(&x2, ahead);
        ahead.clear();
        let mut y = y?;
        if let Some(b) = &self.bias {
            y = if b.dtype() == y.dtype() { y.broadcast_add(b)? } else { y.broadcast_add(&b.to_dtype(y.dtype())?)? };
        }
        if let Some(slots) = &self.lora
            && !mapping.no_lora()
        {
            y = match &self.merged {
                None => {
                    let refs: Vec<&LoraSlots> = slots.iter().collect();
                    lora_apply(&x2, y, &refs, mapping)?
                }
                Some(m) => self.forward_merged(&x2, y, slots, m, mapping)?,
            };
        }
        if dims.len() == 2 {
            return Ok(y);
        }
        let mut out_dims = dims;
        if let Some(last) = out_dims.last_mut() {
            *last = self.out_features();
        }
        Ok(y.reshape(out_dims)?)
    }

    /// With slot `m` folded into the weight: rows of slot `m` need nothing more; every other row
    /// gets its own delta (slot `m` treated as empty) minus slot `m`'s.
    fn forward_merged(
        &self,
        x: &Tensor,
        y: Tensor,
        slots: &[LoraSlots],
        m: &Merged,
        mapping: &LoraMapping,
    ) -> Result<Tensor> {
        let others: Vec<LoraSlots> = slots.iter().map(|s| s.without(m.slot)).collect();
        let refs: Vec<&LoraSlots> = others.iter().collect();
        let y = lora_apply(x, y, &refs, mapping)?;
        let rows: Vec<u32> = (0..mapping.num_rows() as u32)
            .filter(|&r| mapping.slots()[r as usize] != Some(SlotId::new(m.slot)))
            .collect();
        if rows.is_empty() {
            return Ok(y);
        }
        let index = Tensor::from_vec(rows.clone(), rows.len(), x.device())?;
        let xs = x.index_select(&index, 0)?.to_dtype(DType::F32)?;
        let mut parts = Vec::with_capacity(self.slices.len());
        for (part, &(_, width)) in m.parts.iter().zip(&self.slices) {
            parts.push(match part {
                Some((a, b)) => xs.matmul(&a.t()?)?.matmul(&b.t()?)?,
                None => Tensor::zeros((rows.len(), width), DType::F32, x.device())?,
            });
        }
        let delta = Tensor::cat(&parts, 1)?.neg()?;
        Ok(y.to_dtype(DType::F32)?.index_add(&index, &delta, 0)?.to_dtype(y.dtype())?)
    }

    /// Adds the host memory this layer's LoRA part reads for `mapping`'s rows (its slots' `A`
    /// and `Bᵀ` at their real ranks) to `ahead`. Nothing for slots on a device, or a merged layer.
    fn read_ahead(&self, mapping: &LoraMapping, ahead: &mut ReadAhead) {
        if let (Some(slots), None) = (&self.lora, &self.merged)
            && !mapping.no_lora()
        {
            for sl in slots {
                sl.read_ahead(mapping.lora_segments().map(|s| s.slot.index()), ahead);
            }
        }
    }

    /// Whether the layer has slot buffers.
    pub fn has_lora(&self) -> bool {
        self.lora.is_some()
    }

    /// The base weight `[out, in]` (with the merged adapter folded in, while merged): the
    /// tensor itself, or a copy unpacked from the kernel's layout.
    pub fn weight(&self) -> Result<Tensor> {
        self.base.dense()
    }

    /// Output features (the slices' widths summed).
    pub fn out_features(&self) -> usize {
        self.slices.iter().map(|s| s.1).sum()
    }

    /// The base bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The modules this layer holds and their output widths.
    pub fn slices(&self) -> &[(ModuleId, usize)] {
        &self.slices
    }

    /// The slot buffers, one per slice (`None` without LoRA).
    pub fn lora_slots(&self) -> Option<&[LoraSlots]> {
        self.lora.as_deref()
    }

    /// The slot merged into the weight, if any.
    pub fn merged_slot(&self) -> Option<usize> {
        self.merged.as_ref().map(|m| m.slot)
    }

    fn name(&self) -> String {
        let names: Vec<String> = self.slices.iter().map(|s| s.0.to_string()).collect();
        names.join("+")
    }

    fn slots_mut(&mut self) -> Result<&mut Vec<LoraSlots>> {
        let module = self.name();
        self.lora.as_mut().ok_or(Error::NoSlots { module })
    }

    /// Writes each slice's module of `adapter` into `slot`, and zeroes the slices it does not
    /// target. Everything is checked before anything is written. A merged slot is unmerged first.
    pub fn write_slot(&mut self, slot: usize, adapter: &LoraAdapter) -> Result<()> {
        let wrap = |e: Error| Error::SlotWrite { slot, adapter: adapter.name().to_string(), source: Box::new(e) };
        self.write_slot_inner(slot, adapter).map_err(wrap)
    }

    fn write_slot_inner(&mut self, slot: usize, adapter: &LoraAdapter) -> Result<()> {
        for s in self.slots_mut()?.iter() {
            match adapter.module(&s.module()) {
                Some(m) => s.check(slot, m)?,
                None if slot >= s.max_loras() => {
                    return Err(Error::NoSuchSlot { module: s.module().to_string(), slot, max_loras: s.max_loras() });
                }
                None => {}
            }
        }
        if self.merged_slot() == Some(slot) {
            self.unmerge()?;
        }
        for s in self.slots_mut()? {
            match adapter.module(&s.module()) {
                Some(m) => s.write(slot, m)?,
                None => s.clear(slot)?,
            }
        }
        Ok(())
    }

    /// Zeroes `slot` in every slice. A merged slot is unmerged first.
    pub fn clear_slot(&mut self, slot: usize) -> Result<()> {
        let module = self.name();
        let max = self.slots_mut()?.first().map(|s| s.max_loras()).unwrap_or(0);
        if slot >= max {
            return Err(Error::NoSuchSlot { module, slot, max_loras: max });
        }
        if self.merged_slot() == Some(slot) {
            self.unmerge()?;
        }
        for s in self.slots_mut()? {
            s.clear(slot)?;
        }
        Ok(())
    }

    /// Folds slot `slot` into the weight: `W' = W + B·A` per slice (computed in f32, rounded
    /// once). Rows of that slot then cost only the base matmul; other rows still get their own
    /// delta (and the merged one taken back). Merging another slot unmerges the first.
    pub fn merge(&mut self, slot: usize) -> Result<()> {
        let module = self.name();
        let slots = self.lora.as_ref().ok_or(Error::NoSlots { module: module.clone() })?;
        let max = slots.first().map(|s| s.max_loras()).unwrap_or(0);
        if slot >= max {
            return Err(Error::NoSuchSlot { module, slot, max_loras: max });
        }
        if self.merged_slot() == Some(slot) {
            return Ok(());
        }
        // Copies, not views: the slot may be rewritten while merged.
        let parts = slots
            .iter()
            .map(|s| {
                Ok(match s.slot_ab(slot)? {
                    Some((a, b)) => {
                        Some((a.to_dtype(DType::F32)?.force_contiguous()?, b.to_dtype(DType::F32)?.force_contiguous()?))
                    }
                    None => None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.unmerge()?;
        let merged = Merged { slot, parts };
        self.base = self.apply_delta(&merged, 1.0)?;
        self.merged = Some(merged);
        Ok(())
    }

    /// Takes the merged adapter back out of the weight (`W = W' − B·A`; equal to the original
    /// weight up to rounding). A no-op when nothing is merged.
    pub fn unmerge(&mut self) -> Result<()> {
        if let Some(m) = self.merged.take() {
            self.base = self.apply_delta(&m, -1.0)?;
        }
        Ok(())
    }

    fn apply_delta(&self, m: &Merged, sign: f64) -> Result<Base> {
        let weight = self.base.dense()?;
        let inp = weight.dim(1)?;
        let device = weight.device();
        let mut parts = Vec::with_capacity(self.slices.len());
        for (part, &(_, width)) in m.parts.iter().zip(&self.slices) {
            parts.push(match part {
                Some((a, b)) => b.matmul(a)?,
                None => Tensor::zeros((width, inp), DType::F32, device)?,
            });
        }
        let delta = (Tensor::cat(&parts, 0)? * sign)?;
        // A quantized weight is merged into its f32 values (the blocks cannot hold the sum).
        let w = (weight.to_dtype(DType::F32)? + delta)?.to_dtype(weight.dtype())?;
        Base::new(w, matches!(self.base, Base::Dense(_)))
    }
}

impl SlotSink for LoraLinear {
    fn write_slot(&mut self, slot: SlotId, adapter: &LoraAdapter) -> multilora_adapter::Result<()> {
        Ok(LoraLinear::write_slot(self, slot.index(), adapter)?)
    }

    fn clear_slot(&mut self, slot: SlotId) -> multilora_adapter::Result<()> {
        Ok(LoraLinear::clear_slot(self, slot.index())?)
    }
}
