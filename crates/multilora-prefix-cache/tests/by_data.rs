//! Data-driven checks of adapter separation and prefix hits: traces of requests in, cached tokens out.

use std::collections::HashSet;

use multilora_prefix_cache::{BlockHash, DEFAULT_HASH_SEED, ExtraKeys, KvConfig, KvManager, hash_blocks};

const A: [u8; 32] = [0xa1; 32];
const B: [u8; 32] = [0xb2; 32];
/// Adapter A reloaded in place with new weights: same name, new content fingerprint.
const A_RELOADED: [u8; 32] = {
    let mut k = [0xa1; 32];
    k[31] = 0xa2;
    k
};

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i * 31 + salt).collect()
}

#[test]
fn base_adapters_and_reload_give_disjoint_hashes() {
    let tokens = prompt(64, 0);
    let keys = [
        ("base", ExtraKeys::base()),
        ("adapter a", ExtraKeys::adapter(A)),
        ("adapter b", ExtraKeys::adapter(B)),
        ("adapter a reloaded", ExtraKeys::adapter(A_RELOADED)),
    ];
    let sets: Vec<(&str, HashSet<BlockHash>)> = keys
        .iter()
        .map(|(name, extra)| {
            let hashes = hash_blocks(DEFAULT_HASH_SEED, 16, &tokens, extra);
            assert_eq!(hashes.len(), 4, "{name}");
            (*name, hashes.into_iter().collect())
        })
        .collect();
    for (i, (name_i, set_i)) in sets.iter().enumerate() {
        assert_eq!(set_i.len(), 4, "{name_i}: blocks within one chain differ");
        for (name_j, set_j) in &sets[i + 1..] {
            assert!(set_i.is_disjoint(set_j), "{name_i} and {name_j} share a block hash");
        }
    }
}

/// One step of a trace: admit a request and expect so many cached tokens, or finish one.
#[derive(Debug)]
enum Step {
    /// Admit `id` with `tokens` under `extra`, compute the whole prompt, expect `cached` hits.
    Run {
        id: u64,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        cached: usize,
    },
    Finish(u64),
}

fn check(trace: Vec<Step>) {
    let mut kv = KvManager::new(KvConfig { num_blocks: 64, ..KvConfig::default() });
    for (i, step) in trace.into_iter().enumerate() {
        match step {
            Step::Run { id, tokens, extra, cached } => {
                assert_eq!(kv.lookup(&tokens, &extra, false), cached, "step {i}: lookup");
                let got = kv.admit(id, &tokens, &extra, false, tokens.len() - cached).unwrap();
                assert_eq!(got, cached, "step {i}: admit");
                assert_eq!(kv.block_table(id).len(), tokens.len().div_ceil(16), "step {i}");
                kv.commit(id, &tokens, tokens.len()).unwrap();
            }
            Step::Finish(id) => kv.free(id),
        }
    }
    let m = kv.metrics();
    assert_eq!(m.free_blocks + (m.usage * 64.0).round() as usize, 64);
}

fn run(id: u64, tokens: &[u32], extra: &ExtraKeys, cached: usize) -> Step {
    Step::Run { id, tokens: tokens.to_vec(), extra: extra.clone(), cached }
}

#[test]
fn same_prompt_same_adapter_hits_every_full_block() {
    let a = ExtraKeys::adapter(A);
    let unaligned = prompt(70, 0); // 4 full blocks and a tail of 6
    let aligned = prompt(64, 1); // exactly 4 blocks
    check(vec![
        run(1, &unaligned, &a, 0),
        Step::Finish(1),
        run(2, &unaligned, &a, 64),
        // Block-aligned: the last block recomputes so the last token yields logits.
        run(3, &aligned, &a, 0),
        Step::Finish(3),
        run(4, &aligned, &a, 48),
        // While request 4 still runs, a third copy hits the same 3 blocks.
        run(5, &aligned, &a, 48),
    ]);
}

#[test]
fn same_prompt_other_adapter_or_reload_hits_nothing() {
    let tokens = prompt(48, 2);
    check(vec![
        run(1, &tokens, &ExtraKeys::adapter(A), 0),
        Step::Finish(1),
        run(2, &tokens, &ExtraKeys::base(), 0),
        run(3, &tokens, &ExtraKeys::adapter(B), 0),
        run(4, &tokens, &ExtraKeys::adapter(A_RELOADED), 0),
        run(5, &tokens, &ExtraKeys::adapter(A), 32),
        run(6, &tokens, &ExtraKeys::adapter(A).with_salt(b"tenant-7".to_vec()), 0),
    ]);
}

#[test]
fn forty_shared_tokens_hit_two_blocks() {
    let cached = prompt(64, 3);
    let mut other = cached[..40].to_vec();
    other.extend(prompt(30, 1000)); // diverges at token 40, inside the third block
    let a = ExtraKeys::adapter(A);
    check(vec![run(1, &cached, &a, 0), Step::Finish(1), run(2, &other, &a, 32)]);
}

#[test]
fn hits_work_across_a_decode_that_filled_blocks() {
    // A request decodes past its prompt; blocks filled by outputs are cached too.
    let a = ExtraKeys::adapter(A);
    let mut kv = KvManager::new(KvConfig { num_blocks: 16, ..KvConfig::default() });
    let mut tokens = prompt(20, 4);
    kv.admit(1, &tokens, &a, false, 20).unwrap();
    kv.commit(1, &tokens, 20).unwrap();
    for t in 0..20 {
        tokens.push(9000 + t);
        kv.allocate(1, tokens.len()).unwrap();
        kv.commit(1, &tokens, tokens.len()).unwrap();
    }
    assert_eq!(kv.num_committed_tokens(1), 32);
    kv.free(1);
    let mut follow_up = tokens.clone();
    follow_up.extend([1, 2, 3]);
    assert_eq!(kv.lookup(&follow_up, &a, false), 32);
}
