//! `timing`: each kernel of a decode step on its own, timed by CUDA events over back-to-back
//! launches (`clock.rs`) at Llama-3-8B's decode shapes in bf16 (64 rows over 8 rank-16 adapters,
//! `floor::DECODE`), each printed as measured / floor (the bytes it must move at the device's bandwidth) beside
//! the host's enqueue time per call:
//! - the decode-shaped LoRA kernels (`lora_bgmv_shrink`, `lora_bgmv_expand`: what `lora_apply`
//!   runs at decode) on each of a decoder layer's four adapted layers, and beside them the
//!   segmented ones (`lora_shrink`, `lora_expand`: prefill's) at the same shapes;
//! - the base GEMM of the same layers (`multilora_layers::linear`, cuBLAS on CUDA);
//! - writing the step's keys and values into the paged caches (`paged_kv_write`, and candle's
//!   `scatter_set`, which it replaced, for comparison);
//! - paged decode attention at the step's batch and at long contexts (GQA 32 / 8, head 128).
//!
//! Nothing here is pass / fail: the figures say where a step's time goes, for the first device
//! run to be read against the floors in `docs/BENCHMARKS.md`.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_layers::{
    LoraMapping, LoraSlots, PagedDecodeDims, linear, lora_bgmv_expand, lora_bgmv_shrink, lora_expand, lora_shrink,
    paged_decode_attention, paged_kv_write, paged_kv_write_slow,
};
use multilora_types::{ModuleKind, SlotId};

use crate::clock::{Timed, events};
use crate::floor::{
    ATTENTION_CASES, DECODE, LLAMA3_8B_LAYERS, attention_bytes, expand_bytes, gemm_bytes, kv_write_bytes,
    llama3_8b_attention, shrink_bytes,
};
use crate::kernels::random_slots;
use crate::report::Report;
use crate::util::randn;

const SECTION: &str = "timing";
/// Calls between the two events: enough that the events' own resolution (~0.5 µs) is noise.
const ITERS: usize = 100;

/// Device and host time, and bytes, summed over a decoder layer's calls.
#[derive(Default)]
struct Sum {
    device: f64,
    host: f64,
    bytes: u64,
}

impl Sum {
    fn add(&mut self, t: Timed, bytes: u64) {
        self.device += t.device;
        self.host += t.host;
        self.bytes += bytes;
    }

    fn timed(&self) -> Timed {
        Timed { device: self.device, host: self.host }
    }
}

