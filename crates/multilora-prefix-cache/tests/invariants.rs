//! Property tests: random admit / allocate / commit / decode / free traces keep the pool's
//! invariants, with and without caching, and with a sliding group (a second pool whose blocks
//! behind the window are freed).

use std::collections::HashMap;

use multilora_prefix_cache::{
    BlockId, BlockPool, Error, ExtraKeys, KvConfig, KvManager, KvMetrics, NULL_BLOCK, SlidingKv,
};
use proptest::prelude::*;

const NUM_BLOCKS: usize = 12;
const BLOCK_SIZE: usize = 4;
const NUM_IDS: u64 = 6;
/// The sliding group of the sliding traces: a window of 6 tokens, a pool of 8 blocks.
const SLIDING: SlidingKv = SlidingKv { window: 6, num_blocks: 8 };

/// Three adapters (the last one a "reload" of the second with one byte changed) and the base model.
fn extra(adapter: u8) -> ExtraKeys {
    match adapter {
        0 => ExtraKeys::base(),
        1 => ExtraKeys::adapter([1; 32]),
        2 => ExtraKeys::adapter([2; 32]),
        _ => {
            let mut k = [2; 32];
            k[0] = 3;
            ExtraKeys::adapter(k)
        }
    }
}

/// Prompts drawn from a few sequences that share their first 8 tokens, so hits happen often.
fn prompt(choice: u8, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| if i < 8 { i } else { i * 7 + u32::from(choice) * 1000 }).collect()
}

#[derive(Clone, Debug)]
enum Op {
    Admit {
        id: u64,
        choice: u8,
        len: usize,
        adapter: u8,
        skip: bool,
        /// Uncomputed tokens to hold room for, beyond the cached prefix (clamped to the prompt).
        chunk: usize,
        /// Extra room asked for on top, to push the pool into allocation failures.
        extra_room: usize,
    },
    Allocate {
        id: u64,
        extra_room: usize,
    },
    Commit {
        id: u64,
        upto: usize,
    },
    Decode {
        id: u64,
        token: u32,
    },
    Free {
        id: u64,
    },
}

/// Mostly small, sometimes large, so that allocation both succeeds often and sometimes fails.
fn extra_room() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0..3usize, 1 => 0..40usize]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..NUM_IDS, 0..3u8, 0..24usize, 0..4u8, prop::bool::weighted(0.15), 0..24usize, extra_room())
            .prop_map(|(id, choice, len, adapter, skip, chunk, extra_room)| Op::Admit {
                id, choice, len, adapter, skip, chunk, extra_room
            }),
        1 => (0..NUM_IDS + 1, extra_room()).prop_map(|(id, extra_room)| Op::Allocate { id, extra_room }),
        3 => (0..NUM_IDS + 1, 0..32usize).prop_map(|(id, upto)| Op::Commit { id, upto }),
        2 => (0..NUM_IDS, 0..4u32).prop_map(|(id, token)| Op::Decode { id, token }),
        2 => (0..NUM_IDS + 1).prop_map(|id| Op::Free { id }),
    ]
}

/// What the test knows of a request.
#[derive(Debug)]
struct Req {
    tokens: Vec<u32>,
    adapter: u8,
    computed: usize,
}

/// What a block's KV was computed from: the adapter and every token up to the block's end.
type Content = (u8, Vec<u32>);

/// Everything observable, to check that a failed call changes nothing.
#[derive(Debug, PartialEq)]
struct Snapshot {
    metrics: KvMetrics,
    free_queue: Vec<BlockId>,
    blocks: Vec<BlockState>,
    tables: Vec<(bool, Vec<BlockId>, Vec<BlockId>)>,
    /// The sliding pool's free queue and blocks.
    sliding: Option<(Vec<BlockId>, Vec<BlockState>)>,
}

/// A block's reference count and hash.
type BlockState = (u32, Option<u128>);

fn blocks(pool: &BlockPool) -> Vec<BlockState> {
    (0..pool.num_blocks() as u32).map(|b| (pool.ref_count(b), pool.block_hash(b).map(|h| h.0))).collect()
}

fn snapshot(kv: &KvManager) -> Snapshot {
    let pool = kv.pool();
    Snapshot {
        metrics: kv.metrics(),
        free_queue: pool.free_queue().collect(),
        blocks: blocks(pool),
        tables: (0..=NUM_IDS)
            .map(|id| (kv.contains(id), kv.block_table(id).to_vec(), kv.sliding_table(id).to_vec()))
            .collect(),
        sliding: kv.sliding_pool().map(|p| (p.free_queue().collect(), blocks(p))),
    }
}

/// The first block a query at `pos` reads in the sliding layers.
fn first_needed(pos: usize) -> usize {
    (pos + 1).saturating_sub(SLIDING.window) / BLOCK_SIZE
}

