//! `LoraMapping`: the per-step map from batch rows to adapter slots, sorted into segments.
//!
//! Built once per step from a slot list (`None` = base model only) and shared by every layer of
//! the step, it holds what vLLM's `LoRAKernelMeta` holds: a stable sort of the row indices by slot
//! (base rows first), the segments of that order (one per distinct slot), and a "no LoRA at all"
//! flag.
//! The LoRA segments are also cut into [`Tile`]s of at most [`TILE_ROWS`] rows, the unit of work
//! of the CUDA kernels. The index the ops gather and scatter with and the tiles are put on the
//! device once per step, in the step's one copy ([`LoraMapping::plan`] adds them to the step's
//! [`StepMeta`]), so no layer copies anything between host and device.

use candle_core::{Device, Tensor};
use multilora_kernels::params::{TILE_ROWS, Tile};
use multilora_types::SlotId;

use crate::error::{Error, Result};
use crate::upload::{MetaPart, StepMeta, Uploaded};

/// A run of rows that share an adapter slot, in the sorted order of a [`LoraMapping`] (the base
/// rows before them are not a segment: they are [`LoraMapping::num_base_rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The slot.
    pub slot: SlotId,
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
    slots: Vec<Option<SlotId>>,
    sorted: Vec<u32>,
    segments: Vec<Segment>,
    /// Rows without an adapter; they come first in the sorted order.
    num_base: usize,
    /// The sorted order is `0..n`: rows are already grouped by slot, so the ops skip the gather.
    identity: bool,
    max_loras: usize,
    device: Device,
    /// The LoRA segments cut into tiles of at most [`TILE_ROWS`] rows, in sorted order.
    tiles: Vec<Tile>,
    /// `sorted[num_base..]` on `device`; `None` when there are no LoRA rows.
    lora_index: Option<Tensor>,
    /// The tiles' fields as `u32`s on `device` (uploaded with `lora_index`, in the same copy).
    tile_index: Option<Tensor>,
    /// On CUDA: each slot's first packed position, then its row count (`u32 [2 · max_loras]`,
    /// the decode-shaped kernels' fixed-size table), in the same copy.
    slot_index: Option<Tensor>,
}

impl LoraMapping {
    /// Builds the mapping of a step, its device index uploaded on its own (a step that has other
    /// tables to upload builds it with [`LoraMapping::plan`] instead). `slots[i]` is row `i`'s
    /// slot, `None` for the base model. Fails as [`LoraMapping::plan`] does.
    pub fn new(slots: &[Option<SlotId>], max_loras: usize, device: &Device) -> Result<LoraMapping> {
        let mut meta = StepMeta::new();
        let pending = LoraMapping::plan(slots, max_loras, device, &mut meta)?;
        pending.finish(&Uploaded::plain(meta, device)?)
    }

    /// The mapping of a step, its device tables (the LoRA rows, then the tiles, and on CUDA the
    /// slot table) appended to the step's `meta`, to be put on the device with the step's other
    /// tables in one copy; [`PendingMapping::finish`] takes them back from that upload.
    ///
    /// Fails when a slot is `>= max_loras`: the one place a step's slots are checked.
    pub fn plan(
        slots: &[Option<SlotId>],
        max_loras: usize,
        device: &Device,
        meta: &mut StepMeta,
    ) -> Result<PendingMapping> {
        // A counting sort: stable, O(rows + slots), and no comparison of rows. Bucket 0 holds the
        // base rows, bucket `s + 1` slot `s`.
        let bucket = |slot: Option<SlotId>| slot.map_or(0, |s| s.index() + 1);
        let mut counts = vec![0usize; max_loras + 1];
        for (row, &slot) in slots.iter().enumerate() {
            if let Some(s) = slot
                && s.index() >= max_loras
            {
                return Err(Error::SlotOutOfRange { row, slot: s.index(), max_loras });
            }
            counts[bucket(slot)] += 1;
        }
        let mut segments = Vec::new();
        let mut starts = vec![0usize; max_loras + 1];
        let mut at = 0;
        for (b, &len) in counts.iter().enumerate() {
            starts[b] = at;
            if b > 0 && len > 0 {
                segments.push(Segment { slot: SlotId::new(b - 1), start: at, len });
            }
            at += len;
        }
        let mut sorted = vec![0u32; slots.len()];
        for (row, &slot) in slots.iter().enumerate() {
            let bucket = bucket(slot);
            sorted[starts[bucket]] = row as u32;
            starts[bucket] += 1;
        }
        let num_base = counts[0];
        let identity = sorted.iter().enumerate().all(|(i, &r)| r as usize == i);
        let tiles = tiles_of(&segments, num_base);
        let parts = (num_base < slots.len()).then(|| IndexParts {
            lora: meta.push(sorted[num_base..].iter().copied()),
            tiles: meta.push(tiles.iter().flat_map(|t| [t.slot, t.seg, t.start, t.len])),
            slots: device.is_cuda().then(|| meta.push(slot_table(&segments, num_base, max_loras))),
        });
        let mapping = LoraMapping {
            slots: slots.to_vec(),
            sorted,
            segments,
            num_base,
            identity,
            max_loras,
            device: device.clone(),
            tiles,
            lora_index: None,
            tile_index: None,
            slot_index: None,
        };
        Ok(PendingMapping { mapping, parts })
    }

