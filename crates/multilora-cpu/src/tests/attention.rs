//! The streaming prefill attention against its definition (an f64 softmax over the whole masked
//! row, materialised): grouped query heads, odd lengths, key-block and query-tile boundaries,
//! sliding windows, a cached prefix and scattered cache rows, f32 and bf16 caches, on every
//! instruction set; a prompt chunked over several calls and any thread count give the same bits
//! as one call; the workspace is bounded whatever the prompt; operands that do not fit are refused.

use half::{bf16, f16};

use super::{FromF32, Rng};
use crate::float::{Causal, Elem, KEY_BLOCK, causal_attention, causal_workspace_bytes, query_tile};
use crate::{Error, Isa};

/// One case: caches of `cache_rows` rows, `ctx` context positions scattered over them.
struct Case<E> {
    q: Vec<f32>,
    k: Vec<E>,
    v: Vec<E>,
    /// The cache row of every position `0..ctx`.
    rows: Vec<u32>,
    heads: usize,
    kv_heads: usize,
    hd: usize,
}

impl<E: Elem + FromF32> Case<E> {
    /// `ctx` positions of queries (all of them, so any range can be the new ones).
    fn new(seed: u64, ctx: usize, heads: usize, kv_heads: usize, hd: usize) -> Case<E> {
        let mut rng = Rng::new(seed);
        let width = kv_heads * hd;
        let cache_rows = ctx + 7;
        // Rows in blocks of 16, the blocks in a scrambled order (as a paged cache gives them).
        let blocks = cache_rows.div_ceil(16);
        let rows = (0..ctx).map(|p| (((p / 16) * 7 % blocks) * 16 + p % 16) as u32).collect::<Vec<_>>();
        let rows = rows.into_iter().map(|r| r.min(cache_rows as u32 - 1)).collect::<Vec<_>>();
        let scale = 1.0 / (hd as f32).sqrt();
        let cache = |rng: &mut Rng| rng.vec(cache_rows * width, 2.0).into_iter().map(E::from_f32).collect();
        Case {
            q: rng.vec(ctx * heads * hd, 2.0 * scale),
            k: cache(&mut rng),
            v: cache(&mut rng),
            rows,
            heads,
            kv_heads,
            hd,
        }
    }

    /// The operands for new queries `start..end`, with the context from `lo`.
    fn causal(&self, start: usize, end: usize, lo: usize, window: Option<usize>) -> Causal<'_, E> {
        let row = self.heads * self.hd;
        Causal {
            q: &self.q[start * row..end * row],
            k: &self.k,
            v: &self.v,
            rows: &self.rows[lo..end],
            heads: self.heads,
            kv_heads: self.kv_heads,
            hd: self.hd,
            start,
            lo,
            window,
        }
    }

    /// The definition, in f64: each query's masked row of scores, its softmax, times `V`.
    fn oracle(&self, start: usize, end: usize, window: Option<usize>) -> Vec<f64> {
        let (hd, group) = (self.hd, self.heads / self.kv_heads);
        let width = self.kv_heads * hd;
        let mut out = Vec::with_capacity((end - start) * self.heads * hd);
        for p in start..end {
            let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
            for h in 0..self.heads {
                let q = &self.q[(p * self.heads + h) * hd..][..hd];
                let col = h / group * hd;
                let at = |t: usize| self.rows[t] as usize * width + col;
                let s: Vec<f64> = (first..=p)
                    .map(|t| q.iter().zip(&self.k[at(t)..][..hd]).map(|(&a, b)| a as f64 * b.to_f32() as f64).sum())
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    out.push(
                        (first..=p).zip(&e).map(|(t, w)| w * self.v[at(t) + d].to_f32() as f64).sum::<f64>() / sum,
                    );
                }
            }
        }
        out
    }
}

fn run<E: Elem>(isa: Isa, c: Causal<'_, E>) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.q.len()];
    causal_attention(isa, c, &mut out).expect("the operands fit");
    out
}

