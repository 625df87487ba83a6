//! The fused decode-layer kernels (`fused.cu`) run by the host emulator with the host plan's
//! launches, against references computed here in f32 from the same inputs: RoPE with the query
//! scale and the K/V cache write (strided q/k/v rows, GQA, a padding slot that writes nothing,
//! rows it does not name kept bit for bit), the residual add and RMS norm (the sum bit for bit
//! as candle's add rounds it), SiLU times up; f32, bf16 and f16, odd widths.

use candle_core::{DType, Device, Tensor};
use multilora_kernels::{Emulator, kernel};

use super::emulated::{Buffers, bytes_tensor, kernel_dtype, tensor_bytes};
use super::{Rng, bits, rel_err};
use crate::PagedDecodeDims;
use crate::ops::fused::{add_norm_launch, rope_kv_launch, silu_mul_launch};

/// The tolerance of an output rounded once to `dtype` (relative, over the whole tensor).
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        _ => 4e-3,
    }
}

#[test]
fn emulated_rope_kv_write_matches_rotation_scale_and_scatter() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let dev = &Device::Cpu;
    let mut rng = Rng::new(29);
    // (tokens, heads, kv_heads, head_dim, extra columns after q|k|v in a row, dtype)
    let cases = [
        (5, 4, 2, 64, 0, DType::BF16),
        (3, 8, 8, 32, 16, DType::F32),
        (4, 6, 2, 10, 3, DType::F16),
        (1, 2, 1, 128, 0, DType::BF16),
    ];
    for (tokens, heads, kv_heads, hd, extra, dtype) in cases {
        let d = PagedDecodeDims { heads, kv_heads, head_dim: hd, block_size: 16 };
        let (qs, kvs, half) = (heads * hd, kv_heads * hd, hd / 2);
        let stride = qs + 2 * kvs + extra;
        let num_rows = 24;
        let qkv = rng.tensor(&[tokens, stride], 1.0, dtype, dev)?;
        let angles: Vec<f32> = (0..tokens * half).map(|i| (i as f32) * 0.37).collect();
        let cos = Tensor::from_vec(angles.iter().map(|a| a.cos()).collect::<Vec<_>>(), (tokens, half), dev)?
            .to_dtype(dtype)?;
        let sin = Tensor::from_vec(angles.iter().map(|a| a.sin()).collect::<Vec<_>>(), (tokens, half), dev)?
            .to_dtype(dtype)?;
        let k0 = rng.tensor(&[num_rows, kvs], 1.0, dtype, dev)?;
        let v0 = rng.tensor(&[num_rows, kvs], 1.0, dtype, dev)?;
        let mut slots: Vec<u32> = (0..tokens as u32).map(|t| (7 * t + 3) % num_rows as u32).collect();
        if tokens > 1 {
            slots[tokens - 1] = u32::MAX;
        }
        let scale = 1.0 / (hd as f32).sqrt();

        // The reference, in f32 from the same (rounded) inputs.
        let f = |t: &Tensor| -> anyhow::Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?) };
        let (x, c, s) = (f(&qkv)?, f(&cos)?, f(&sin)?);
        let (mut k_want, mut v_want) = (f(&k0)?, f(&v0)?);
        let mut q_want = vec![0f32; tokens * qs];
        for t in 0..tokens {
            let row = &x[t * stride..];
            for h in 0..heads + kv_heads {
                for e in 0..half {
                    let (x0, x1) = (row[h * hd + e], row[h * hd + e + half]);
                    let (cc, ss) = (c[t * half + e], s[t * half + e]);
                    let (r0, r1) = (x0 * cc - x1 * ss, x1 * cc + x0 * ss);
                    if h < heads {
                        q_want[t * qs + h * hd + e] = r0 * scale;
                        q_want[t * qs + h * hd + e + half] = r1 * scale;
                    } else if (slots[t] as usize) < num_rows {
                        let at = slots[t] as usize * kvs + (h - heads) * hd + e;
                        (k_want[at], k_want[at + half]) = (r0, r1);
                    }
                }
            }
            if (slots[t] as usize) < num_rows {
                let at = slots[t] as usize * kvs;
                v_want[at..at + kvs].copy_from_slice(&row[qs + kvs..qs + 2 * kvs]);
            }
        }

        let mut l = rope_kv_launch(tokens, d, stride, num_rows, scale)?;
        let mut bufs = Buffers::default();
        l.params.qkv = bufs.add(tensor_bytes(&qkv)?);
        l.params.cos = bufs.add(tensor_bytes(&cos)?);
        l.params.sin = bufs.add(tensor_bytes(&sin)?);
        l.params.k_cache = bufs.add(tensor_bytes(&k0)?);
        l.params.v_cache = bufs.add(tensor_bytes(&v0)?);
        l.params.slots = bufs.add(slots.iter().flat_map(|v| v.to_le_bytes()).collect());
        // Every query must be written: the output starts as NaN.
        l.params.q_out = bufs.add(vec![0xff; tokens * qs * dtype.size_in_bytes()]);
        let name = kernel::rope_kv_write(kernel_dtype(dtype)?);
        emu.launch(&name, l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
        let q = bytes_tensor(bufs.get(l.params.q_out), dtype, &[tokens, qs])?;
        let k = bytes_tensor(bufs.get(l.params.k_cache), dtype, &[num_rows, kvs])?;
        let v = bytes_tensor(bufs.get(l.params.v_cache), dtype, &[num_rows, kvs])?;
        let want =
            |w: Vec<f32>, shape: (usize, usize)| -> anyhow::Result<Tensor> { Ok(Tensor::from_vec(w, shape, dev)?) };
        let case = format!("{tokens} tokens, {heads}/{kv_heads} heads of {hd}, {dtype:?}");
        let eq = rel_err(&q, &want(q_want, (tokens, qs))?)?;
        anyhow::ensure!(eq < tol(dtype), "{case}: queries off by {eq:e}");
        let ek = rel_err(&k, &want(k_want, (num_rows, kvs))?)?;
        anyhow::ensure!(ek < tol(dtype), "{case}: keys off by {ek:e}");
        // Values are copied: every row bit for bit (the rows no slot names untouched).
        let v_want = want(v_want, (num_rows, kvs))?.to_dtype(dtype)?;
        anyhow::ensure!(bits(&v)? == bits(&v_want)?, "{case}: the value cache differs");
        // The rows no token names keep every bit of the key cache.
        for r in (0..num_rows).filter(|r| !slots.contains(&(*r as u32))) {
            anyhow::ensure!(bits(&k.get(r)?)? == bits(&k0.get(r)?)?, "{case}: key row {r} was written");
        }
    }
    Ok(())
}