/// The sliding pool's invariants: every table as long as the full one, null exactly before the
/// window of its next query (`computed`), reference counts equal to the tables holding each
/// block, the free queue the unreferenced blocks, once each.
fn check_sliding(kv: &KvManager, reqs: &HashMap<u64, Req>) {
    let Some(pool) = kv.sliding_pool() else { return };
    let mut refs = vec![0u32; pool.num_blocks()];
    for (id, req) in reqs {
        let table = kv.sliding_table(*id);
        assert_eq!(table.len(), kv.block_table(*id).len(), "request {id}: sliding table length");
        let first = first_needed(req.computed).min(table.len());
        assert!(
            table[..first].iter().all(|&b| b == NULL_BLOCK),
            "request {id}: {table:?} keeps blocks behind its window"
        );
        assert!(table[first..].iter().all(|&b| b != NULL_BLOCK), "request {id}: {table:?} lacks a block of its window");
        for &b in &table[first..] {
            refs[b as usize] += 1;
        }
    }
    for b in 0..pool.num_blocks() as u32 {
        assert_eq!(pool.ref_count(b), refs[b as usize], "sliding ref count of block {b}");
        assert_eq!(pool.is_free(b), refs[b as usize] == 0, "sliding block {b} free while referenced");
    }
    let mut queue: Vec<_> = pool.free_queue().collect();
    assert_eq!(queue.len(), pool.num_free_blocks());
    queue.sort_unstable();
    queue.dedup();
    assert_eq!(queue.len(), pool.num_free_blocks(), "a sliding block is queued twice");
}

fn check_invariants(kv: &KvManager, reqs: &HashMap<u64, Req>) {
    let pool = kv.pool();
    let mut refs = [0u32; NUM_BLOCKS];
    let mut holder_adapter: Vec<Option<u8>> = vec![None; NUM_BLOCKS];
    for (id, req) in reqs {
        for &b in kv.block_table(*id) {
            refs[b as usize] += 1;
            // Two requests holding one block must run the same adapter.
            if let Some(other) = holder_adapter[b as usize] {
                assert_eq!(other, req.adapter, "block {b} shared across adapters");
            }
            holder_adapter[b as usize] = Some(req.adapter);
        }
    }
    for b in 0..NUM_BLOCKS as u32 {
        // Reference counts are exactly the number of tables holding the block: never "negative",
        // never leaked.
        assert_eq!(pool.ref_count(b), refs[b as usize], "ref count of block {b}");
        assert_eq!(pool.is_free(b), refs[b as usize] == 0, "block {b} free while referenced");
    }
    let queue: Vec<_> = pool.free_queue().collect();
    assert_eq!(queue.len(), pool.num_free_blocks());
    let mut sorted = queue.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), queue.len(), "a block is queued twice");
    let m = kv.metrics();
    assert!(m.hit_tokens <= m.query_tokens);
    assert!((0.0..=1.0).contains(&m.usage));
}

