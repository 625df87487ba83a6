//! The CPU's step from a fused `qkv` projection to what attention reads, in one pass over small
//! buffers: the query and key heads rotated (rotary embedding, the two halves of each head as
//! Hugging Face's `rotate_half`), the rotated keys and the values written straight into their rows
//! of the paged cache, in its dtype. A decode step did this as eight candle ops a layer (two
//! copies out of `qkv`, two `rope_thd`, two dtype conversions, two `scatter_set` over an index
//! repeated along every row), each allocating, for a few kilobytes of data: ~0.9 ms of a 12 ms
//! 16-row step of SmolLM2 (docs/BENCHMARKS.md). Every value is the same arithmetic as candle's
//! (`x1·cos − x2·sin`, `x1·sin + x2·cos` in f32, then `half`'s rounding), so the result is the
//! same bits as that path's.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::bad;
use crate::error::{Error, Result};
use crate::ops::attention::PagedDecodeDims;
use crate::ops::{PARALLEL_VALUES, cpu_values};

/// `x: [tokens, heads · head_dim + 2 · kv_heads · head_dim]` f32 (the fused `q | k | v`
/// projection), `cos`, `sin`: `[tokens, head_dim / 2]` f32 (each token's angles). Rotates the keys
/// and writes them and the values into rows `rows[t]` of `k_cache` and `v_cache` (`[cache rows,
/// kv_heads · head_dim]`, f32, f16 or bf16, contiguous), and returns the rotated queries
/// `[tokens, heads, head_dim]` f32, times `q_scale` when given (attention's `1 / √head_dim`), as
/// candle's `q * q_scale` gives them (its affine `v · s + 0`, rounded after each). `None` when the
/// operands are not of that kind (not all on the CPU, not f32, not contiguous): the caller then
/// takes the general path.
///
/// # Errors
/// When the shapes disagree with `d`, or a row is past the caches' end (checked before anything
/// is written).
pub fn rope_write_kv(
    qkv: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    d: PagedDecodeDims,
    (k_cache, v_cache): (&Tensor, &Tensor),
    rows: &[u32],
    q_scale: Option<f64>,
) -> Result<Option<Tensor>> {
    let tensors = [qkv, cos, sin, k_cache, v_cache];
    let f32s = [qkv, cos, sin].iter().all(|t| t.dtype() == DType::F32);
    if !tensors.iter().all(|t| t.device().is_cpu()) || !f32s || k_cache.dtype() != v_cache.dtype() {
        return Ok(None);
    }
    let (hd, tokens) = (d.head_dim, rows.len());
    let (qs, kvs) = (d.heads * hd, d.kv_heads * hd);
    if hd == 0 || !hd.is_multiple_of(2) {
        return Err(bad(format!("a head of {hd} values cannot be rotated in halves")));
    }
    if qkv.dims() != [tokens, qs + 2 * kvs] {
        return Err(Error::shape("rope_write_kv", "qkv", qkv.dims(), &[tokens, qs + 2 * kvs]));
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [tokens, hd / 2] {
            return Err(Error::shape("rope_write_kv", name, t.dims(), &[tokens, hd / 2]));
        }
    }
    let (x, cs, sn) = (qkv.storage_and_layout(), cos.storage_and_layout(), sin.storage_and_layout());
    let (Some(x), Some(cs), Some(sn)) =
        (cpu_values::<f32>(&x.0, x.1), cpu_values::<f32>(&cs.0, cs.1), cpu_values::<f32>(&sn.0, sn.1))
    else {
        return Ok(None);
    };
    let ld = qs + 2 * kvs;
    let angles = Angles { cos: &cs[..tokens * hd / 2], sin: &sn[..tokens * hd / 2] };
    let x = &x[..tokens * ld];
    let keys = || -> Result<()> {
        let k = rotate(x, ld, qs, d.kv_heads, hd, angles, None);
        k_cache.inplace_op1(&WriteRows { rows, src: &k, ld: kvs, col: 0, width: kvs })?;
        v_cache.inplace_op1(&WriteRows { rows, src: x, ld, col: qs + kvs, width: kvs })?;
        Ok(())
    };
    // The queries on one thread, the keys and values on another: about as many values each.
    let q = if tokens * (qs + 2 * kvs) >= PARALLEL_VALUES {
        let (q, written) = multilora_cpu::pool::join(|| rotate(x, ld, 0, d.heads, hd, angles, q_scale), keys);
        written?;
        q
    } else {
        keys()?;
        rotate(x, ld, 0, d.heads, hd, angles, q_scale)
    };
    Ok(Some(Tensor::from_vec(q, (tokens, d.heads, hd), qkv.device())?))
}

/// Each token's `cos` and `sin` rows, `head_dim / 2` values each.
#[derive(Clone, Copy)]
struct Angles<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
}

