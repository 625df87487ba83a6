//! The device slot table: which adapter generation occupies each of the `max_loras` slots, when
//! each was last used, and every pin on a generation: the pins that keep a slot resident (running
//! requests' and the operator's), and the host pins of preempted requests, which keep only the
//! CPU entry. A plain data structure: it decides where an adapter goes; the store writes it there
//! through the `SlotSink`.

use std::collections::{HashMap, HashSet};

use multilora_types::AdapterGen;

#[derive(Clone, Copy, Debug)]
struct Slot {
    generation: AdapterGen,
    last_used: u64,
    /// Device bytes the slot holds for this adapter (its modules at `max_lora_rank`).
    bytes: u64,
}

/// Where [`SlotTable::place`] put a generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Already there: nothing to write.
    Resident(usize),
    /// A free slot: write it.
    Free(usize),
    /// `victim`'s slot, the least recently used one without pins: write over it.
    Evict {
        /// The slot.
        slot: usize,
        /// The generation that held it.
        victim: AdapterGen,
    },
}

/// Every slot holds a pinned generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AllPinned;

/// `max_loras` slots with LRU replacement among the unpinned ones.
///
/// Pins count per generation, not per slot: a request pins its generation at admission, possibly
/// before the generation has a slot, and the pin then holds whatever slot it gets. Host pins
/// (a preempted request's) are counted here too, so that one table answers whether anything holds
/// a generation, but they never protect a slot: [`SlotTable::place`] ignores them.
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Vec<Option<Slot>>,
    clock: u64,
    pins: HashMap<AdapterGen, u32>,
    host_pins: HashMap<AdapterGen, u32>,
    operator: HashSet<AdapterGen>,
}

/// Which count a pin is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PinKind {
    /// A running request's: keeps the slot and the CPU entry.
    Slot,
    /// A preempted request's: keeps the CPU entry only.
    Host,
}

impl SlotTable {
    pub(crate) fn new(max_loras: usize) -> SlotTable {
        SlotTable {
            slots: vec![None; max_loras],
            clock: 0,
            pins: HashMap::new(),
            host_pins: HashMap::new(),
            operator: HashSet::new(),
        }
    }

    /// The slot `generation` occupies. A scan: `max_loras` is small, and a scan of a few words beats a map.
    pub(crate) fn slot_of(&self, generation: &AdapterGen) -> Option<usize> {
        self.slots.iter().position(|s| s.is_some_and(|s| s.generation == *generation))
    }