fn run_trace(caching: bool, sliding: Option<SlidingKv>, ops: Vec<Op>) {
    let mut kv = KvManager::new(KvConfig {
        num_blocks: NUM_BLOCKS,
        block_size: BLOCK_SIZE,
        enable_prefix_caching: caching,
        hash_seed: 0,
        sliding,
    });
    let mut reqs: HashMap<u64, Req> = HashMap::new();
    // Content of the KV each block holds, set when a commit says it was computed; the same for
    // the sliding pool's blocks.
    let mut content: Vec<Option<Content>> = vec![None; NUM_BLOCKS];
    let mut s_content: Vec<Option<Content>> = vec![None; sliding.map_or(0, |s| s.num_blocks)];

    for op in ops {
        let before = snapshot(&kv);
        let result: Result<(), Error> = match op {
            Op::Admit { id, choice, len, adapter, skip, chunk, extra_room } => {
                let tokens = prompt(choice, len);
                let keys = extra(adapter);
                let cached = kv.lookup(&tokens, &keys, skip);
                assert_eq!(cached % BLOCK_SIZE, 0);
                assert!(cached < tokens.len() || cached == 0, "a full hit must leave a token");
                let new = chunk.min(tokens.len() - cached) + extra_room;
                let table_before = content.clone();
                let s_before = s_content.clone();
                match kv.admit(id, &tokens, &keys, skip, new) {
                    Ok(got) => {
                        assert!(!reqs.contains_key(&id));
                        assert_eq!(got, cached, "admit returns what lookup said");
                        let table = kv.block_table(id);
                        assert_eq!(table.len(), (cached + new).div_ceil(BLOCK_SIZE));
                        for (i, &b) in table.iter().enumerate() {
                            if i < cached / BLOCK_SIZE {
                                // A hit must hold exactly this adapter's KV for this prefix.
                                let want = (adapter, tokens[..(i + 1) * BLOCK_SIZE].to_vec());
                                assert_eq!(table_before[b as usize].as_ref(), Some(&want), "hit block {b}");
                            } else {
                                content[b as usize] = None;
                            }
                        }
                        for (i, &b) in kv.sliding_table(id).iter().enumerate() {
                            if b == NULL_BLOCK {
                                assert!(i < first_needed(cached), "block {i} of the hit's window is null");
                            } else if i < cached / BLOCK_SIZE {
                                // The hit's window must hold this adapter's KV for this prefix.
                                let want = (adapter, tokens[..(i + 1) * BLOCK_SIZE].to_vec());
                                assert_eq!(s_before[b as usize].as_ref(), Some(&want), "sliding hit block {b}");
                            } else {
                                s_content[b as usize] = None;
                            }
                        }
                        reqs.insert(id, Req { tokens, adapter, computed: cached });
                        Ok(())
                    }
                    Err(e) => {
                        if reqs.contains_key(&id) {
                            assert_eq!(e, Error::AlreadyAdmitted(id));
                        } else {
                            assert_eq!(e.kind(), "no_free_blocks");
                        }
                        Err(e)
                    }
                }
            }
            Op::Allocate { id, extra_room } => {
                let total = reqs.get(&id).map_or(0, |r| r.tokens.len()) + extra_room;
                let old = kv.block_table(id).len();
                let r = kv.allocate(id, total);
                match (&r, reqs.contains_key(&id)) {
                    (Ok(()), true) => {
                        for &b in &kv.block_table(id)[old..] {
                            content[b as usize] = None;
                        }
                        for &b in kv.sliding_table(id).get(old..).unwrap_or_default() {
                            s_content[b as usize] = None;
                        }
                    }
                    (Err(Error::UnknownRequest(_)), false) | (Err(Error::NoFreeBlocks { .. }), true) => {}
                    other => panic!("allocate: {other:?}"),
                }
                r
            }
            Op::Commit { id, upto } => match reqs.get_mut(&id) {
                None => {
                    assert_eq!(kv.commit(id, &[], 0), Err(Error::UnknownRequest(id)));
                    Err(Error::UnknownRequest(id))
                }
                Some(req) => {
                    let capacity = kv.block_table(id).len() * BLOCK_SIZE;
                    let hi = req.tokens.len().min(capacity);
                    let n = req.computed.max(upto.min(hi));
                    // The sliding blocks the commit computes: it may free them behind the window.
                    let table = kv.sliding_table(id).to_vec();
                    kv.commit(id, &req.tokens, n).unwrap();
                    req.computed = n;
                    for (i, &b) in kv.block_table(id)[..n / BLOCK_SIZE].iter().enumerate() {
                        let want = (req.adapter, req.tokens[..(i + 1) * BLOCK_SIZE].to_vec());
                        if let Some(have) = &content[b as usize] {
                            assert_eq!(have, &want, "block {b} rewritten with other content");
                        }
                        content[b as usize] = Some(want);
                    }
                    for (i, &b) in table.iter().enumerate().take(n / BLOCK_SIZE) {
                        if b != NULL_BLOCK {
                            let want = (req.adapter, req.tokens[..(i + 1) * BLOCK_SIZE].to_vec());
                            if let Some(have) = &s_content[b as usize] {
                                assert_eq!(have, &want, "sliding block {b} rewritten with other content");
                            }
                            s_content[b as usize] = Some(want);
                        }
                    }
                    Ok(())
                }
            },
            Op::Decode { id, token } => match reqs.get_mut(&id) {
                Some(req) if req.computed == req.tokens.len() => {
                    let old = kv.block_table(id).len();
                    let r = kv.allocate(id, req.tokens.len() + 1);
                    if r.is_ok() {
                        for &b in &kv.block_table(id)[old..] {
                            content[b as usize] = None;
                        }
                        for &b in kv.sliding_table(id).get(old..).unwrap_or_default() {
                            s_content[b as usize] = None;
                        }
                        req.tokens.push(token);
                    }
                    r
                }
                _ => Ok(()),
            },
            Op::Free { id } => {
                kv.free(id);
                reqs.remove(&id);
                assert!(!kv.contains(id));
                Ok(())
            }
        };
        if result.is_err() {
            assert_eq!(before, snapshot(&kv), "a failed call changed state");
        }
        check_invariants(&kv, &reqs);
        check_sliding(&kv, &reqs);
        if !caching {
            assert_eq!(kv.pool().num_cached_blocks(), 0);
        }
    }

    for id in 0..=NUM_IDS {
        kv.free(id);
    }
    reqs.clear();
    check_invariants(&kv, &reqs);
    assert_eq!(kv.num_free_blocks(), NUM_BLOCKS, "every block comes back");
    if let Some(pool) = kv.sliding_pool() {
        assert_eq!(pool.num_free_blocks(), pool.num_blocks(), "every sliding block comes back");
    }
    assert_eq!(kv.metrics().usage, 0.0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn invariants_hold_with_caching(ops in prop::collection::vec(op(), 1..80)) {
        run_trace(true, None, ops);
    }

    #[test]
    fn invariants_hold_without_caching(ops in prop::collection::vec(op(), 1..60)) {
        run_trace(false, None, ops);
    }

    #[test]
    fn invariants_hold_with_a_sliding_group(ops in prop::collection::vec(op(), 1..80), caching in any::<bool>()) {
        run_trace(caching, Some(SLIDING), ops);
    }
}
