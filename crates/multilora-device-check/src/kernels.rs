//! Every kernel against its slow reference built from plain tensor ops, on the GPU: the
//! segmented shrink (public op), the fused shrink + expand of a layer (the K split and its
//! in-order reduction), base-model rows untouched bit for bit, on Llama-3-8B's shapes, for
//! 1…4096 tokens over 1…16 adapters of mixed ranks 4…64 in rank-64 slots, and in slots of rank
//! 8, 16 and 32 (the decode-shaped kernels are built per slot rank), in f32, bf16 and f16;
//! the paged decode attention against its gathered reference; and a decode layer's fused kernels
//! (`fused.cu`: RoPE + query scale + K/V write, add + RMS norm, SiLU · up) against the tensor ops
//! they replace.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_layers::{
    LoraMapping, LoraSlots, PagedDecodeDims, add_rms_norm, lora_apply, lora_expand_slow, lora_shrink, lora_shrink_slow,
    paged_decode_attention, paged_decode_attention_slow, paged_kv_write_slow, rope_kv_write, silu_mul,
};
use multilora_types::{ModuleKind, SlotId};

use crate::floor::{LLAMA3_8B_HIDDEN, LLAMA3_8B_INTERMEDIATE, LLAMA3_8B_LAYERS, llama3_8b_attention};
use crate::report::Report;
use crate::util::{randn, rel_err};

const SECTION: &str = "kernels";

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-5 } else { 1e-2 }
}

/// Slots of `l` adapters at `max_rank`, adapter `k` at `ranks[k]` (zero past it, as a slot write
/// leaves them).
pub(crate) fn random_slots(
    id: ModuleId,
    (l, max_rank, inp, out): (usize, usize, usize, usize),
    ranks: &[usize],
    dtype: DType,
    dev: &Device,
) -> Result<LoraSlots> {
    let mask: Vec<f32> = ranks.iter().flat_map(|&r| (0..max_rank).map(move |j| f32::from(u8::from(j < r)))).collect();
    let mask = Tensor::from_vec(mask, (l, max_rank), dev)?;
    let a = randn(&[l, max_rank, inp], 0.05, DType::F32, dev)?.broadcast_mul(&mask.unsqueeze(2)?)?;
    let b = randn(&[l, out, max_rank], 0.05, DType::F32, dev)?.broadcast_mul(&mask.unsqueeze(1)?)?;
    Ok(LoraSlots::from_parts(id, a.to_dtype(dtype)?, b.to_dtype(dtype)?, ranks.to_vec())?)
}

/// The slow reference over row chunks (its gathers are `rows · max_rank · in` values): per slice
/// the shrink `[rows, max_rank]` f32 in row order, and the f32 delta `[rows, Σ out]`.
fn slow(x: &Tensor, slices: &[&LoraSlots], slot_list: &[Option<SlotId>], l: usize) -> Result<(Vec<Tensor>, Tensor)> {
    const CHUNK: usize = 256;
    let total: usize = slices.iter().map(|s| s.out_features()).sum();
    let (mut s_parts, mut d_parts) = (vec![Vec::new(); slices.len()], Vec::new());
    for c0 in (0..slot_list.len()).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(slot_list.len());
        let sub = LoraMapping::new(&slot_list[c0..c1], l, x.device())?;
        let xs = x.narrow(0, c0, c1 - c0)?;
        let s = lora_shrink_slow(&xs, slices, &sub)?;
        let y0 = Tensor::zeros((c1 - c0, total), DType::F32, x.device())?;
        d_parts.push(lora_expand_slow(&y0, &s, slices, &sub)?);
        for (part, t) in s_parts.iter_mut().zip(s) {
            part.push(t);
        }
    }
    let s = s_parts.iter().map(|p| Ok(Tensor::cat(p, 0)?)).collect::<Result<Vec<_>>>()?;
    Ok((s, Tensor::cat(&d_parts, 0)?))
}

