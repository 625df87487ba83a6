//! Attention on the CPU as candle ops over the caches in place: the tensors' slices handed to
//! multilora-cpu's kernels, decode rows to `multilora_cpu::float::decode_attention` (each row's
//! query against the cache rows it names; a long context in parts side by side, merged), a
//! prefill sequence to `causal_attention` (streamed in tiles with an online softmax, no `len ×
//! ctx` buffer). Shapes are checked here, rows and contexts there, before anything is read.

use candle_core::{DType, Tensor};
use half::{bf16, f16};

use super::PagedDecodeDims;
use crate::error::{Error, Result};
use crate::ops::cpu_values;
use crate::ops::gemm::StorageElem;
use multilora_cpu::Isa;
use multilora_cpu::float::{Causal, causal_attention, decode_attention};

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
    let n = rows.len();
    let mut out = vec![0f32; n * d.heads * d.head_dim];
    let ran = on_slices(isa, "decode_attention_rows", (q, n), k_cache, v_cache, d, Kernel::Decode(rows), &mut out)?;
    Ok(ran.then(|| Tensor::from_vec(out, (n, d.heads * d.head_dim), q.device())).transpose()?)
}

/// One prefill sequence's causal attention on the CPU, streamed in tiles with an online softmax
/// (`multilora_cpu::float::causal_attention`: no `len × ctx` buffer): `q: [len, heads,
/// head_dim]` f32, already scaled, at positions `span.start ..`; the caches as for
/// [`decode_attention_rows`]; `rows` the cache rows of positions `span.lo ..= span.start + len −
/// 1`. `[len, heads · head_dim]` f32, or `None` when the operands are not of that kind.
///
/// # Errors
/// When a position names a cache row past the caches, the context does not reach the last
/// query, or the shapes disagree with `d`.
pub fn prefill_attention_rows(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    rows: &[u32],
    span: CausalSpan,
    d: PagedDecodeDims,
) -> Result<Option<Tensor>> {
    let len = q.dim(0)?;
    let mut out = vec![0f32; len * d.heads * d.head_dim];
    let kernel = Kernel::Prefill(rows, span);
    let ran = on_slices(Isa::best(), "prefill_attention_rows", (q, len), k_cache, v_cache, d, kernel, &mut out)?;
    Ok(ran.then(|| Tensor::from_vec(out, (len, d.heads * d.head_dim), q.device())).transpose()?)
}

/// Where a prefill sequence's queries sit: the first one's position, the position of the first
/// context row, and the sliding window its keys are seen through.
#[derive(Clone, Copy, Debug)]
pub struct CausalSpan {
    /// The first query's position.
    pub start: usize,
    /// The first context row's position (at most the first query's window start).
    pub lo: usize,
    /// The sliding window, if any.
    pub window: Option<usize>,
}

/// The attention an [`on_slices`] call runs.
#[derive(Clone, Copy)]
enum Kernel<'a> {
    Decode(&'a [Vec<u32>]),
    Prefill(&'a [u32], CausalSpan),
}

/// Runs `kernel` over `q` (`[n, heads, head_dim]`) and the caches as slices into `out`; `false`
/// when they are not f32 queries over f32 / bf16 / f16 caches on the CPU. The heads' grouping,
/// the rows and the contexts are the kernel's to check.
#[allow(clippy::too_many_arguments)]
fn on_slices(
    isa: Isa,
    op: &str,
    (q, n): (&Tensor, usize),
    k_cache: &Tensor,
    v_cache: &Tensor,
    d: PagedDecodeDims,
    kernel: Kernel<'_>,
    out: &mut [f32],
) -> Result<bool> {
    let isa = if isa.available() { isa } else { Isa::best() };
    let cpu = q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu();
    if q.dtype() != DType::F32 || !cpu || k_cache.dtype() != v_cache.dtype() {
        return Ok(false);
    }
    if q.dims() != [n, d.heads, d.head_dim] {
        return Err(Error::shape(op, "q", q.dims(), &[n, d.heads, d.head_dim]));
    }
    let width = d.kv_heads * d.head_dim;
    for (name, c) in [("k_cache", k_cache), ("v_cache", v_cache)] {
        if c.rank() != 2 || c.dim(1)? != width {
            return Err(Error::shape(op, name, c.dims(), &[c.dim(0).unwrap_or(0), width]));
        }
    }
    let q = q.contiguous()?;
    let (qg, ql) = q.storage_and_layout();
    let Some(qv) = cpu_values::<f32>(&qg, ql) else { return Ok(false) };
    let qv = &qv[..n * d.heads * d.head_dim];
    match k_cache.dtype() {
        DType::F32 => cached::<f32>(isa, qv, k_cache, v_cache, d, kernel, out),
        DType::BF16 => cached::<bf16>(isa, qv, k_cache, v_cache, d, kernel, out),
        DType::F16 => cached::<f16>(isa, qv, k_cache, v_cache, d, kernel, out),
        _ => Ok(false),
    }
}

/// [`on_slices`] over caches of element `E`.
#[allow(clippy::too_many_arguments)]
fn cached<E: StorageElem>(
    isa: Isa,
    qv: &[f32],
    k_cache: &Tensor,
    v_cache: &Tensor,
    d: PagedDecodeDims,
    kernel: Kernel<'_>,
    out: &mut [f32],
) -> Result<bool> {
    let width = d.kv_heads * d.head_dim;
    let cache_rows = k_cache.dim(0)?.min(v_cache.dim(0)?);
    let (kg, kl) = k_cache.storage_and_layout();
    let (vg, vl) = v_cache.storage_and_layout();
    let (Some(k), Some(v)) = (cpu_values::<E>(&kg, kl), cpu_values::<E>(&vg, vl)) else { return Ok(false) };
    let (k, v) = (&k[..cache_rows * width], &v[..cache_rows * width]);
    let (heads, kv_heads, hd) = (d.heads, d.kv_heads, d.head_dim);
    match kernel {
        Kernel::Prefill(rows, s) => {
            let (start, lo, window) = (s.start, s.lo, s.window);
            causal_attention(isa, Causal { q: qv, k, v, rows, heads, kv_heads, hd, start, lo, window }, out)?
        }
        Kernel::Decode(rows) => decode_attention(isa, qv, k, v, rows, (heads, kv_heads, hd), out)?,
    }
    Ok(true)
}
