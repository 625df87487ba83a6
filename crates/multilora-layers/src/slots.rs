//! Slot buffers: for one adapted module, the stacked `A[max_loras, max_rank, in]` and
//! `Bᵀ[max_loras, max_rank, out]` of every adapter the device holds, and the real rank of each slot.
//!
//! Writing a slot copies an adapter's (already scaled) matrices into the slot's region in place
//! (`slice_set` on a view of the stacked buffer, never a rebuild of the whole buffer), converting
//! dtype and device and zero-padding a smaller rank; clearing zeroes the region. The recorded rank
//! lets the ops multiply at the adapter's own rank, so the padding costs memory, not time.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{LoraModule, ModuleId};

use crate::ahead::{HostRows, ReadAhead};
use crate::error::{Error, Result};
use crate::zeros::huge_zeros;

/// Where and how LoRA slots are allocated: shared by every layer of a model.
#[derive(Clone, Debug)]
pub struct SlotConfig {
    /// Distinct adapters one step can use (slots per module). 0 means no LoRA at all.
    pub max_loras: usize,
    /// Largest rank a slot holds (`max_lora_rank`); smaller ranks are zero-padded.
    pub max_rank: usize,
    /// The LoRA dtype (`lora_dtype`).
    pub dtype: DType,
    /// The device the slots live on (the model's).
    pub device: Device,
    /// Where the slots made with this config (and its clones) are carved from on the CPU.
    slab: Slab,
}

impl SlotConfig {
    /// A config for `max_loras` slots of rank `max_rank`.
    pub fn new(max_loras: usize, max_rank: usize, dtype: DType, device: &Device) -> SlotConfig {
        SlotConfig { max_loras, max_rank, dtype, device: device.clone(), slab: Slab::default() }
    }
}

/// Host memory for the slot buffers of one model: views of shared zeroed chunks, each buffer on a
/// cache line, the chunks advised to be backed by huge pages (`madvise`, as the quantized
/// weights' chunks are). A step reads every active slot's `A` and `Bᵀ` once (78 MB for eight
/// rank-16 adapters on SmolLM2-135M), as short streams the TLBs cannot hold on 4 KiB pages; one
/// allocation per buffer also starts each 16 bytes past a page, so half of the kernels' 32-byte
/// loads of f16 rows straddled two lines.
#[derive(Clone, Debug, Default)]
struct Slab(Arc<Mutex<Option<(Tensor, usize)>>>);

/// Bytes of a slab chunk: past the allocator's largest threshold for its own `mmap` (32 MiB on
/// 64-bit glibc), so a chunk is fresh memory whose pages the advice covers from the first write.
const SLAB_BYTES: usize = 34 << 20;

impl Slab {
    /// `n` zeros of `dtype` on the CPU, their first on a 64-byte line: a view of the current
    /// chunk, or of a new one (of at least `n` values) when it is of another dtype or full.
    fn zeros(&self, n: usize, dtype: DType) -> Result<Tensor> {
        let es = dtype.size_in_bytes();
        let pad = 64 / es;
        let mut current = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (chunk, used) = match current.take() {
            Some((c, used)) if c.dtype() == dtype && used + pad + n <= c.elem_count() => (c, used),
            _ => (huge_zeros((SLAB_BYTES / es).max(n + pad), dtype, &Device::Cpu)?, 0),
        };
        let addr = HostRows::of(&chunk).map_or(0, |r| r.addr()) + used * es;
        let skip = (64 - addr % 64) % 64 / es;
        let view = chunk.narrow(0, used + skip, n)?;
        *current = Some((chunk, used + skip + n));
        Ok(view)
    }
}

/// The slot buffers of one adapted module (one slice of a possibly fused layer).
///
/// `a` is `[max_loras, max_rank, in]`, PEFT's own `lora_A: [r, in]` stacked, and `b` is
/// `[max_loras, max_rank, out]`, PEFT's `lora_B: [out, r]` transposed and stacked, so that a
/// slot's A and B at its real rank are both contiguous blocks: the shrink reads rows of A along
/// the input, and the expand adds `s_j · Bᵀ[j, :]` row by row (an outer product, no horizontal
/// sums, the whole block one stream). For the embedding, `a` is
/// stored transposed, `[max_loras, vocab, max_rank]`, so a token's column of `lora_embedding_A` is
/// one contiguous row to gather.
#[derive(Clone, Debug)]
pub struct LoraSlots {
    module: ModuleId,
    a: Tensor,
    b: Tensor,
    ranks: Vec<usize>,
    /// Per slot: every rank from here on is zero, so a write need not zero that padding again.
    clean_from: Vec<usize>,
    in_features: usize,
    out_features: usize,
    max_rank: usize,
    a_transposed: bool,
    /// Where `a` and `b` lie in host memory (`None` on a device, or for the embedding's
    /// transposed `a`), for [`LoraSlots::read_ahead`]: found once, the buffers never move.
    host: Option<[HostRows; 2]>,
}