/// Worst errors of one configuration (`max_rank`-wide slots): `(shrink, fused delta, base rows
/// changed)`.
fn check_layer(
    dev: &Device,
    (inp, outs): (usize, &[usize]),
    (max_rank, tokens, adapters): (usize, usize, usize),
    dtype: DType,
    seed: u64,
) -> Result<(f64, f64, usize)> {
    // Mixed ranks up to the slots' own.
    let fit: Vec<usize> = [4, 8, 16, 32, 64].into_iter().filter(|&r| r <= max_rank).collect();
    let ranks: Vec<usize> = (0..adapters).map(|k| fit[k % fit.len()]).collect();
    let kinds = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj];
    let slots: Vec<LoraSlots> = outs
        .iter()
        .zip(kinds)
        .enumerate()
        .map(|(i, (&o, k))| {
            // The second slice is not a target of adapter 1 (rank 0 there), as a q/v-only adapter.
            let mut r = ranks.clone();
            if i == 1 && adapters > 1 {
                r[1] = 0;
            }
            random_slots(ModuleId::layer(0, k), (adapters, max_rank, inp, o), &r, dtype, dev)
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&LoraSlots> = slots.iter().collect();
    // Every eighth row is the base model; the others cycle over the adapters, interleaved.
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let slot_list: Vec<Option<SlotId>> = (0..tokens)
        .map(|t| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (t % 8 != 7).then(|| SlotId::new((state % adapters as u64) as usize))
        })
        .collect();
    let mapping = LoraMapping::new(&slot_list, adapters, dev)?;
    let x = randn(&[tokens, inp], 1.0, dtype, dev)?;
    let total: usize = outs.iter().sum();
    let (s_slow, d_slow) = slow(&x, &refs, &slot_list, adapters)?;

    let mut shrink_err: f64 = 0.0;
    if let Some(index) = mapping.lora_index() {
        let s_fast = lora_shrink(&x, &refs, &mapping)?;
        for (fast, slow) in s_fast.iter().zip(&s_slow) {
            let width = fast.dim(1)?;
            shrink_err = shrink_err.max(rel_err(fast, &slow.index_select(index, 0)?.narrow(1, 0, width)?)?);
        }
    }
    // The fused path on a zero base output: the delta alone, rounded once into the dtype.
    let y = lora_apply(&x, Tensor::zeros((tokens, total), dtype, dev)?, &refs, &mapping)?;
    let fused_err = rel_err(&y, &d_slow.to_dtype(dtype)?)?;
    // On a random base output, the base model's rows keep every bit.
    let y0 = randn(&[tokens, total], 1.0, dtype, dev)?;
    let y = lora_apply(&x, y0.copy()?, &refs, &mapping)?;
    let base: Vec<u32> = (0..tokens as u32).filter(|&t| slot_list[t as usize].is_none()).collect();
    let changed = if base.is_empty() {
        0
    } else {
        let idx = Tensor::from_vec(base.clone(), base.len(), dev)?;
        let (a, b) = (y.index_select(&idx, 0)?.to_dtype(DType::F32)?, y0.index_select(&idx, 0)?.to_dtype(DType::F32)?);
        a.ne(&b)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize
    };
    Ok((shrink_err, fused_err, changed))
}

/// The segmented LoRA kernels over the grid.
/// `(slot rank, tokens, adapters)` of the LoRA kernels' checks: the whole grid in rank-64 slots,
/// a decode row, a decode step and a prefill in the smaller slots.
fn lora_grid(quick: bool) -> Vec<(usize, usize, usize)> {
    let (full, small): (&[(usize, usize)], &[usize]) = if quick {
        (&[(1, 1), (64, 16), (512, 4)], &[16])
    } else {
        (&[(1, 1), (7, 4), (64, 16), (512, 16), (4096, 16)], &[8, 16, 32])
    };
    let mut grid: Vec<_> = full.iter().map(|&(t, a)| (64, t, a)).collect();
    for &r in small {
        grid.extend([(r, 1, 1), (r, 64, 16), (r, 512, 4)]);
    }
    grid
}