#[test]
fn emulated_add_rms_norm_matches_the_add_then_the_norm() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let dev = &Device::Cpu;
    let mut rng = Rng::new(31);
    // (rows, cols, columns past each x row, dtype)
    for (rows, cols, pad, dtype) in
        [(3, 64, 0, DType::BF16), (5, 100, 7, DType::F32), (1, 4096, 0, DType::F16), (4, 33, 1, DType::BF16)]
    {
        let x = rng.tensor(&[rows, cols + pad], 1.0, dtype, dev)?;
        let r = rng.tensor(&[rows, cols], 1.0, dtype, dev)?;
        let w = rng.tensor(&[cols], 1.0, dtype, dev)?;
        let eps = 1e-5f32;
        let xv = x.narrow(1, 0, cols)?;
        // candle's add rounds the sum to the dtype: the kernel's sum must be those bits.
        let sum_want = (&xv + &r)?;
        let norm_want = candle_nn::ops::rms_norm(&sum_want.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?, eps)?;
        let mut l = add_norm_launch(rows, cols, (cols + pad, cols), eps)?;
        let mut bufs = Buffers::default();
        l.params.x = bufs.add(tensor_bytes(&x)?);
        l.params.residual = bufs.add(tensor_bytes(&r)?);
        l.params.weight = bufs.add(tensor_bytes(&w)?);
        l.params.sum = bufs.add(vec![0xff; rows * cols * dtype.size_in_bytes()]);
        l.params.out = bufs.add(vec![0xff; rows * cols * dtype.size_in_bytes()]);
        emu.launch(&kernel::add_rms_norm(kernel_dtype(dtype)?), l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
        let sum = bytes_tensor(bufs.get(l.params.sum), dtype, &[rows, cols])?;
        let out = bytes_tensor(bufs.get(l.params.out), dtype, &[rows, cols])?;
        let case = format!("{rows}x{cols} {dtype:?}");
        anyhow::ensure!(bits(&sum)? == bits(&sum_want)?, "{case}: the sum differs from candle's add");
        let e = rel_err(&out, &norm_want)?;
        anyhow::ensure!(e < tol(dtype), "{case}: the norm is off by {e:e}");
    }
    Ok(())
}