/// Largest error of an output relative to its head's output (`|got − want| / max |want|` over the
/// head's `hd` values): a value near 0 amid values near 1 is as exact as they are, not more.
fn worst(got: &[f32], want: &[f64], hd: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    let heads = got.chunks(hd).zip(want.chunks(hd));
    heads
        .map(|(g, w)| {
            let scale = w.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
            g.iter().zip(w).map(|(&g, &w)| (g as f64 - w).abs() / scale).fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

fn against_oracle<E: Elem + FromF32>(name: &str) {
    // (context, heads, kv heads, head dim): MHA, GQA by 3 (SmolLM2) and 4 (Llama), an odd head.
    let shapes = [(1, 2, 2, 16), (70, 4, 4, 16), (150, 9, 3, 64), (200, 8, 2, 32), (131, 3, 1, 24)];
    for (seed, &(ctx, heads, kv_heads, hd)) in shapes.iter().enumerate() {
        let case = Case::<E>::new(seed as u64, ctx, heads, kv_heads, hd);
        // (new queries from, window): a whole prompt, one after a cached prefix that starts
        // mid-block, one query, windows shorter and longer than a key block.
        let starts = [0, ctx / 3, ctx - 1];
        for &start in &starts {
            for window in [None, Some(1), Some(5), Some(KEY_BLOCK + 3)] {
                let lo = window.map_or(0, |w| (start + 1).saturating_sub(w));
                let want = case.oracle(start, ctx, window);
                for isa in Isa::available_of(&Isa::FLOAT) {
                    let got = run(isa, case.causal(start, ctx, lo, window));
                    let err = worst(&got, &want, hd);
                    assert!(
                        err <= 1e-5,
                        "{name} {isa:?} ctx {ctx} heads {heads}/{kv_heads}×{hd} from {start}, window {window:?}: {err:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn equals_the_definition_f32() {
    against_oracle::<f32>("f32");
}

#[test]
fn equals_the_definition_bf16() {
    against_oracle::<bf16>("bf16");
}

/// A prompt in one call, in chunks that end anywhere (mid-tile, mid-block), each continuing from
/// the cache, and on pools of 1, 2 and 3 threads: the same bits for every query.
#[test]
fn chunks_and_threads_give_the_same_bits() {
    let case = Case::<bf16>::new(9, 300, 8, 2, 32);
    let tile = query_tile(4, 300);
    for window in [None, Some(100)] {
        let whole = run(Isa::best(), case.causal(0, 300, 0, window));
        let row = case.heads * case.hd;
        for cuts in [vec![1, 300], vec![tile + 1, 2 * KEY_BLOCK - 1, 300], vec![37, 38, 200, 300]] {
            let mut start = 0usize;
            for end in cuts {
                let lo = window.map_or(0, |w| (start + 1).saturating_sub(w));
                let got = run(Isa::best(), case.causal(start, end, lo, window));
                let same = got.iter().zip(&whole[start * row..end * row]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "window {window:?}: queries {start}..{end} alone differ from the whole prompt's");
                start = end;
            }
        }
        // Past 2,048 positions the tiles widen: a prompt that crosses it in chunks.
        let long = Case::<bf16>::new(10, 2100, 4, 1, 16);
        let whole_long = run(Isa::best(), long.causal(0, 2100, 0, window));
        let lo = window.map_or(0, |w| 2001usize.saturating_sub(w));
        let tail = run(Isa::best(), long.causal(2000, 2100, lo, window));
        assert!(
            tail.iter().zip(&whole_long[2000 * 64..]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "window {window:?}: past 2,048"
        );
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a pool");
            let got = pool.install(|| run(Isa::best(), case.causal(0, 300, 0, window)));
            assert!(got.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads differ");
        }
    }
}

/// A thread's workspace after a prompt of 4,000 queries over 4,000 keys stays within
/// `causal_workspace_bytes`, the bound a 100-query prompt has: independent of the length.
#[test]
fn the_workspace_is_bounded_whatever_the_prompt() {
    for (heads, kv_heads, hd) in [(9, 3, 64), (8, 1, 32)] {
        // A fresh thread for each shape: its workspace is this shape's alone.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
        let bound = causal_workspace_bytes(heads / kv_heads, hd);
        for len in [100, 4000] {
            let case = Case::<f16>::new(3, len, heads, kv_heads, hd);
            let used = pool.install(|| {
                run(Isa::best(), case.causal(0, len, 0, None));
                crate::float::workspace_bytes()
            });
            assert!(used <= bound, "{heads}/{kv_heads}×{hd}, {len} queries: {used} bytes of workspace, over {bound}");
        }
        assert!(bound < 1 << 20, "{bound} bytes a thread");
    }
}

/// Operands that do not fit are refused before anything is read.
#[test]
fn refuses_what_does_not_fit() {
    let case = Case::<f32>::new(1, 40, 4, 2, 16);
    let mut out = vec![0f32; 40 * 64];
    let refused = |c: Causal<'_, f32>, out: &mut [f32]| {
        matches!(causal_attention(Isa::best(), c, out), Err(Error::Attention { .. }))
    };
    assert!(refused(Causal { heads: 3, ..case.causal(0, 40, 0, None) }, &mut out));
    assert!(refused(case.causal(0, 40, 0, None), &mut out[1..]));
    assert!(refused(Causal { rows: &case.rows[..39], ..case.causal(0, 40, 0, None) }, &mut out));
    // A context from past the first query's window start.
    assert!(refused(Causal { lo: 1, rows: &case.rows[1..40], ..case.causal(0, 40, 0, None) }, &mut out));
    let past = [u32::MAX; 40];
    assert!(refused(Causal { rows: &past, ..case.causal(0, 40, 0, None) }, &mut out));
    assert!(refused(case.causal(0, 40, 0, Some(0)), &mut out));
}