impl LoraSlots {
    /// Zeroed slots for a module of `in_features → out_features`.
    pub fn zeros(module: ModuleId, in_features: usize, out_features: usize, cfg: &SlotConfig) -> Result<LoraSlots> {
        Self::zeros_impl(module, in_features, out_features, cfg, false)
    }

    /// Zeroed slots for the input embedding (`vocab → hidden`), A stored transposed.
    pub(crate) fn zeros_embedding(
        module: ModuleId,
        vocab: usize,
        hidden: usize,
        cfg: &SlotConfig,
    ) -> Result<LoraSlots> {
        Self::zeros_impl(module, vocab, hidden, cfg, true)
    }

    fn zeros_impl(module: ModuleId, i: usize, o: usize, cfg: &SlotConfig, a_transposed: bool) -> Result<LoraSlots> {
        let (l, r) = (cfg.max_loras, cfg.max_rank);
        let a_shape = if a_transposed { (l, i, r) } else { (l, r, i) };
        let (a, b) = if cfg.device.is_cpu() && matches!(cfg.dtype, DType::F32 | DType::F16 | DType::BF16) {
            let a = cfg.slab.zeros(a_shape.0 * a_shape.1 * a_shape.2, cfg.dtype)?.reshape(a_shape)?;
            (a, cfg.slab.zeros(l * r * o, cfg.dtype)?.reshape((l, r, o))?)
        } else {
            (Tensor::zeros(a_shape, cfg.dtype, &cfg.device)?, Tensor::zeros((l, r, o), cfg.dtype, &cfg.device)?)
        };
        Ok(LoraSlots {
            module,
            host: host_rows(&a, &b, a_transposed),
            a,
            b,
            ranks: vec![0; l],
            clean_from: vec![0; l],
            in_features: i,
            out_features: o,
            max_rank: r,
            a_transposed,
        })
    }

    /// Slots from ready buffers (tests and benchmarks): `a: [max_loras, max_rank, in]`,
    /// `b: [max_loras, out, max_rank]` (PEFT's layout, stored transposed), `ranks[slot]` ≤ `max_rank`. The columns of a slot past its
    /// rank must be zero for the slow reference to agree with the segmented ops.
    pub fn from_parts(module: ModuleId, a: Tensor, b: Tensor, ranks: Vec<usize>) -> Result<LoraSlots> {
        let (l, r, i) = a.dims3().map_err(|_| Error::shape(module, "slot A", a.dims(), &[ranks.len(), 0, 0]))?;
        let (lb, o, rb) = b.dims3().map_err(|_| Error::shape(module, "slot B", b.dims(), &[l, 0, r]))?;
        if lb != l || rb != r {
            return Err(Error::shape(module, "slot B", b.dims(), &[l, o, r]));
        }
        if ranks.len() != l {
            return Err(Error::InvalidLayer {
                module: module.to_string(),
                reason: format!("{} ranks given for {l} slots", ranks.len()),
            });
        }
        if let Some(&rank) = ranks.iter().find(|&&x| x > r) {
            return Err(Error::RankTooLarge { module: module.to_string(), rank, max_rank: r });
        }
        if a.dtype() != b.dtype() || !a.device().same_device(b.device()) {
            return Err(Error::InvalidLayer {
                module: module.to_string(),
                reason: "slot A and B differ in dtype or device".to_string(),
            });
        }
        let (a, b) = (a.contiguous()?, b.transpose(1, 2)?.contiguous()?);
        let clean_from = ranks.clone();
        Ok(LoraSlots {
            module,
            host: host_rows(&a, &b, false),
            a,
            b,
            ranks,
            clean_from,
            in_features: i,
            out_features: o,
            max_rank: r,
            a_transposed: false,
        })
    }