#[test]
fn emulated_silu_mul_matches_silu_times_up() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let dev = &Device::Cpu;
    let mut rng = Rng::new(37);
    // (rows, inter, columns past each gate|up row, dtype)
    for (rows, inter, pad, dtype) in [(2, 300, 0, DType::BF16), (3, 128, 5, DType::F32), (1, 1000, 0, DType::F16)] {
        let gu = rng.tensor(&[rows, 2 * inter + pad], 2.0, dtype, dev)?;
        let g = gu.narrow(1, 0, inter)?.to_dtype(DType::F32)?;
        let u = gu.narrow(1, inter, inter)?.to_dtype(DType::F32)?;
        let want = (candle_nn::ops::silu(&g)? * u)?;
        let mut l = silu_mul_launch(rows, inter, 2 * inter + pad)?;
        let mut bufs = Buffers::default();
        l.params.gu = bufs.add(tensor_bytes(&gu)?);
        l.params.out = bufs.add(vec![0xff; rows * inter * dtype.size_in_bytes()]);
        emu.launch(&kernel::silu_mul(kernel_dtype(dtype)?), l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
        let out = bytes_tensor(bufs.get(l.params.out), dtype, &[rows, inter])?;
        let e = rel_err(&out, &want)?;
        anyhow::ensure!(e < tol(dtype), "{rows}x{inter} {dtype:?}: off by {e:e}");
    }
    Ok(())
}

/// The greedy picks: the host's `argmax` exactly (first of equal values, NaN passed over, 0 for a
/// row of NaN alone) and the pick's logprob as the host's `x − lse` gives it, within f32's summing
/// error, on rows with ties, NaN, −∞, +∞ and a row of NaN; rows picked out of order, one twice,
/// from strided logits.
#[test]
fn emulated_greedy_rows_match_the_host_argmax_and_logprob() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let mut rng = Rng::new(41);
    let (n, vocab, stride) = (7usize, 1000usize, 1003usize);
    let mut x: Vec<f32> = (0..n * stride).map(|_| rng.unit() * 8.0).collect();
    let row = |r: usize| -> std::ops::Range<usize> { r * stride..r * stride + vocab };
    // Row 1: a tie for the largest, the first one wins; row 2: NaN everywhere but two values;
    // row 3: −∞ and a +∞; row 4: NaN alone; row 5: −∞ alone.
    let r1 = row(1);
    x[r1.start + 500] = 40.0;
    x[r1.start + 17] = 40.0;
    let r2 = row(2);
    x[r2.clone()].fill(f32::NAN);
    (x[r2.start + 3], x[r2.start + 900]) = (-2.0, 1.5);
    let r3 = row(3);
    x[r3.start + 10] = f32::NEG_INFINITY;
    x[r3.start + 700] = f32::INFINITY;
    x[row(4)].fill(f32::NAN);
    x[row(5)].fill(f32::NEG_INFINITY);
    let rows: Vec<u32> = vec![6, 1, 2, 3, 4, 5, 0, 1];
    let mut l = crate::ops::fused::greedy_launch(rows.len(), vocab, stride)?;
    let mut bufs = Buffers::default();
    l.params.logits = bufs.add(x.iter().flat_map(|v| v.to_le_bytes()).collect());
    l.params.rows = bufs.add(rows.iter().flat_map(|v| v.to_le_bytes()).collect());
    l.params.out = bufs.add(vec![0xff; rows.len() * 8]);
    emu.launch(kernel::GREEDY_ROWS, l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
    let out: Vec<u32> =
        bufs.get(l.params.out).chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    for (i, &r) in rows.iter().enumerate() {
        let xs = &x[row(r as usize)];
        let (token, logprob) = (out[2 * i], f32::from_bits(out[2 * i + 1]));
        assert_eq!(token as usize, multilora_cpu::logits::argmax(xs), "row {r}: the pick");
        // The host's: x[token] − (max + ln Σ exp(x − max)), or `max` for the log-sum-exp where the
        // max is not finite (so NaN here).
        let max = xs.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        let lse = if max.is_finite() {
            max as f64
                + xs.iter().filter(|v| **v > f32::NEG_INFINITY).map(|&v| ((v - max) as f64).exp()).sum::<f64>().ln()
        } else {
            max as f64
        };
        let want = xs[token as usize] as f64 - lse;
        if want.is_nan() {
            assert!(logprob.is_nan(), "row {r}: {logprob}, the host's NaN");
        } else {
            assert!((logprob as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "row {r}: {logprob}, want {want}");
        }
    }
    assert_eq!((out[2], out[3]), (out[14], out[15]), "the same row twice, the same answer");
    assert_eq!(out[2], 17, "the first of the tied largest values");
    Ok(())
}