pub(crate) fn lora(report: &mut Report, dev: &Device, quick: bool) -> Result<()> {
    let grid = lora_grid(quick);
    let mut key = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let tol = tolerance(dtype);
        let (mut worst_s, mut worst_f, mut changed, mut at) = (0f64, 0f64, 0usize, String::new());
        for (name, inp, outs) in LLAMA3_8B_LAYERS {
            for &(max_rank, tokens, adapters) in &grid {
                let seed = (tokens * 31 + adapters + max_rank * 7) as u64;
                let (s, f, c) = check_layer(dev, (inp, outs), (max_rank, tokens, adapters), dtype, seed)?;
                if f > worst_f {
                    at = format!("{name}, rank-{max_rank} slots, {tokens} tokens, {adapters} adapters");
                }
                worst_s = worst_s.max(s);
                worst_f = worst_f.max(f);
                changed += c;
            }
        }
        let target = format!("≤ {tol:.0e} relative");
        report.check(
            SECTION,
            format!("lora_shrink {dtype:?} vs slow"),
            format!("{worst_s:.2e}"),
            &target,
            worst_s <= tol,
        );
        report.check(
            SECTION,
            format!("lora shrink+expand (fused, K split) {dtype:?} vs slow"),
            format!("{worst_f:.2e} (worst at {at})"),
            &target,
            worst_f <= tol,
        );
        report.check(SECTION, format!("base rows changed {dtype:?}"), changed.to_string(), "0 elements", changed == 0);
        key.push(format!("{dtype:?} {:.0e}", worst_s.max(worst_f)));
    }
    report.key(SECTION, format!("lora shrink / fused vs slow, worst: {} (≤ 1e-5 f32, 1e-2 16-bit)", key.join(", ")));
    Ok(())
}

/// The paged decode attention over scattered blocks against its gathered reference.
pub(crate) fn attention(report: &mut Report, dev: &Device, quick: bool) -> Result<()> {
    let block_size = 16;
    let cases: &[(usize, usize)] = if quick { &[(1, 700), (16, 200)] } else { &[(1, 2048), (16, 700), (64, 300)] };
    let mut key = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut worst: f64 = 0.0;
        for &(n, max_ctx) in cases {
            for (heads, kv_heads, head_dim) in [(32, 8, 128), (8, 8, 64)] {
                let d = PagedDecodeDims { heads, kv_heads, head_dim, block_size };
                let lens: Vec<u32> = (0..n).map(|i| (max_ctx - (i * 37) % max_ctx.max(1)).max(1) as u32).collect();
                let max_blocks = (max_ctx).div_ceil(block_size);
                let num_blocks = n * max_blocks + 7;
                // Blocks handed out in a scrambled order, as a long-running pool does.
                let tables: Vec<u32> =
                    (0..(n * max_blocks) as u32).map(|b| b.wrapping_mul(2_654_435_761) % num_blocks as u32).collect();
                let bt = Tensor::from_vec(tables, (n, max_blocks), dev)?;
                let cl = Tensor::from_vec(lens, n, dev)?;
                let q = randn(&[n, heads, head_dim], 0.1, dtype, dev)?;
                let k = randn(&[num_blocks * block_size, kv_heads * head_dim], 1.0, dtype, dev)?;
                let v = randn(&[num_blocks * block_size, kv_heads * head_dim], 1.0, dtype, dev)?;
                let fast = paged_decode_attention(&q, &k, &v, &bt, &cl, d)?;
                let slow = paged_decode_attention_slow(&q, &k, &v, &bt, &cl, d)?;
                worst = worst.max(rel_err(&fast, &slow)?);
            }
        }
        let tol = tolerance(dtype);
        report.check(
            SECTION,
            format!("paged decode attention {dtype:?} vs gathered"),
            format!("{worst:.2e}"),
            &format!("≤ {tol:.0e} relative"),
            worst <= tol,
        );
        key.push(format!("{dtype:?} {worst:.0e}"));
    }
    report.key(SECTION, format!("paged decode attention vs gathered, worst: {}", key.join(", ")));
    Ok(())
}

