//! Decode attention on the CPU, reading each sequence's keys and values straight from the cache
//! rows it names (no gather, no transpose, no padding; half-precision caches widened as they are
//! read), on the crate's dispatched SIMD kernels.
//!
//! For each sequence and KV head, the `group` query heads that share it are read against each key
//! once. On AVX-512, for groups of 1 to 4 and head sizes a multiple of 16, one pass of the gemm
//! module's `attend` kernel does the scores, the softmax and `P · V` (see there). Otherwise the
//! query heads are one `[group, d]` matrix: the scores are `q_g · Kᵀ` over each run of
//! consecutive cache rows (a cache block) with the streaming kernel; the softmax runs in f32 (the
//! gemm kernels' `exp_sum`, dispatched like the products); the output is `P · V` as outer products
//! over the same runs, each run's chains continuing the last one's. Sequences run side by side on
//! the rayon pool. Each output is the same chain of operations whatever the batch, so a row's
//! result does not depend on the other rows.

use candle_core::{DType, Tensor};
use half::{bf16, f16};

use super::PagedDecodeDims;
use crate::error::{Error, Result};
use crate::ops::cpu_values;
use crate::ops::gemm::StorageElem;
use multilora_cpu::Isa;
use multilora_cpu::float::{Head, attend, attend_supports, matmul_into, matmul_t_into, softmax};

/// `softmax(q · kᵀ) · v` of every decode row over its context: `q: [n, heads, head_dim]` f32 on
/// the CPU, already scaled by `1/√head_dim`; `k_cache`, `v_cache`: `[rows, kv_heads · head_dim]`
/// (f32, bf16 or f16, both alike), contiguous; `rows[i]`: the flat cache rows row `i` attends
/// over, in order. `[n, heads · head_dim]` f32, or `None` when the operands are not of that kind
/// (the caller then takes the general path).
///
/// # Errors
/// When a row names a cache row past the end of the caches, a context is empty, or the shapes
/// disagree with `d`.
pub fn decode_attention_rows(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    rows: &[Vec<u32>],
    d: PagedDecodeDims,
) -> Result<Option<Tensor>> {
    decode_attention_rows_with(Isa::best(), q, k_cache, v_cache, rows, d)
}

/// [`decode_attention_rows`] on instruction set `isa` (the best one when it is not available).
pub(crate) fn decode_attention_rows_with(
    isa: Isa,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    rows: &[Vec<u32>],
    d: PagedDecodeDims,
) -> Result<Option<Tensor>> {
    let isa = if isa.available() { isa } else { Isa::best() };
    let cpu = q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu();
    if q.dtype() != DType::F32 || !cpu || k_cache.dtype() != v_cache.dtype() {
        return Ok(None);
    }
    match k_cache.dtype() {
        DType::F32 => rows_with::<f32>(isa, q, k_cache, v_cache, rows, d),
        DType::BF16 => rows_with::<bf16>(isa, q, k_cache, v_cache, rows, d),
        DType::F16 => rows_with::<f16>(isa, q, k_cache, v_cache, rows, d),
        _ => Ok(None),
    }
}

fn bad(reason: String) -> Error {
    Error::InvalidLayer { module: "decode_attention_rows".to_string(), reason }
}