/// `heads` heads of `hd` values from column `col` of each row of `x` (rows `ld` apart), rotated:
/// `[tokens, heads · hd]`, candle's `rope_thd` value for value, then times `scale` when given as
/// candle's affine does it (`v · s + 0`).
fn rotate(x: &[f32], ld: usize, col: usize, heads: usize, hd: usize, a: Angles<'_>, scale: Option<f64>) -> Vec<f32> {
    let half = hd / 2;
    let width = heads * hd;
    let mut out = vec![0f32; x.len() / ld * width];
    // The rotated value (rounded), then the affine's product and `+ 0` (a −0 comes out +0).
    let (s, plus) = scale.map_or((1.0, false), |s| (s as f32, true));
    let scaled = |v: f32| if plus { v * s + 0.0 } else { v };
    for ((src, dst), (cos, sin)) in
        x.chunks_exact(ld).zip(out.chunks_exact_mut(width)).zip(a.cos.chunks_exact(half).zip(a.sin.chunks_exact(half)))
    {
        for (h, o) in src[col..col + width].chunks_exact(hd).zip(dst.chunks_exact_mut(hd)) {
            let (s1, s2) = h.split_at(half);
            let (o1, o2) = o.split_at_mut(half);
            for i in 0..half {
                o1[i] = scaled(s1[i] * cos[i] - s2[i] * sin[i]);
                o2[i] = scaled(s1[i] * sin[i] + s2[i] * cos[i]);
            }
        }
    }
    out
}

/// `cache[rows[t]] = src[t · ld + col ..][.. width]` in the cache's dtype: the in-place op on a
/// cache, so that candle holds its write lock for the copy.
struct WriteRows<'a> {
    rows: &'a [u32],
    src: &'a [f32],
    ld: usize,
    col: usize,
    width: usize,
}

impl WriteRows<'_> {
    fn write<T>(&self, dst: &mut [T], layout: &Layout, convert: impl Fn(&mut [T], &[f32])) -> candle_core::Result<()> {
        let (cache_rows, width) = layout.shape().dims2()?;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("kv write: the cache must be contiguous");
        };
        if width != self.width || end - start != cache_rows * width {
            candle_core::bail!("kv write: a cache of [{cache_rows}, {width}] for rows of {}", self.width);
        }
        if let Some((t, &r)) = self.rows.iter().enumerate().find(|&(_, &r)| r as usize >= cache_rows) {
            candle_core::bail!("kv write: token {t} goes to cache row {r}, past the cache's {cache_rows} rows");
        }
        if self.src.len() < self.rows.len().saturating_sub(1) * self.ld + self.col + self.width {
            candle_core::bail!("kv write: {} source values for {} rows", self.src.len(), self.rows.len());
        }
        let dst = &mut dst[start..end];
        for (t, &r) in self.rows.iter().enumerate() {
            convert(&mut dst[r as usize * width..][..width], &self.src[t * self.ld + self.col..][..width]);
        }
        Ok(())
    }
}

impl InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "multilora-kv-write-rows"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        match storage {
            // `half`'s slice conversions: F16C where the CPU has it, the same rounding as
            // `from_f32` (to nearest, ties to even) either way.
            CpuStorage::F32(dst) => self.write(dst, layout, |d, s| d.copy_from_slice(s)),
            CpuStorage::F16(dst) => self.write(dst, layout, |d: &mut [f16], s| d.convert_from_f32_slice(s)),
            CpuStorage::BF16(dst) => self.write(dst, layout, |d: &mut [bf16], s| d.convert_from_f32_slice(s)),
            other => candle_core::bail!("kv write: a cache of {:?}", other.dtype()),
        }
    }
}