    /// The LoRA segments cut into [`Tile`]s (at most [`TILE_ROWS`] rows each), in sorted order;
    /// `Tile::seg` counts LoRA segments from 0 and `Tile::start` is a packed position.
    pub fn tiles(&self) -> &[Tile] {
        &self.tiles
    }

    /// On CUDA, [`slot_table`] on the device: each slot's first packed position, then its rows.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn slot_index(&self) -> Option<&Tensor> {
        self.slot_index.as_ref()
    }

    /// [`LoraMapping::tiles`] on the mapping's device, four `u32`s per tile.
    pub fn tile_index(&self) -> Option<&Tensor> {
        self.tile_index.as_ref()
    }

    /// Number of rows (tokens, or logit rows for `lm_head`).
    pub fn num_rows(&self) -> usize {
        self.slots.len()
    }

    /// No row uses an adapter: layers skip all LoRA work.
    pub fn no_lora(&self) -> bool {
        self.num_base == self.slots.len()
    }

    /// The slot list the mapping was built from.
    pub fn slots(&self) -> &[Option<SlotId>] {
        &self.slots
    }

    /// The segments of rows that use an adapter, by ascending slot (after the base rows).
    pub fn lora_segments(&self) -> impl ExactSizeIterator<Item = &Segment> {
        self.segments.iter()
    }

    /// Stable sort of the row indices by slot.
    pub fn sorted_indices(&self) -> &[u32] {
        &self.sorted
    }

    /// Whether `slots` is the list this mapping was built from (so the previous step's can be reused).
    pub fn same_slots(&self, slots: &[Option<SlotId>]) -> bool {
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

/// Where a pending mapping's device tables lie in its step's [`StepMeta`].
#[derive(Clone, Copy, Debug)]
struct IndexParts {
    lora: MetaPart,
    tiles: MetaPart,
    slots: Option<MetaPart>,
}

/// A [`LoraMapping`] whose device tables are still in its step's [`StepMeta`] ([`LoraMapping::plan`]).
#[derive(Debug)]
pub struct PendingMapping {
    mapping: LoraMapping,
    /// `None` when no row uses an adapter (nothing to put on the device).
    parts: Option<IndexParts>,
}

impl PendingMapping {
    /// The mapping, its tables views of `up`, the upload of the step's [`StepMeta`].
    pub fn finish(self, up: &Uploaded) -> Result<LoraMapping> {
        let mut m = self.mapping;
        if let Some(p) = self.parts {
            m.lora_index = Some(up.part(p.lora)?);
            m.tile_index = Some(up.part(p.tiles)?);
            m.slot_index = p.slots.map(|t| up.part(t)).transpose()?;
        }
        Ok(m)
    }
}

/// The decode-shaped kernels' slot table, `2 · max_loras` values: the first packed position of
/// each slot's rows (0 for a slot with none), then its row count.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn slot_table(segments: &[Segment], num_base: usize, max_loras: usize) -> Vec<u32> {
    let mut table = vec![0u32; 2 * max_loras];
    for seg in segments {
        let s = seg.slot.index();
        table[s] = (seg.start - num_base) as u32;
        table[max_loras + s] = seg.len as u32;
    }
    table
}

