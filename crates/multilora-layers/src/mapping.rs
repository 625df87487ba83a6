//! `LoraMapping`: the per-step map from batch rows to adapter slots, sorted into segments.
//!
//! Built once per step from a slot list (`-1` = base model only) and shared by every layer of the
//! step, it holds what vLLM's `LoRAKernelMeta` holds: a stable sort of the row indices by slot,
//! the segments of that order (one per distinct slot, `-1` first), and a "no LoRA at all" flag.
//! The index tensor the ops gather and scatter with is put on the device here, once, so no layer
//! copies anything between host and device.

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// A run of rows that share a slot, in the sorted order of a [`LoraMapping`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The slot (`-1` = base model).
    pub slot: i32,
    /// First position in [`LoraMapping::sorted_indices`].
    pub start: usize,
    /// Number of rows.
    pub len: usize,
}

/// Which slot each row of a step uses, grouped by slot.
///
/// Cheap to share: layers take `&LoraMapping`; cloning shares the device index tensor.
#[derive(Clone, Debug)]
pub struct LoraMapping {
    slots: Vec<i32>,
    sorted: Vec<u32>,
    segments: Vec<Segment>,
    /// Rows with slot -1; they come first in the sorted order.
    num_base: usize,
    /// The sorted order is `0..n`: rows are already grouped by slot, so the ops skip the gather.
    identity: bool,
    max_loras: usize,
    device: Device,
    /// `sorted[num_base..]` on `device`; `None` when there are no LoRA rows.
    lora_index: Option<Tensor>,
}

impl LoraMapping {
    /// Builds the mapping of a step. `slots[i]` is row `i`'s slot, `-1` for the base model.
    ///
    /// Fails when a slot is `>= max_loras` or below -1.
    pub fn new(slots: &[i32], max_loras: usize, device: &Device) -> Result<LoraMapping> {
        // A counting sort: stable, O(rows + slots), and no comparison of rows.
        let mut counts = vec![0usize; max_loras + 1];
        for (row, &slot) in slots.iter().enumerate() {
            if slot < -1 || slot as i64 >= max_loras as i64 {
                return Err(Error::SlotOutOfRange { row, slot: slot as i64, max_loras });
            }
            counts[(slot + 1) as usize] += 1;
        }
        let mut segments = Vec::new();
        let mut starts = vec![0usize; max_loras + 1];
        let mut at = 0;
        for (bucket, &len) in counts.iter().enumerate() {
            starts[bucket] = at;
            if len > 0 {
                segments.push(Segment { slot: bucket as i32 - 1, start: at, len });
            }
            at += len;
        }
        let mut sorted = vec![0u32; slots.len()];
        for (row, &slot) in slots.iter().enumerate() {
            let bucket = (slot + 1) as usize;
            sorted[starts[bucket]] = row as u32;
            starts[bucket] += 1;
        }
        let num_base = counts[0];
        let identity = sorted.iter().enumerate().all(|(i, &r)| r as usize == i);
        let lora_index = if num_base < slots.len() {
            let lora = &sorted[num_base..];
            Some(Tensor::from_slice(lora, lora.len(), device)?)
        } else {
            None
        };
        Ok(LoraMapping {
            slots: slots.to_vec(),
            sorted,
            segments,
            num_base,
            identity,
            max_loras,
            device: device.clone(),
            lora_index,
        })
    }

    /// Number of rows (tokens, or logit rows for `lm_head`).
    pub fn num_rows(&self) -> usize {
        self.slots.len()
    }

    /// Every row is `-1`: layers skip all LoRA work.
    pub fn no_lora(&self) -> bool {
        self.num_base == self.slots.len()
    }

    /// The slot list the mapping was built from.
    pub fn slots(&self) -> &[i32] {
        &self.slots
    }

