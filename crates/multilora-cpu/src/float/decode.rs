//! Decode attention over a paged cache: each row's one query against its context, the keys and
//! values read straight from the cache rows the row names (no gather, no transpose, no padding;
//! half-precision caches widened as they are read).
//!
//! For each row and KV head, the `group` query heads that share it are read against each key
//! once. On AVX-512, for groups of 1 to 4 and head sizes a multiple of 16, one pass of
//! [`super::attend`] does the scores, the softmax and `P · V`. Otherwise the query heads are one
//! `[group, d]` matrix: the scores are `q_g · Kᵀ` over each run of consecutive cache rows (a
//! cache block) with the streaming kernel, the softmax in f32 ([`super::softmax_stats`]), and
//! `P · V` as outer products over the same runs, each run's chains continuing the last one's.
//! Each row's KV heads, and the parts of a context past [`DECODE_PART`] keys, are tasks of their
//! own on the pool, the parts merged by their softmax statistics (one long context on several
//! threads). Each output is the same chain of operations whatever the batch, so a row's result
//! does not depend on the other rows.

use std::ops::Range;

use super::{Elem, Head, attend, attend_supports, exp, matmul_into_with, matmul_t_into_with, softmax_stats};
use crate::error::{Error, Result};
use crate::isa::Isa;