/// The LoRA segments cut into tiles of at most [`TILE_ROWS`] rows, in order: the kernels' own
/// index buffers, where a slot is a plain `u32`.
fn tiles_of(segments: &[Segment], num_base: usize) -> Vec<Tile> {
    let mut tiles = Vec::new();
    for (seg, s) in segments.iter().enumerate() {
        let start = s.start - num_base;
        for at in (0..s.len).step_by(TILE_ROWS) {
            tiles.push(Tile {
                slot: s.slot.index() as u32,
                seg: seg as u32,
                start: (start + at) as u32,
                len: TILE_ROWS.min(s.len - at) as u32,
            });
        }
    }
    tiles
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slot lists spelled as the kernels spell them (-1: base).
    fn slots(s: &[i32]) -> Vec<Option<SlotId>> {
        s.iter().map(|&s| usize::try_from(s).ok().map(SlotId::new)).collect()
    }

    #[test]
    fn seed_example_segments() {
        let m = LoraMapping::new(&slots(&[2, 0, -1, 2, 3, 0]), 4, &Device::Cpu).unwrap();
        let segs: Vec<(usize, usize)> = m.lora_segments().map(|s| (s.slot.index(), s.len)).collect();
        assert_eq!(m.num_base_rows(), 1);
        assert_eq!(segs, vec![(0, 2), (2, 2), (3, 1)]);
        assert_eq!(m.sorted_indices(), &[2, 1, 5, 0, 3, 4]);
        assert_eq!(m.lora_rows(), &[1, 5, 0, 3, 4]);
        assert!(!m.no_lora() && !m.is_sorted());
        assert!(m.same_slots(&slots(&[2, 0, -1, 2, 3, 0])) && !m.same_slots(&slots(&[2, 0, -1, 2, 3, 1])));
        let tiles: Vec<[u32; 4]> = m.tiles().iter().map(|t| [t.slot, t.seg, t.start, t.len]).collect();
        assert_eq!(tiles, vec![[0, 0, 0, 2], [2, 1, 2, 2], [3, 2, 4, 1]]);
        // The device copy holds the rows, then the tiles.
        assert_eq!(m.lora_index().unwrap().to_vec1::<u32>().unwrap(), vec![1, 5, 0, 3, 4]);
        assert_eq!(m.tile_index().unwrap().to_vec1::<u32>().unwrap(), vec![0, 0, 0, 2, 2, 1, 2, 2, 3, 2, 4, 1]);
    }

    #[test]
    fn long_segments_are_cut_into_tiles() {
        // 3 base rows, 19 rows of slot 1, 8 of slot 0: tiles of at most TILE_ROWS (8) rows.
        let mut list = vec![-1; 3];
        list.extend([1; 19]);
        list.extend([0; 8]);
        let m = LoraMapping::new(&slots(&list), 2, &Device::Cpu).unwrap();
        let tiles: Vec<[u32; 4]> = m.tiles().iter().map(|t| [t.slot, t.seg, t.start, t.len]).collect();
        assert_eq!(tiles, vec![[0, 0, 0, 8], [1, 1, 8, 8], [1, 1, 16, 8], [1, 1, 24, 3]]);
        let covered: u32 = m.tiles().iter().map(|t| t.len).sum();
        assert_eq!(covered as usize, m.num_lora_rows());
    }

    #[test]
    fn flags_and_errors() {
        let m = LoraMapping::new(&slots(&[-1, -1]), 4, &Device::Cpu).unwrap();
        assert!(m.no_lora() && m.lora_index().is_none());
        let m = LoraMapping::new(&slots(&[-1, 0, 0, 3]), 4, &Device::Cpu).unwrap();
        assert!(m.is_sorted() && !m.no_lora());
        let m = LoraMapping::new(&slots(&[]), 4, &Device::Cpu).unwrap();
        assert!(m.no_lora() && m.num_rows() == 0);
        let e = LoraMapping::new(&slots(&[0, 4]), 4, &Device::Cpu).unwrap_err();
        assert_eq!(e.kind(), "slot_out_of_range");
        assert!(e.to_string().contains("row 1: slot 4"), "{e}");
        assert!(LoraMapping::new(&slots(&[0]), 0, &Device::Cpu).is_err());
    }

    /// Two mappings planned into one step's tables after another table, uploaded once: each
    /// holds what a mapping built on its own holds, as views of the one upload; a mapping with no
    /// LoRA row adds nothing to the tables.
    #[test]
    fn planned_mappings_share_one_upload() {
        let dev = Device::Cpu;
        let mut meta = StepMeta::new();
        let ids = meta.push([11, 12, 13]);
        let a = LoraMapping::plan(&slots(&[2, 0, -1, 2, 3, 0]), 4, &dev, &mut meta).unwrap();
        let before = meta.values().len();
        let none = LoraMapping::plan(&slots(&[-1, -1]), 4, &dev, &mut meta).unwrap();
        assert_eq!(meta.values().len(), before, "no LoRA row, no table");
        let b = LoraMapping::plan(&slots(&[1, 1, 1]), 4, &dev, &mut meta).unwrap();
        let up = crate::upload::MetaToDevice::new().upload(meta, &dev).unwrap();
        let (a, none, b) = (a.finish(&up).unwrap(), none.finish(&up).unwrap(), b.finish(&up).unwrap());
        assert_eq!(up.part(ids).unwrap().to_vec1::<u32>().unwrap(), [11, 12, 13]);
        assert!(none.no_lora() && none.lora_index().is_none());
        for (m, list) in [(&a, &[2, 0, -1, 2, 3, 0][..]), (&b, &[1, 1, 1][..])] {
            let alone = LoraMapping::new(&slots(list), 4, &dev).unwrap();
            let v = |t: Option<&Tensor>| t.unwrap().to_vec1::<u32>().unwrap();
            assert_eq!(v(m.lora_index()), v(alone.lora_index()));
            assert_eq!(v(m.tile_index()), v(alone.tile_index()));
            assert_eq!((m.sorted_indices(), m.tiles()), (alone.sorted_indices(), alone.tiles()));
        }
    }
}