pub(crate) fn run(report: &mut Report, dev: &Device) -> Result<()> {
    let s = DECODE;
    let dtype = DType::BF16;
    report.info(
        SECTION,
        "shapes",
        format!(
            "Llama-3-8B decode, bf16, {} rows over {} rank-{} adapters; {ITERS} back-to-back calls between CUDA events",
            s.rows, s.adapters, s.rank
        ),
    );
    let slot_list: Vec<Option<SlotId>> = (0..s.rows).map(|r| Some(SlotId::new(r % s.adapters))).collect();
    let mapping = LoraMapping::new(&slot_list, s.adapters, dev)?;
    let (mut shrink, mut expand, mut gemm) = (Sum::default(), Sum::default(), Sum::default());
    let kinds = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj];
    for (name, inp, outs) in LLAMA3_8B_LAYERS {
        let ranks = vec![s.rank; s.adapters];
        let slots: Vec<LoraSlots> = outs
            .iter()
            .zip(kinds)
            .map(|(&o, k)| random_slots(ModuleId::layer(0, k), (s.adapters, s.rank, inp, o), &ranks, dtype, dev))
            .collect::<Result<_>>()?;
        let refs: Vec<&LoraSlots> = slots.iter().collect();
        let total: usize = outs.iter().sum();
        let x = randn(&[s.rows, inp], 1.0, dtype, dev)?;
        let y = Tensor::zeros((s.rows, total), dtype, dev)?;
        let bytes = shrink_bytes(s, inp, outs);
        let t = events(dev, ITERS, || {
            lora_bgmv_shrink(&x, &refs, &mapping)?.ok_or_else(|| anyhow::anyhow!("not decode-shaped"))?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_bgmv_shrink {name}"), t, bytes);
        shrink.add(t, bytes);
        let t = events(dev, ITERS, || {
            lora_shrink(&x, &refs, &mapping)?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_shrink (segmented) {name}"), t, bytes);
        let bytes = expand_bytes(s, outs);
        let sh = lora_bgmv_shrink(&x, &refs, &mapping)?.ok_or_else(|| anyhow::anyhow!("not decode-shaped"))?;
        let t = events(dev, ITERS, || {
            // In place: y accumulates, which changes nothing of what is read or written.
            lora_bgmv_expand(&y, &sh, &refs, &mapping)?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_bgmv_expand {name}"), t, bytes);
        expand.add(t, bytes);
        let sh = lora_shrink(&x, &refs, &mapping)?;
        let t = events(dev, ITERS, || {
            lora_expand(y.clone(), &sh, &refs, &mapping)?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_expand (segmented) {name}"), t, bytes);
        let w = randn(&[total, inp], 0.02, dtype, dev)?;
        let t = events(dev, ITERS, || {
            linear(&x, &w)?;
            Ok(())
        })?;
        let bytes = gemm_bytes(s.rows, inp, total, s.elem);
        report.timed(SECTION, format!("base GEMM {name} [{total}, {inp}]"), t, bytes);
        gemm.add(t, bytes);
    }
    for (what, sum) in [("lora_bgmv_shrink", &shrink), ("lora_bgmv_expand", &expand), ("base GEMM", &gemm)] {
        let v = report.timed(SECTION, format!("{what}, a decoder layer (4 calls)"), sum.timed(), sum.bytes);
        report.key(SECTION, format!("{what} ×4: {v}"));
    }
    kv(report, dev)?;
    attention(report, dev)?;
    Ok(())
}

/// The KV write of a decode step: one new row per sequence, at the last position of its context.
fn kv(report: &mut Report, dev: &Device) -> Result<()> {
    let attn = llama3_8b_attention(DECODE.rows, 512);
    let (rows, width, bs) = (attn.n, attn.kv_heads * attn.head_dim, attn.block_size);
    let blocks_per_seq = attn.ctx / bs;
    let cache_rows = rows * blocks_per_seq * bs;
    let cache_k = Tensor::zeros((cache_rows, width), DType::BF16, dev)?;
    let cache_v = cache_k.zeros_like()?;
    let slots: Vec<u32> = (0..rows).map(|i| ((i * blocks_per_seq + blocks_per_seq - 1) * bs + bs - 1) as u32).collect();
    let slots = Tensor::from_vec(slots, rows, dev)?;
    let k = randn(&[rows, width], 1.0, DType::BF16, dev)?;
    let v = randn(&[rows, width], 1.0, DType::BF16, dev)?;
    let bytes = kv_write_bytes(rows, width, 2);
    let t = events(dev, ITERS, || Ok(paged_kv_write(&cache_k, &cache_v, &k, &v, &slots)?))?;
    let value = report.timed(SECTION, format!("KV write, {rows} rows of {width} into both caches"), t, bytes);
    report.key(SECTION, format!("KV write: {value}"));
    let t = events(dev, ITERS, || Ok(paged_kv_write_slow(&cache_k, &cache_v, &k, &v, &slots)?))?;
    report.timed(SECTION, format!("KV write by candle's scatter_set (replaced), {rows} rows"), t, bytes);
    Ok(())
}

/// Paged decode attention over scrambled blocks, every sequence at the full context.
fn attention(report: &mut Report, dev: &Device) -> Result<()> {
    for (n, ctx) in ATTENTION_CASES {
        let a = llama3_8b_attention(n, ctx);
        let d =
            PagedDecodeDims { heads: a.heads, kv_heads: a.kv_heads, head_dim: a.head_dim, block_size: a.block_size };
        let max_blocks = ctx.div_ceil(a.block_size);
        let num_blocks = n * max_blocks;
        // Each block used once, handed out in a scrambled order (an odd multiplier modulo a
        // power of two is a permutation; other counts just reuse a few blocks).
        let tables: Vec<u32> =
            (0..num_blocks as u64).map(|b| (b.wrapping_mul(2_654_435_761) % num_blocks as u64) as u32).collect();
        let bt = Tensor::from_vec(tables, (n, max_blocks), dev)?;
        let cl = Tensor::from_vec(vec![ctx as u32; n], n, dev)?;
        let q = randn(&[n, a.heads, a.head_dim], 0.1, DType::BF16, dev)?;
        let width = a.kv_heads * a.head_dim;
        let k = randn(&[num_blocks * a.block_size, width], 1.0, DType::BF16, dev)?;
        let v = randn(&[num_blocks * a.block_size, width], 1.0, DType::BF16, dev)?;
        let t = events(dev, ITERS, || {
            paged_decode_attention(&q, &k, &v, &bt, &cl, d)?;
            Ok(())
        })?;
        let value = report.timed(SECTION, format!("decode attention, {n} × {ctx} tokens"), t, attention_bytes(a));
        report.key(SECTION, format!("attention {n}×{ctx}: {value}"));
    }
    Ok(())
}