/// Writes `k`, `v` (`[tokens, width]`, any float dtype) into rows `rows` of the CPU caches, in
/// their dtype: the general path's write when [`rope_write_kv`] does not apply.
///
/// # Errors
/// When a row is past the caches' end or the shapes disagree.
pub fn write_kv_rows(k_cache: &Tensor, v_cache: &Tensor, k: &Tensor, v: &Tensor, rows: &[u32]) -> Result<()> {
    for (cache, src) in [(k_cache, k), (v_cache, v)] {
        let (tokens, width) = src.dims2().map_err(|_| Error::shape("write_kv_rows", "k/v", src.dims(), &[0, 0]))?;
        if tokens != rows.len() {
            return Err(Error::shape("write_kv_rows", "k/v", src.dims(), &[rows.len(), width]));
        }
        let src = src.to_dtype(DType::F32)?.contiguous()?;
        let (s, l) = src.storage_and_layout();
        let Some(values) = cpu_values::<f32>(&s, l) else {
            return Err(bad(format!("write_kv_rows runs on the CPU; got {:?}", cache.device())));
        };
        cache.inplace_op1(&WriteRows { rows, src: &values[..tokens * width], ld: width, col: 0, width })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::ops::kv_write::paged_kv_write_slow;

    const D: PagedDecodeDims = PagedDecodeDims { heads: 6, kv_heads: 2, head_dim: 8, block_size: 4 };

    fn bits(t: &Tensor) -> Vec<u32> {
        let v = t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>());
        v.expect("values").iter().map(|v| v.to_bits()).collect()
    }

    /// candle's rotation (`rope_thd`, as the model's general path) of `[tokens, heads, d]`.
    fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let x = x.unsqueeze(0).and_then(|x| x.contiguous()).expect("x");
        candle_nn::rotary_emb::rope_thd(&x, cos, sin).and_then(|y| y.squeeze(0)).expect("rope")
    }

    /// The rotated queries and both caches, bit for bit those of the general path (narrow,
    /// `rope_thd`, a dtype conversion, `scatter_set`), for every cache dtype.
    #[test]
    fn rope_write_kv_is_the_tensor_path_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let (hd, qs, kvs) = (D.head_dim, D.heads * D.head_dim, D.kv_heads * D.head_dim);
        let rows = [9u32, 2, 3, 17, 0];
        let tokens = rows.len();
        let qkv = Tensor::randn(0f32, 2.0, (tokens, qs + 2 * kvs), &dev)?;
        let angles = Tensor::randn(0f32, 3.0, (tokens, hd / 2), &dev)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let fresh = || Tensor::randn(0f32, 1.0, (20, kvs), &dev).and_then(|t| t.to_dtype(dtype));
            let (ck, cv) = (fresh()?, fresh()?);
            let (wk, wv) = (ck.copy()?, cv.copy()?);
            let q = rope_write_kv(&qkv, (&cos, &sin), D, (&ck, &cv), &rows, None)?.expect("the CPU path");
            let want_q = rope(&qkv.narrow(1, 0, qs)?.reshape((tokens, D.heads, hd))?, &cos, &sin);
            // Scaled as attention scales them, by a power of two and by an inexact factor.
            for scale in [1.0 / (hd as f64).sqrt(), 0.1] {
                let (k2, v2) = (fresh()?, fresh()?);
                let got = rope_write_kv(&qkv, (&cos, &sin), D, (&k2, &v2), &rows, Some(scale))?.expect("the CPU path");
                assert_eq!(bits(&got), bits(&(&want_q * scale)?), "queries times {scale}, {dtype:?}");
            }
            let k = rope(&qkv.narrow(1, qs, kvs)?.reshape((tokens, D.kv_heads, hd))?, &cos, &sin);
            let (k, v) = (k.reshape((tokens, kvs))?.to_dtype(dtype)?, qkv.narrow(1, qs + kvs, kvs)?.to_dtype(dtype)?);
            let slots = Tensor::new(&rows, &dev)?;
            paged_kv_write_slow(&wk, &wv, &k, &v, &slots)?;
            assert_eq!(q.dims(), [tokens, D.heads, hd]);
            assert_eq!(bits(&q), bits(&want_q), "queries, {dtype:?}");
            assert_eq!(bits(&ck), bits(&wk), "key cache, {dtype:?}");
            assert_eq!(bits(&cv), bits(&wv), "value cache, {dtype:?}");
            // The general path's write from given rows.
            let (gk, gv) = (fresh()?, fresh()?);
            let (sk, sv) = (gk.copy()?, gv.copy()?);
            write_kv_rows(&gk, &gv, &k, &v, &rows)?;
            paged_kv_write_slow(&sk, &sv, &k, &v, &slots)?;
            assert_eq!((bits(&gk), bits(&gv)), (bits(&sk), bits(&sv)), "write_kv_rows, {dtype:?}");
        }
        Ok(())
    }

    #[test]
    fn a_row_past_the_cache_is_refused_before_anything_is_written() -> Result<()> {
        let dev = Device::Cpu;
        let (qs, kvs) = (D.heads * D.head_dim, D.kv_heads * D.head_dim);
        let qkv = Tensor::randn(0f32, 1.0, (2, qs + 2 * kvs), &dev)?;
        let cos = Tensor::ones((2, D.head_dim / 2), DType::F32, &dev)?;
        let sin = Tensor::zeros((2, D.head_dim / 2), DType::F32, &dev)?;
        let (ck, cv) = (Tensor::zeros((4, kvs), DType::F16, &dev)?, Tensor::zeros((4, kvs), DType::F16, &dev)?);
        let err = rope_write_kv(&qkv, (&cos, &sin), D, (&ck, &cv), &[1, 4], None).expect_err("row 4 of 4");
        assert!(err.to_string().contains("cache row 4"), "{err}");
        assert!(bits(&ck).iter().chain(&bits(&cv)).all(|&b| b == 0), "nothing written");
        let short = Tensor::zeros((2, qs), DType::F32, &dev)?;
        assert!(rope_write_kv(&short, (&cos, &sin), D, (&ck, &cv), &[0, 1], None).is_err(), "qkv too narrow");
        // Not f32 activations: the caller's general path.
        let half = qkv.to_dtype(DType::BF16)?;
        assert!(rope_write_kv(&half, (&cos, &sin), D, (&ck, &cv), &[0, 1], None)?.is_none());
        Ok(())
    }
}