    /// The module these slots adapt.
    pub fn module(&self) -> ModuleId {
        self.module
    }

    /// `[max_loras, max_rank, in]` (`[max_loras, vocab, max_rank]` for the embedding).
    pub fn a(&self) -> &Tensor {
        &self.a
    }

    /// `[max_loras, max_rank, out]`: each slot's B transposed.
    pub fn b(&self) -> &Tensor {
        &self.b
    }

    /// The real rank of every slot (0 = empty, or the adapter does not target this module).
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The real rank of `slot` (0 when out of range).
    pub fn rank(&self, slot: usize) -> usize {
        self.ranks.get(slot).copied().unwrap_or(0)
    }

    /// Slots held.
    pub fn max_loras(&self) -> usize {
        self.ranks.len()
    }

    /// Rank every slot is padded to.
    pub fn max_rank(&self) -> usize {
        self.max_rank
    }

    /// Input width (vocab for the embedding).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output width of this module.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The LoRA dtype.
    pub fn dtype(&self) -> DType {
        self.b.dtype()
    }

    pub(crate) fn a_transposed(&self) -> bool {
        self.a_transposed
    }

    /// The largest real rank among the slots `mapping` uses: the width the ops work at.
    pub(crate) fn active_rank(&self, mapping: &crate::LoraMapping) -> usize {
        mapping.lora_segments().map(|s| self.rank(s.slot.index())).max().unwrap_or(0)
    }

    /// A copy of these slots with `slot` treated as empty (the merged slot of a merged layer).
    pub(crate) fn without(&self, slot: usize) -> LoraSlots {
        let mut out = self.clone();
        if let Some(r) = out.ranks.get_mut(slot) {
            *r = 0;
        }
        out
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.ranks.len() {
            return Err(Error::NoSuchSlot { module: self.module.to_string(), slot, max_loras: self.ranks.len() });
        }
        Ok(())
    }

    /// Checks that `m` fits these slots, without writing anything.
    pub fn check(&self, slot: usize, m: &LoraModule) -> Result<()> {
        self.check_slot(slot)?;
        let name = self.module.to_string();
        let (tensor_a, tensor_b) =
            if self.a_transposed { ("lora_embedding_A", "lora_embedding_B") } else { ("lora_A", "lora_B") };
        if m.rank > self.max_rank {
            return Err(Error::RankTooLarge { module: name, rank: m.rank, max_rank: self.max_rank });
        }
        if m.a.dims() != [m.rank, self.in_features] {
            return Err(Error::shape(name, tensor_a, m.a.dims(), &[m.rank, self.in_features]));
        }
        if m.b_t.dims() != [m.rank, self.out_features] {
            // Reported in PEFT's layout, as the file holds it.
            let got: Vec<usize> = m.b_t.dims().iter().rev().copied().collect();
            return Err(Error::shape(name, tensor_b, &got, &[self.out_features, m.rank]));
        }
        Ok(())
    }

    /// Copies `m` into `slot`: converts dtype and device, zero-pads the rank, records it.
    pub fn write(&mut self, slot: usize, m: &LoraModule) -> Result<()> {
        self.check(slot, m)?;
        let r = m.rank;
        if r == 0 {
            return self.clear(slot);
        }
        let (dtype, device) = (self.a.dtype(), self.a.device().clone());
        // Convert on the host side first: a narrower LoRA dtype means fewer bytes to move.
        let a = m.a.to_dtype(dtype)?.to_device(&device)?;
        let bt = m.b_t.to_dtype(dtype)?.to_device(&device)?.contiguous()?;
        let a_slot = self.a.narrow(0, slot, 1)?;
        let b_slot = self.b.narrow(0, slot, 1)?;
        if self.a_transposed {
            a_slot.slice_set(&a.t()?.contiguous()?.unsqueeze(0)?, 2, 0)?;
        } else {
            a_slot.slice_set(&a.contiguous()?.unsqueeze(0)?, 1, 0)?;
        }
        b_slot.slice_set(&bt.unsqueeze(0)?, 1, 0)?;
        // Padding must be zero (the slow reference and `merge` read whole slots), but only what a
        // larger earlier adapter left behind needs zeroing: a fresh slot's padding already is.
        self.zero_ranks(slot, r, self.clean_from[slot])?;
        self.ranks[slot] = r;
        self.clean_from[slot] = r;
        Ok(())
    }

