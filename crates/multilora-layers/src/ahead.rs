//! What a step reads next, handed to a compute-bound product so that it asks for those bytes a
//! little at a time while it computes ([`ReadAhead`]).
//!
//! A small model's decode step alternates products whose time goes to arithmetic (the quantized
//! base products use a fraction of the memory bandwidth) with parts whose time goes to waiting
//! on memory (each adapter's LoRA slots, 78 MB a step for eight rank-16 adapters on every
//! projection of SmolLM2-135M; the attention's KV rows). A product given the addresses of what
//! follows it spreads cache hints (`prefetcht0`) over its blocks, and the next part finds its
//! bytes in the caches instead of memory. A hint reads nothing and cannot fault, so an address
//! here is only ever a number: nothing is read through it, and a stale one costs a wasted hint.

use candle_core::{CpuStorage, Storage, Tensor};

/// The most bytes one product asks for: about what the L2 caches of a few cores hold; past it,
/// the lines would evict each other before they are read.
pub(crate) const AHEAD_MAX: usize = 4 << 20;

/// Byte ranges of host memory a step is about to read, in the order it reads them.
#[derive(Clone, Debug, Default)]
pub struct ReadAhead {
    ranges: Vec<(usize, usize)>,
    bytes: usize,
}

impl ReadAhead {
    /// Nothing to ask for.
    pub fn new() -> ReadAhead {
        ReadAhead::default()
    }

    /// Rows `first .. first + n` of `rows`' tensor (clipped to its rows).
    pub fn push_rows(&mut self, rows: &HostRows, first: usize, n: usize) {
        let end = (first + n).min(rows.rows);
        if first < end {
            self.push(rows.addr.wrapping_add(first * rows.row_bytes), (end - first) * rows.row_bytes);
        }
    }

    /// Every row each list names, of each of `tensors` (a run of consecutive rows as one range),
    /// list by list: e.g. the cache rows, keys and values, a decode attention reads for each of
    /// its sequences.
    pub fn push_listed_rows(&mut self, tensors: &[HostRows], lists: &[Vec<u32>]) {
        for list in lists {
            for (_, first, n) in multilora_cpu::float::runs(list) {
                for t in tensors {
                    self.push_rows(t, first, n);
                }
            }
        }
    }

    /// Bytes asked for so far.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Forgets every range (keeping the allocation for the next product).
    pub fn clear(&mut self) {
        self.ranges.clear();
        self.bytes = 0;
    }

    /// The ranges, at most [`AHEAD_MAX`] bytes of them in all (the first ones).
    pub(crate) fn ranges(&self) -> &[(usize, usize)] {
        if self.bytes <= AHEAD_MAX {
            return &self.ranges;
        }
        let mut sum = 0;
        let n = self.ranges.iter().take_while(|r| {
            sum += r.1;
            sum <= AHEAD_MAX
        });
        &self.ranges[..n.count()]
    }

    /// How many ranges.
    pub(crate) fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Puts the ranges from the `from`-th on before the others (keeping each part's order).
    pub(crate) fn move_to_front(&mut self, from: usize) {
        let from = from.min(self.ranges.len());
        self.ranges.rotate_left(from);
    }

    /// `len` bytes from address `addr`.
    fn push(&mut self, addr: usize, len: usize) {
        if len > 0 {
            self.ranges.push((addr, len));
            self.bytes += len;
        }
    }
}

/// Where the rows (along the last dimension) of a contiguous CPU tensor lie in memory: its first
/// row's address, the bytes of a row and the number of rows. `None` for any other tensor (on a
/// device, strided, of no dimension). The address stays valid as long as the tensor lives: candle
/// never moves a storage, its in-place ops write into it.
#[derive(Clone, Copy, Debug)]
pub struct HostRows {
    addr: usize,
    row_bytes: usize,
    rows: usize,
}

impl HostRows {
    /// The first row's address.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// The rows of `t`.
    pub fn of(t: &Tensor) -> Option<HostRows> {
        let cols = *t.dims().last()?;
        let rows = t.elem_count().checked_div(cols)?;
        let (storage, layout) = t.storage_and_layout();
        if !layout.is_contiguous() {
            return None;
        }
        let esz = t.dtype().size_in_bytes();
        let Storage::Cpu(cpu) = &*storage else { return None };
        Some(HostRows { addr: cpu_addr(cpu)? + layout.start_offset() * esz, row_bytes: cols * esz, rows })
    }
}

/// The address of a CPU storage's first element, for the float types slots and caches use.
fn cpu_addr(cpu: &CpuStorage) -> Option<usize> {
    Some(match cpu {
        CpuStorage::F32(v) => v.as_ptr() as usize,
        CpuStorage::F16(v) => v.as_ptr() as usize,
        CpuStorage::BF16(v) => v.as_ptr() as usize,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn rows_are_clipped_and_ranges_capped() -> candle_core::Result<()> {
        let t = Tensor::zeros((10, 8), DType::F16, &Device::Cpu)?;
        let rows = HostRows::of(&t).expect("a contiguous cpu tensor");
        let mut a = ReadAhead::new();
        a.push_rows(&rows, 8, 5);
        a.push_rows(&rows, 12, 1);
        assert_eq!(a.bytes(), 2 * 16, "rows 8 and 9 only");
        assert_eq!(a.ranges()[0].0, rows.addr + 8 * 16);
        assert!(HostRows::of(&t.t()?).is_none(), "a strided view");
        let slots = HostRows::of(&Tensor::zeros((3, 4, 8), DType::F16, &Device::Cpu)?).expect("3-d");
        assert_eq!((slots.rows, slots.row_bytes), (12, 16), "rows along the last dimension");
        let mut listed = ReadAhead::new();
        listed.push_listed_rows(&[rows, rows], &[vec![2, 3, 4, 7], vec![0]]);
        let at = |r: usize| rows.addr + r * 16;
        let want = [(at(2), 48), (at(2), 48), (at(7), 16), (at(7), 16), (at(0), 16), (at(0), 16)];
        assert_eq!(listed.ranges(), want, "runs of consecutive rows, each tensor in turn");
        let mut big = ReadAhead::new();
        for i in 0..10 {
            big.push(i << 30, AHEAD_MAX / 4);
        }
        assert_eq!(big.ranges().len(), 4, "the first AHEAD_MAX bytes");
        big.push(1 << 40, 64);
        big.move_to_front(10);
        assert_eq!(big.ranges()[0], (1 << 40, 64), "the last pushed leads");
        big.clear();
        assert_eq!((big.bytes(), big.ranges().len()), (0, 0));
        Ok(())
    }
}