/// The fused kernels of a decode layer against the tensor ops they replace, at Llama-3-8B's shapes:
/// the rotated and scaled queries and both caches, the residual sum and its norm, SiLU · up.
pub(crate) fn fused(report: &mut Report, dev: &Device, quick: bool) -> Result<()> {
    let a = llama3_8b_attention(1, 1);
    let (heads, kv_heads, hd, hidden, inter) =
        (a.heads, a.kv_heads, a.head_dim, LLAMA3_8B_HIDDEN, LLAMA3_8B_INTERMEDIATE);
    let d = a.dims();
    let (qs, kvs, half) = (heads * hd, kv_heads * hd, hd / 2);
    let tokens: &[usize] = if quick { &[1, 16] } else { &[1, 16, 64, 300] };
    let mut key = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut worst: f64 = 0.0;
        for &n in tokens {
            // RoPE + scale + K/V write: every token's row, caches of 2n + 5 rows.
            let rows = 2 * n + 5;
            let qkv = randn(&[n, qs + 2 * kvs], 1.0, dtype, dev)?;
            let angles: Vec<f32> = (0..n * half).map(|i| (i % 997) as f32 * 0.37).collect();
            let cos = Tensor::from_vec(angles.iter().map(|a| a.cos()).collect::<Vec<_>>(), (n, half), dev)?
                .to_dtype(dtype)?;
            let sin = Tensor::from_vec(angles.iter().map(|a| a.sin()).collect::<Vec<_>>(), (n, half), dev)?
                .to_dtype(dtype)?;
            let slots = Tensor::from_vec((0..n as u32).map(|t| 2 * t + 1).collect::<Vec<_>>(), n, dev)?;
            let (k0, v0) = (randn(&[rows, kvs], 1.0, dtype, dev)?, randn(&[rows, kvs], 1.0, dtype, dev)?);
            let (kf, vf, ks, vs) = (k0.copy()?, v0.copy()?, k0.copy()?, v0.copy()?);
            let scale = 1.0 / (hd as f64).sqrt();
            let q = rope_kv_write(&qkv, (&cos, &sin), d, (&kf, &vf), &slots, scale)?
                .ok_or_else(|| anyhow::anyhow!("rope_kv_write did not take {dtype:?} on this device"))?;
            let heads_of = |at: usize, h: usize| -> Result<Tensor> {
                Ok(qkv.narrow(1, at, h * hd)?.contiguous()?.reshape((1, n, h, hd))?)
            };
            let q_want = (candle_nn::rotary_emb::rope_thd(&heads_of(0, heads)?, &cos, &sin)? * scale)?
                .reshape((n, heads, hd))?;
            let k_rot = candle_nn::rotary_emb::rope_thd(&heads_of(qs, kv_heads)?, &cos, &sin)?.reshape((n, kvs))?;
            paged_kv_write_slow(&ks, &vs, &k_rot, &qkv.narrow(1, qs + kvs, kvs)?.contiguous()?, &slots)?;
            for e in [rel_err(&q, &q_want)?, rel_err(&kf, &ks)?, rel_err(&vf, &vs)?] {
                worst = worst.max(e);
            }
            // The residual add and the norm; SiLU · up.
            let (x, r, w) = (
                randn(&[n, hidden], 1.0, dtype, dev)?,
                randn(&[n, hidden], 1.0, dtype, dev)?,
                randn(&[hidden], 1.0, dtype, dev)?,
            );
            let (sum, normed) = add_rms_norm(&x, &r, &w, 1e-5)?;
            let sum_want = (&x + &r)?;
            worst = worst
                .max(rel_err(&sum, &sum_want)?)
                .max(rel_err(&normed, &candle_nn::ops::rms_norm(&sum_want, &w, 1e-5)?)?);
            let gu = randn(&[n, 2 * inter], 2.0, dtype, dev)?;
            let act = silu_mul(&gu, inter)?
                .ok_or_else(|| anyhow::anyhow!("silu_mul did not take {dtype:?} on this device"))?;
            let act_want = (candle_nn::ops::silu(&gu.narrow(1, 0, inter)?)? * gu.narrow(1, inter, inter)?)?;
            worst = worst.max(rel_err(&act, &act_want)?);
        }
        let tol = tolerance(dtype);
        report.check(
            SECTION,
            format!("fused RoPE + KV write, add + norm, SiLU · up {dtype:?} vs tensor ops"),
            format!("{worst:.2e}"),
            &format!("≤ {tol:.0e} relative"),
            worst <= tol,
        );
        key.push(format!("{dtype:?} {worst:.0e}"));
    }
    report.key(SECTION, format!("fused kernels vs tensor ops, worst: {}", key.join(", ")));
    Ok(())
}