    /// Gives `generation` a slot and marks it most recently used: its own slot if resident, else the
    /// lowest free slot, else the least recently used slot whose generation has no pin. Pinned
    /// slots are not candidates at all, so no sequence of calls can evict one.
    pub(crate) fn place(&mut self, generation: AdapterGen, bytes: u64) -> Result<Placement, AllPinned> {
        self.clock += 1;
        if let Some(slot) = self.slot_of(&generation) {
            if let Some(s) = self.slots[slot].as_mut() {
                s.last_used = self.clock;
            }
            return Ok(Placement::Resident(slot));
        }
        let placement = if let Some(slot) = self.slots.iter().position(Option::is_none) {
            Placement::Free(slot)
        } else {
            let (slot, victim) = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.map(|s| (i, s)))
                .filter(|(_, s)| !self.is_pinned(&s.generation))
                .min_by_key(|(_, s)| s.last_used)
                .map(|(i, s)| (i, s.generation))
                .ok_or(AllPinned)?;
            Placement::Evict { slot, victim }
        };
        let slot = match placement {
            Placement::Free(slot) | Placement::Evict { slot, .. } | Placement::Resident(slot) => slot,
        };
        self.slots[slot] = Some(Slot { generation, last_used: self.clock, bytes });
        Ok(placement)
    }

    /// Empties `slot` (a failed write, or a generation leaving), returning what it held.
    pub(crate) fn vacate(&mut self, slot: usize) -> Option<AdapterGen> {
        self.slots.get_mut(slot).and_then(Option::take).map(|s| s.generation)
    }

    /// Empties the slot `generation` holds, if any.
    pub(crate) fn remove(&mut self, generation: &AdapterGen) -> Option<usize> {
        let slot = self.slot_of(generation)?;
        self.slots[slot] = None;
        Some(slot)
    }

    fn counts(&mut self, kind: PinKind) -> &mut HashMap<AdapterGen, u32> {
        match kind {
            PinKind::Slot => &mut self.pins,
            PinKind::Host => &mut self.host_pins,
        }
    }

    /// Adds a pin of `kind`; returns that kind's count.
    pub(crate) fn pin(&mut self, generation: AdapterGen, kind: PinKind) -> u32 {
        let count = self.counts(kind).entry(generation).or_insert(0);
        *count += 1;
        *count
    }

    /// Drops one pin of `kind`; returns that kind's remaining count, or `None` when `generation`
    /// had none of it.
    pub(crate) fn release(&mut self, generation: &AdapterGen, kind: PinKind) -> Option<u32> {
        let counts = self.counts(kind);
        let count = counts.get_mut(generation)?;
        *count -= 1;
        let left = *count;
        if left == 0 {
            counts.remove(generation);
        }
        Some(left)
    }

    /// Whether a lease of either kind holds `generation` (so it is retired, not dropped, when it
    /// stops being current). The operator's pin is not a lease: it follows the current generation.
    pub(crate) fn leased(&self, generation: &AdapterGen) -> bool {
        self.pins.contains_key(generation) || self.host_pins.contains_key(generation)
    }

    /// Whether `generation`'s CPU entry must not be evicted: a slot pin (a request's or the
    /// operator's) or a host pin holds it.
    pub(crate) fn keeps_cpu(&self, generation: &AdapterGen) -> bool {
        self.is_pinned(generation) || self.host_pins.contains_key(generation)
    }

    /// Generations that host pins hold.
    pub(crate) fn host_pinned(&self) -> usize {
        self.host_pins.len()
    }

    /// Sets or clears the operator's pin on `generation`.
    pub(crate) fn set_operator_pin(&mut self, generation: AdapterGen, pinned: bool) {
        if pinned {
            self.operator.insert(generation);
        } else {
            self.operator.remove(&generation);
        }
    }

    /// Whether a running request or the operator pins `generation`'s slot (host pins do not).
    pub(crate) fn is_pinned(&self, generation: &AdapterGen) -> bool {
        self.pins.contains_key(generation) || self.operator.contains(generation)
    }

    /// `(slot, generation)` of every occupied slot.
    pub(crate) fn resident(&self) -> Vec<(usize, AdapterGen)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.map(|s| (i, s.generation))).collect()
    }

    /// Occupied slots, least recently used first (for tests and metrics).
    pub(crate) fn lru_order(&self) -> Vec<AdapterGen> {
        let mut occupied: Vec<Slot> = self.slots.iter().flatten().copied().collect();
        occupied.sort_by_key(|s| s.last_used);
        occupied.into_iter().map(|s| s.generation).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn occupied(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    pub(crate) fn pinned_slots(&self) -> usize {
        self.slots.iter().flatten().filter(|s| self.is_pinned(&s.generation)).count()
    }

    /// Device bytes the occupied slots hold.
    pub(crate) fn bytes(&self) -> u64 {
        self.slots.iter().flatten().map(|s| s.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::generation;
    use proptest::prelude::*;

    fn g(id: u64) -> AdapterGen {
        generation(id, 0)
    }

    #[test]
    fn lru_order_picks_the_victim() {
        let mut table = SlotTable::new(3);
        assert_eq!(table.place(g(0), 10), Ok(Placement::Free(0)));
        assert_eq!(table.place(g(1), 10), Ok(Placement::Free(1)));
        assert_eq!(table.place(g(2), 10), Ok(Placement::Free(2)));
        assert_eq!(table.place(g(0), 10), Ok(Placement::Resident(0)));
        assert_eq!(table.lru_order(), [g(1), g(2), g(0)]);
        assert_eq!(table.place(g(3), 10), Ok(Placement::Evict { slot: 1, victim: g(1) }));
        assert_eq!(table.lru_order(), [g(2), g(0), g(3)]);
        assert_eq!(table.bytes(), 30);
        assert_eq!(table.remove(&g(0)), Some(0));
        assert_eq!(table.place(g(4), 10), Ok(Placement::Free(0)));
    }

    #[test]
    fn pins_protect_and_all_pinned_is_an_error() {
        let mut table = SlotTable::new(2);
        table.place(g(0), 1).unwrap();
        table.place(g(1), 1).unwrap();
        table.pin(g(0), PinKind::Slot);
        // g(0) is older, but pinned: g(1) goes.
        assert_eq!(table.place(g(2), 1), Ok(Placement::Evict { slot: 1, victim: g(1) }));
        table.set_operator_pin(g(2), true);
        assert_eq!(table.place(g(3), 1), Err(AllPinned));
        assert_eq!(table.resident(), [(0, g(0)), (1, g(2))]);
        assert_eq!(table.pinned_slots(), 2);
        table.set_operator_pin(g(2), false);
        assert_eq!(table.place(g(3), 1), Ok(Placement::Evict { slot: 1, victim: g(2) }));
        assert_eq!(table.release(&g(0), PinKind::Slot), Some(0));
        assert_eq!(table.release(&g(0), PinKind::Slot), None);
        assert_eq!(SlotTable::new(0).place(g(0), 1), Err(AllPinned));
    }

    #[test]
    fn host_pins_keep_the_cpu_entry_but_not_the_slot() {
        let mut table = SlotTable::new(1);
        table.place(g(0), 1).unwrap();
        assert_eq!(table.pin(g(0), PinKind::Host), 1);
        assert_eq!(table.pin(g(0), PinKind::Host), 2);
        assert!(table.leased(&g(0)) && table.keeps_cpu(&g(0)) && !table.is_pinned(&g(0)));
        // A host pin protects no slot: the only slot goes to another generation.
        assert_eq!(table.place(g(1), 1), Ok(Placement::Evict { slot: 0, victim: g(0) }));
        assert_eq!((table.pinned_slots(), table.host_pinned()), (0, 1));
        // The two kinds count apart.
        assert_eq!(table.release(&g(0), PinKind::Slot), None);
        assert_eq!(table.release(&g(0), PinKind::Host), Some(1));
        assert_eq!(table.release(&g(0), PinKind::Host), Some(0));
        assert!(!table.leased(&g(0)) && !table.keeps_cpu(&g(0)));
        assert_eq!(table.host_pinned(), 0);
        // The operator's pin keeps the entry without being a lease.
        table.set_operator_pin(g(1), true);
        assert!(table.keeps_cpu(&g(1)) && !table.leased(&g(1)));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Place(u64),
        Pin(u64),
        Release(u64),
        HostPin(u64),
        HostRelease(u64),
        Operator(u64, bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..8u64).prop_map(Op::Place),
            2 => (0..8u64).prop_map(Op::Pin),
            2 => (0..8u64).prop_map(Op::Release),
            1 => (0..8u64).prop_map(Op::HostPin),
            1 => (0..8u64).prop_map(Op::HostRelease),
            1 => (0..8u64, any::<bool>()).prop_map(|(g, p)| Op::Operator(g, p)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the sequence, a pinned generation keeps its slot, `place` fails only when every
        /// slot is pinned (host pins never count), a generation never holds two slots, and the victim is the least
        /// recently used unpinned slot.
        #[test]
        fn pinned_slots_are_never_evicted(slots in 1..5usize, ops in proptest::collection::vec(op(), 1..200)) {
            let mut table = SlotTable::new(slots);
            for op in ops {
                let before = table.resident();
                match op {
                    Op::Place(id) => {
                        let lru_unpinned = table.lru_order().into_iter().find(|generation| !table.is_pinned(generation));
                        match table.place(g(id), 1) {
                            Ok(Placement::Evict { victim, .. }) => {
                                prop_assert!(!table.is_pinned(&victim));
                                prop_assert_eq!(Some(victim), lru_unpinned);
                            }
                            Ok(_) => {}
                            Err(AllPinned) => {
                                prop_assert_eq!(table.occupied(), slots);
                                prop_assert_eq!(table.pinned_slots(), slots);
                                prop_assert_eq!(table.resident(), before.clone());
                            }
                        }
                        if table.slot_of(&g(id)).is_some() {
                            prop_assert_eq!(table.lru_order().last().copied(), Some(g(id)));
                        }
                    }
                    Op::Pin(id) => { table.pin(g(id), PinKind::Slot); }
                    Op::Release(id) => { table.release(&g(id), PinKind::Slot); }
                    Op::HostPin(id) => { table.pin(g(id), PinKind::Host); }
                    Op::HostRelease(id) => { table.release(&g(id), PinKind::Host); }
                    Op::Operator(id, pinned) => table.set_operator_pin(g(id), pinned),
                }
                for (slot, generation) in &before {
                    if table.is_pinned(generation) {
                        prop_assert_eq!(table.slot_of(generation), Some(*slot));
                    }
                }
                let mut gens: Vec<AdapterGen> = table.resident().into_iter().map(|(_, generation)| generation).collect();
                gens.sort();
                gens.dedup();
                prop_assert_eq!(gens.len(), table.occupied());
            }
        }
    }
}