/// [`decode_attention_rows`] over caches of element `E`.
fn rows_with<E: StorageElem>(
    isa: Isa,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    rows: &[Vec<u32>],
    d: PagedDecodeDims,
) -> Result<Option<Tensor>> {
    if d.kv_heads == 0 || d.head_dim == 0 || !d.heads.is_multiple_of(d.kv_heads) {
        return Err(bad(format!("{} heads over {} kv heads of {}", d.heads, d.kv_heads, d.head_dim)));
    }
    let n = rows.len();
    if q.dims() != [n, d.heads, d.head_dim] {
        return Err(Error::shape("decode_attention_rows", "q", q.dims(), &[n, d.heads, d.head_dim]));
    }
    let width = d.kv_heads * d.head_dim;
    for (name, c) in [("k_cache", k_cache), ("v_cache", v_cache)] {
        if c.rank() != 2 || c.dim(1)? != width {
            return Err(Error::shape("decode_attention_rows", name, c.dims(), &[c.dim(0).unwrap_or(0), width]));
        }
    }
    let cache_rows = k_cache.dim(0)?.min(v_cache.dim(0)?);
    if let Some((i, r)) =
        rows.iter().enumerate().find(|(_, r)| r.is_empty() || r.iter().any(|&x| x as usize >= cache_rows))
    {
        return Err(bad(format!(
            "row {i} attends over {} cache rows, of which one is past {cache_rows} or none",
            r.len()
        )));
    }
    let q = q.contiguous()?;
    let (qg, ql) = q.storage_and_layout();
    let (kg, kl) = k_cache.storage_and_layout();
    let (vg, vl) = v_cache.storage_and_layout();
    let (Some(qv), Some(k), Some(v)) = (cpu_values::<f32>(&qg, ql), cpu_values::<E>(&kg, kl), cpu_values::<E>(&vg, vl))
    else {
        return Ok(None);
    };
    let (k, v) = (&k[..cache_rows * width], &v[..cache_rows * width]);
    let per_row = d.heads * d.head_dim;
    let mut out = vec![0f32; n * per_row];
    let parts = out.chunks_mut(per_row).zip(qv.chunks(per_row)).zip(rows).collect();
    multilora_cpu::pool::for_each_part(parts, |_, ((o, q), r)| {
        SCORES.with_borrow_mut(|scores| sequence(isa, q, k, v, r, d, o, scores))
    });
    drop((qg, kg, vg));
    Ok(Some(Tensor::from_vec(out, (n, per_row), q.device())?))
}

thread_local! {
    /// Each thread's scores, reused from sequence to sequence (a step's attention runs a few
    /// hundred sequences, each a fresh allocation otherwise).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One decode row: `q`, `o`: `[heads, head_dim]`; `rows` its cache rows, each `< k.len() / width`.
#[allow(clippy::too_many_arguments)]
fn sequence<E: StorageElem>(
    isa: Isa,
    q: &[f32],
    k: &[E],
    v: &[E],
    rows: &[u32],
    d: PagedDecodeDims,
    o: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let (hd, group) = (d.head_dim, d.heads / d.kv_heads);
    let width = d.kv_heads * hd;
    let ctx = rows.len();
    let one_pass = attend_supports(isa, group, hd);
    for kvh in 0..d.kv_heads {
        let col = kvh * hd;
        let qh = &q[kvh * group * hd..][..group * hd];
        let oh = &mut o[kvh * group * hd..][..group * hd];
        if one_pass {
            attend(isa, Head { q: qh, k, v, width, col, hd, rows }, oh, scores);
            continue;
        }
        scores.resize(group * ctx, 0.0);
        for (t0, r0, len) in runs(rows) {
            matmul_t_into(qh, hd, &k[r0 * width + col..], width, (group, len, hd), &mut scores[t0..], ctx);
        }
        scores.chunks_exact_mut(ctx).for_each(|row| softmax(isa, row));
        for (i, (t0, r0, len)) in runs(rows).enumerate() {
            matmul_into(&scores[t0..], ctx, &v[r0 * width + col..], width, (group, hd, len), oh, hd, i > 0);
        }
    }
}

/// The runs of consecutive values of `rows`: `(index of the first, its value, length)`.
pub(crate) fn runs(rows: &[u32]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let mut t = 0;
    std::iter::from_fn(move || {
        let r0 = *rows.get(t)?;
        let len = rows[t..].iter().zip(r0..).take_while(|(r, want)| **r == *want).count();
        t += len;
        Some((t - len, r0 as usize, len))
    })
}