    /// Zeroes `slot` and marks it empty.
    pub fn clear(&mut self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.zero_ranks(slot, 0, self.clean_from[slot])?;
        self.ranks[slot] = 0;
        self.clean_from[slot] = 0;
        Ok(())
    }

    /// Zeroes ranks `from..to` of `slot`.
    fn zero_ranks(&self, slot: usize, from: usize, to: usize) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        let pad = to - from;
        let (dtype, device) = (self.a.dtype(), self.a.device());
        let (i, o) = (self.in_features, self.out_features);
        let a_slot = self.a.narrow(0, slot, 1)?;
        if self.a_transposed {
            a_slot.slice_set(&Tensor::zeros((1, i, pad), dtype, device)?, 2, from)?;
        } else {
            a_slot.slice_set(&Tensor::zeros((1, pad, i), dtype, device)?, 1, from)?;
        }
        self.b.narrow(0, slot, 1)?.slice_set(&Tensor::zeros((1, pad, o), dtype, device)?, 1, from)?;
        Ok(())
    }

    /// Adds where the `A` rows and `Bᵀ` rows of `slots` at their real ranks lie in host memory
    /// to `ahead`, in the order the LoRA kernel reads them (nothing for slots on a device or the
    /// embedding's).
    pub(crate) fn read_ahead(&self, slots: impl Iterator<Item = usize>, ahead: &mut ReadAhead) {
        let Some([a, b]) = &self.host else { return };
        for slot in slots {
            let (first, r) = (slot * self.max_rank, self.rank(slot));
            ahead.push_rows(a, first, r);
            ahead.push_rows(b, first, r);
        }
    }

    /// Slot `slot`'s `(A [r, in], B [out, r])` at its real rank, as views (B, and the embedding's
    /// A, transposed views of their buffers).
    pub(crate) fn slot_ab(&self, slot: usize) -> Result<Option<(Tensor, Tensor)>> {
        let r = self.rank(slot);
        if r == 0 {
            return Ok(None);
        }
        let a = if self.a_transposed {
            self.a.get(slot)?.narrow(1, 0, r)?.t()?
        } else {
            self.a.get(slot)?.narrow(0, 0, r)?
        };
        let b = self.b.get(slot)?.narrow(0, 0, r)?.t()?;
        Ok(Some((a, b)))
    }
}

/// [`LoraSlots::host`]: `a`'s rows (of `in`) and `b`'s (of `out`), both `max_rank` to a slot.
fn host_rows(a: &Tensor, b: &Tensor, a_transposed: bool) -> Option<[HostRows; 2]> {
    if a_transposed {
        return None;
    }
    Some([HostRows::of(a)?, HostRows::of(b)?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use multilora_types::ModuleKind;

    /// The slots of one config are views of shared chunks: each buffer on a cache line, apart
    /// from the others, zeroed, and a write to one leaves the others as they were.
    #[test]
    fn slots_of_one_config_are_aligned_apart_and_independent() -> anyhow::Result<()> {
        let cfg = SlotConfig::new(3, 4, DType::F16, &Device::Cpu);
        let id = |k| ModuleId::layer(0, k);
        let mut q = LoraSlots::zeros(id(ModuleKind::QProj), 40, 24, &cfg)?;
        let k = LoraSlots::zeros(id(ModuleKind::KProj), 40, 8, &cfg)?;
        let mut spans = Vec::new();
        for t in [q.a(), q.b(), k.a(), k.b()] {
            let rows = HostRows::of(t).ok_or_else(|| anyhow::anyhow!("a host buffer"))?;
            anyhow::ensure!(rows.addr() % 64 == 0, "on a cache line");
            spans.push((rows.addr(), rows.addr() + t.elem_count() * 2));
            anyhow::ensure!(t.flatten_all()?.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()? == 0.0);
        }
        spans.sort_unstable();
        anyhow::ensure!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "apart");
        let m = LoraModule::new(
            Tensor::ones((4, 40), DType::F32, &Device::Cpu)?,
            &Tensor::ones((24, 4), DType::F32, &Device::Cpu)?,
            4,
            4.0,
            1.0,
        )?;
        q.write(1, &m)?;
        anyhow::ensure!(q.a().flatten_all()?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? > 0.0, "written");
        for t in [k.a(), k.b()] {
            anyhow::ensure!(t.flatten_all()?.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()? == 0.0);
        }
        Ok(())
    }
}