    /// The segments of the sorted order, by ascending slot, `-1` included (first).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The segments of rows that use an adapter (slot ≥ 0).
    pub fn lora_segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.iter().filter(|s| s.slot >= 0)
    }

    /// Stable sort of the row indices by slot.
    pub fn sorted_indices(&self) -> &[u32] {
        &self.sorted
    }

    /// Whether `slots` is the list this mapping was built from (so the previous step's can be reused).
    pub fn same_slots(&self, slots: &[i32]) -> bool {
        self.slots == slots
    }

    /// The number of slots the mapping was checked against.
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }

    /// The device the index tensor lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Rows that use the base model only.
    pub fn num_base_rows(&self) -> usize {
        self.num_base
    }

    /// Rows that use an adapter.
    pub fn num_lora_rows(&self) -> usize {
        self.slots.len() - self.num_base
    }

    /// The LoRA rows in sorted order: `sorted_indices()[num_base_rows()..]`. Position `j` of an
    /// op's packed shrink output is row `lora_rows()[j]` of the batch.
    pub fn lora_rows(&self) -> &[u32] {
        &self.sorted[self.num_base..]
    }

    /// Rows are already grouped by slot (`sorted_indices` is `0..n`), so the LoRA rows are the
    /// contiguous block `num_base_rows()..` and no gather or scatter is needed.
    pub fn is_sorted(&self) -> bool {
        self.identity
    }

    /// [`LoraMapping::lora_rows`] as a `u32` tensor on the mapping's device, built once per step.
    pub fn lora_index(&self) -> Option<&Tensor> {
        self.lora_index.as_ref()
    }

    /// Position of a segment inside the packed LoRA rows (its start minus the base rows).
    pub(crate) fn packed_start(&self, seg: &Segment) -> usize {
        seg.start - self.num_base
    }

    /// The LoRA rows of `x` (`[rows, n]`) in sorted order: one `index_select`, or a view when the
    /// rows are already sorted.
    pub fn gather_lora_rows(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let rows = x.dim(0)?;
        if rows != self.num_rows() {
            return Err(Error::RowMismatch { op: "gather".to_string(), input: rows, mapping: self.num_rows() });
        }
        match &self.lora_index {
            None => Ok(None),
            Some(_) if self.identity => Ok(Some(x.narrow(0, self.num_base, self.num_lora_rows())?)),
            Some(index) => Ok(Some(x.index_select(index, 0)?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_example_segments() {
        let m = LoraMapping::new(&[2, 0, -1, 2, 3, 0], 4, &Device::Cpu).unwrap();
        let segs: Vec<(i32, usize)> = m.segments().iter().map(|s| (s.slot, s.len)).collect();
        assert_eq!(segs, vec![(-1, 1), (0, 2), (2, 2), (3, 1)]);
        assert_eq!(m.sorted_indices(), &[2, 1, 5, 0, 3, 4]);
        assert_eq!(m.lora_rows(), &[1, 5, 0, 3, 4]);
        assert!(!m.no_lora() && !m.is_sorted());
        assert!(m.same_slots(&[2, 0, -1, 2, 3, 0]) && !m.same_slots(&[2, 0, -1, 2, 3, 1]));
    }

    #[test]
    fn flags_and_errors() {
        let m = LoraMapping::new(&[-1, -1], 4, &Device::Cpu).unwrap();
        assert!(m.no_lora() && m.lora_index().is_none());
        let m = LoraMapping::new(&[-1, 0, 0, 3], 4, &Device::Cpu).unwrap();
        assert!(m.is_sorted() && !m.no_lora());
        let m = LoraMapping::new(&[], 4, &Device::Cpu).unwrap();
        assert!(m.no_lora() && m.num_rows() == 0);
        let e = LoraMapping::new(&[0, 4], 4, &Device::Cpu).unwrap_err();
        assert_eq!(e.kind(), "slot_out_of_range");
        assert!(e.to_string().contains("row 1: slot 4"), "{e}");
        assert!(LoraMapping::new(&[-2], 4, &Device::Cpu).is_err());
        assert!(LoraMapping::new(&[0], 0, &Device::Cpu).is_err());
    }
}