thread_local! {
    /// Each thread's scores, reused from sequence to sequence (a step's attention runs a few
    /// hundred sequences, each a fresh allocation otherwise).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Keys of one part of a long decode context: a context past it is attended in parts of this
/// many keys side by side, and the parts merged by their softmax statistics. The parts follow from
/// the row's own length alone, so its result does not depend on the batch; a context of at most
/// this many keys is one part, its result that of the whole.
pub const DECODE_PART: usize = 1024;

/// The key ranges a context of `ctx` keys is attended in.
fn parts(ctx: usize) -> impl Iterator<Item = Range<usize>> {
    (0..ctx.div_ceil(DECODE_PART).max(1)).map(move |p| p * DECODE_PART..((p + 1) * DECODE_PART).min(ctx))
}

/// `out` (`[n, heads · hd]`) `= softmax(q · Kᵀ) · V` for each decode row: `q` (`[n, heads · hd]`,
/// already scaled) over the context whose cache rows `rows[i]` names, in the caches `k`, `v`
/// (`[cache rows, kv_heads · hd]`); on `isa` (portable where the CPU lacks it). A task per row, KV
/// head and part of its context (`parts`) on the pool; a context of one part writes its output in
/// place, a longer one's parts are merged into it.
///
/// # Errors
/// [`Error::Attention`] when the heads do not group, the slices disagree with the shapes, or a
/// context is empty or names a row past the caches.
pub fn decode_attention<E: Elem>(
    isa: Isa,
    q: &[f32],
    k: &[E],
    v: &[E],
    rows: &[Vec<u32>],
    (heads, kv_heads, hd): (usize, usize, usize),
    out: &mut [f32],
) -> Result<()> {
    let bad = |reason: String| Err(Error::Attention { reason });
    if kv_heads == 0 || hd == 0 || !heads.is_multiple_of(kv_heads) {
        return bad(format!("{heads} query heads over {kv_heads} kv heads of {hd}"));
    }
    let n = rows.len();
    if q.len() != n * heads * hd || out.len() != q.len() {
        return bad(format!(
            "{} query values and {} outputs for {n} rows of {heads} heads of {hd}",
            q.len(),
            out.len()
        ));
    }
    let width = kv_heads * hd;
    let cache_rows = (k.len() / width).min(v.len() / width);
    let past = rows.iter().enumerate().find(|(_, r)| r.is_empty() || r.iter().any(|&x| x as usize >= cache_rows));
    if let Some((i, r)) = past {
        return bad(format!("row {i} attends over {} cache rows, of which one is past {cache_rows} or none", r.len()));
    }
    let d = Dims { heads, kv_heads, hd };
    let (k, v) = (&k[..cache_rows * width], &v[..cache_rows * width]);
    let (group, per_head) = (heads / kv_heads, heads / kv_heads * hd);
    // Each (row, KV head) of one part writes its output in place; a split one's parts write into
    // `partial` and are merged below.
    let split = |i: usize| rows[i].len() > DECODE_PART;
    let parted: usize = (0..n).filter(|&i| split(i)).map(|i| parts(rows[i].len()).count() * kv_heads).sum();
    let mut partial = vec![0f32; parted * per_head];
    let mut stats = vec![(0f32, 0f32); (parted + n * kv_heads) * group];
    let (mut spare, mut st) = (partial.chunks_mut(per_head), stats.chunks_mut(group));
    let (mut work, mut merges) = (Vec::new(), Vec::new());
    for ((i, h), o) in (0..n).flat_map(|i| (0..kv_heads).map(move |h| (i, h))).zip(out.chunks_mut(per_head)) {
        if !split(i) {
            work.push((o, st.next().expect("sized above"), (i, h, 0..rows[i].len())));
            continue;
        }
        let first = work.len();
        for p in parts(rows[i].len()) {
            work.push((spare.next().expect("sized above"), st.next().expect("sized above"), (i, h, p)));
        }
        merges.push((o, first..work.len()));
    }
    crate::pool::for_each_part(work, |_, (o, st, (i, h, p))| {
        let q = &q[(i * kv_heads + h) * per_head..][..per_head];
        SCORES.with_borrow_mut(|scores| head(isa, q, k, v, &rows[i][p], d, h, o, scores, st))
    });
    // The split heads' parts lie in `partial` one after the other, their stats at their tasks'.
    let mut at = 0;
    for (o, tasks) in merges {
        let n = tasks.len();
        merge(&partial[at * per_head..(at + n) * per_head], &stats[tasks.start * group..tasks.end * group], hd, o);
        at += n;
    }
    Ok(())
}

/// The heads of a decode attention.
#[derive(Clone, Copy)]
struct Dims {
    heads: usize,
    kv_heads: usize,
    hd: usize,
}

/// `o` (`[group, hd]`) from the outputs of a context's parts (`[parts, group, hd]`, each
/// normalised by its own sum) and their `(max, sum)` per query head: each part weighs its sum
/// times `exp(max − the largest max)`.
fn merge(partial: &[f32], stats: &[(f32, f32)], hd: usize, o: &mut [f32]) {
    let group = o.len() / hd;
    for (g, o) in o.chunks_exact_mut(hd).enumerate() {
        let at = |p: usize| stats[p * group + g];
        let parts = stats.len() / group;
        let top = (0..parts).map(|p| at(p).0).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = (0..parts).map(|p| at(p).1 * exp(at(p).0 - top)).collect();
        let inv = 1.0 / weights.iter().sum::<f32>();
        o.fill(0.0);
        for (p, w) in weights.iter().enumerate() {
            let part = &partial[(p * group + g) * hd..][..hd];
            o.iter_mut().zip(part).for_each(|(y, &x)| *y += w * inv * x);
        }
    }
}

/// One decode row's KV head `kvh` over `rows` (all its context or a part): `q`, `o`: its group of
/// query heads, `[group, head_dim]`; each row `< k.len() / width`; each query head's softmax
/// `(max, sum)` in `stats`.
#[allow(clippy::too_many_arguments)]
fn head<E: Elem>(
    isa: Isa,
    q: &[f32],
    k: &[E],
    v: &[E],
    rows: &[u32],
    d: Dims,
    kvh: usize,
    o: &mut [f32],
    scores: &mut Vec<f32>,
    stats: &mut [(f32, f32)],
) {
    let (hd, group) = (d.hd, d.heads / d.kv_heads);
    let (width, col, ctx) = (d.kv_heads * hd, kvh * hd, rows.len());
    if attend_supports(isa, group, hd) {
        attend(isa, Head { q, k, v, width, col, hd, rows }, o, scores, stats);
        return;
    }
    scores.resize(group * ctx, 0.0);
    for (t0, r0, len) in runs(rows) {
        matmul_t_into_with(isa, q, hd, &k[r0 * width + col..], width, (group, len, hd), &mut scores[t0..], ctx);
    }
    for (row, st) in scores.chunks_exact_mut(ctx).zip(stats.iter_mut()) {
        *st = softmax_stats(isa, row);
    }
    for (i, (t0, r0, len)) in runs(rows).enumerate() {
        let x = (&scores[t0..], ctx);
        matmul_into_with(isa, x.0, x.1, &v[r0 * width + col..], width, (group, hd, len), o, hd, i > 0);
    }
}

/// The runs of consecutive values of `rows`: `(index of the first, its value, length)`.
pub fn runs(rows: &[u32]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let mut t = 0;
    std::iter::from_fn(move || {
        let r0 = *rows.get(t)?;
        let len = rows[t..].iter().zip(r0..).take_while(|(r, want)| **r == *want).count();
        t += len;
        Some((t - len, r0 as usize, len))
    })
}
