//! `timing`: each kernel of a decode step on its own at Llama-3-8B's decode shapes in bf16 (64
//! rows over 8 rank-16 adapters, `floor::DECODE`), timed by CUDA events over back-to-back candle
//! calls and over replays of the call captured into a CUDA graph (`clock.rs`: the replays are the
//! kernel's time, the calls add the host's), each printed as the kernel's time / floor (the bytes
//! it must move at the device's bandwidth) beside the calls' device and enqueue time per call:
//! - the decode-shaped LoRA kernels (`lora_bgmv_shrink`, `lora_bgmv_expand`: what `lora_apply`
//!   runs at decode) on each of a decoder layer's four adapted layers, and beside them the
//!   segmented ones (`lora_shrink`, `lora_expand`: prefill's) at the same shapes;
//! - the base GEMM of the same layers (`multilora_layers::linear`, cuBLAS on CUDA);
//! - writing the step's keys and values into the paged caches (`paged_kv_write`, and candle's
//!   `scatter_set`, which it replaced, for comparison);
//! - paged decode attention at the step's batch and at long contexts (GQA 32 / 8, head 128);
//! - a decode layer's fused kernels (`fused.cu`): RoPE + query scale + K/V write, the residual
//!   add + RMS norm, SiLU · up.
//!
//! With `ncu` (Nsight Compute) on the machine, the section prints the command line that measures
//! each of these kernels' DRAM bytes ([`ncu_command`]).
//!
//! Nothing here is pass / fail: the figures say where a step's time goes, for the first device
//! run to be read against the floors in `docs/BENCHMARKS.md`.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_layers::{
    LoraMapping, LoraSlots, add_rms_norm, linear, lora_bgmv_expand, lora_bgmv_shrink, lora_expand, lora_shrink,
    paged_decode_attention, paged_kv_write, paged_kv_write_slow, rope_kv_write, silu_mul,
};
use multilora_types::{ModuleKind, SlotId};

use crate::clock::{Replay, Timed, measured};
use crate::floor::{
    ATTENTION_CASES, DECODE, LLAMA3_8B_HIDDEN, LLAMA3_8B_INTERMEDIATE, LLAMA3_8B_LAYERS, add_norm_bytes,
    attention_bytes, expand_bytes, gemm_bytes, kv_write_bytes, llama3_8b_attention, rope_kv_bytes, shrink_bytes,
    silu_mul_bytes,
};
use crate::kernels::random_slots;
use crate::report::Report;
use crate::util::randn;

const SECTION: &str = "timing";
/// Calls between the two events: enough that the events' own resolution (~0.5 µs) is noise.
const ITERS: usize = 100;

/// Device and host time, and bytes, summed over a decoder layer's calls (the replays' while
/// every call has one).
struct Sum {
    device: f64,
    host: f64,
    replay: Option<f64>,
    bytes: u64,
}

impl Sum {
    fn new() -> Sum {
        Sum { device: 0.0, host: 0.0, replay: Some(0.0), bytes: 0 }
    }

    fn add(&mut self, t: &Timed, bytes: u64) {
        self.device += t.device;
        self.host += t.host;
        self.replay = match t.replay {
            Replay::Device(s) => self.replay.map(|r| r + s),
            _ => None,
        };
        self.bytes += bytes;
    }

    fn timed(&self) -> Timed {
        let replay = self.replay.map_or_else(|| Replay::Failed("not every call replayed".into()), Replay::Device);
        Timed { device: self.device, host: self.host, replay }
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
    let (mut shrink, mut expand, mut gemm) = (Sum::new(), Sum::new(), Sum::new());
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
        let t = measured(dev, ITERS, || {
            lora_bgmv_shrink(&x, &refs, &mapping)?.ok_or_else(|| anyhow::anyhow!("not decode-shaped"))?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_bgmv_shrink {name}"), &t, bytes);
        shrink.add(&t, bytes);
        let t = measured(dev, ITERS, || {
            lora_shrink(&x, &refs, &mapping)?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_shrink (segmented) {name}"), &t, bytes);
        let bytes = expand_bytes(s, outs);
        let sh = lora_bgmv_shrink(&x, &refs, &mapping)?.ok_or_else(|| anyhow::anyhow!("not decode-shaped"))?;
        let t = measured(dev, ITERS, || {
            // In place: y accumulates, which changes nothing of what is read or written.
            lora_bgmv_expand(&y, &sh, &refs, &mapping)?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_bgmv_expand {name}"), &t, bytes);
        expand.add(&t, bytes);
        let sh = lora_shrink(&x, &refs, &mapping)?;
        let t = measured(dev, ITERS, || {
            lora_expand(y.clone(), &sh, &refs, &mapping)?;
            Ok(())
        })?;
        report.timed(SECTION, format!("lora_expand (segmented) {name}"), &t, bytes);
        let w = randn(&[total, inp], 0.02, dtype, dev)?;
        let t = measured(dev, ITERS, || {
            linear(&x, &w)?;
            Ok(())
        })?;
        let bytes = gemm_bytes(s.rows, inp, total, s.elem);
        report.timed(SECTION, format!("base GEMM {name} [{total}, {inp}]"), &t, bytes);
        gemm.add(&t, bytes);
    }
    for (what, sum) in [("lora_bgmv_shrink", &shrink), ("lora_bgmv_expand", &expand), ("base GEMM", &gemm)] {
        let v = report.timed(SECTION, format!("{what}, a decoder layer (4 calls)"), &sum.timed(), sum.bytes);
        report.key(SECTION, format!("{what} ×4: {v}"));
    }
    kv(report, dev)?;
    attention(report, dev)?;
    fused(report, dev)?;
    if let Some(ncu) = ncu_command() {
        report.info(SECTION, "ncu (each kernel's DRAM bytes)", ncu);
    }
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
    let t = measured(dev, ITERS, || Ok(paged_kv_write(&cache_k, &cache_v, &k, &v, &slots)?))?;
    let value = report.timed(SECTION, format!("KV write, {rows} rows of {width} into both caches"), &t, bytes);
    report.key(SECTION, format!("KV write: {value}"));
    let t = measured(dev, ITERS, || Ok(paged_kv_write_slow(&cache_k, &cache_v, &k, &v, &slots)?))?;
    report.timed(SECTION, format!("KV write by candle's scatter_set (replaced), {rows} rows"), &t, bytes);
    Ok(())
}

/// Paged decode attention over scrambled blocks, every sequence at the full context.
fn attention(report: &mut Report, dev: &Device) -> Result<()> {
    for (n, ctx) in ATTENTION_CASES {
        let a = llama3_8b_attention(n, ctx);
        let d = a.dims();
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
        let t = measured(dev, ITERS, || {
            paged_decode_attention(&q, &k, &v, &bt, &cl, d)?;
            Ok(())
        })?;
        let value = report.timed(SECTION, format!("decode attention, {n} × {ctx} tokens"), &t, attention_bytes(a));
        report.key(SECTION, format!("attention {n}×{ctx}: {value}"));
    }
    Ok(())
}

/// A decode layer's fused kernels at the timed step's 64 rows, Llama-3-8B's widths, bf16.
fn fused(report: &mut Report, dev: &Device) -> Result<()> {
    let attn = llama3_8b_attention(DECODE.rows, 512);
    let (n, hd, dtype) = (attn.n, attn.head_dim, DType::BF16);
    let d = attn.dims();
    let (qs, kvs) = (attn.heads * hd, attn.kv_heads * hd);
    let qkv = randn(&[n, qs + 2 * kvs], 1.0, dtype, dev)?;
    let (cos, sin) = (randn(&[n, hd / 2], 1.0, dtype, dev)?, randn(&[n, hd / 2], 1.0, dtype, dev)?);
    let cache_rows = n * attn.ctx;
    let (kc, vc) = (Tensor::zeros((cache_rows, kvs), dtype, dev)?, Tensor::zeros((cache_rows, kvs), dtype, dev)?);
    let slots = Tensor::from_vec((0..n).map(|i| ((i + 1) * attn.ctx - 1) as u32).collect::<Vec<_>>(), n, dev)?;
    let scale = 1.0 / (hd as f64).sqrt();
    let t = measured(dev, ITERS, || {
        rope_kv_write(&qkv, (&cos, &sin), d, (&kc, &vc), &slots, scale)?
            .ok_or_else(|| anyhow::anyhow!("rope_kv_write did not take bf16 on this device"))?;
        Ok(())
    })?;
    let value = report.timed(SECTION, format!("RoPE + scale + KV write (fused), {n} rows"), &t, rope_kv_bytes(attn));
    report.key(SECTION, format!("RoPE + KV write: {value}"));
    let (hidden, inter) = (LLAMA3_8B_HIDDEN, LLAMA3_8B_INTERMEDIATE);
    let (x, r, w) = (
        randn(&[n, hidden], 1.0, dtype, dev)?,
        randn(&[n, hidden], 1.0, dtype, dev)?,
        randn(&[hidden], 1.0, dtype, dev)?,
    );
    let t = measured(dev, ITERS, || {
        add_rms_norm(&x, &r, &w, 1e-5)?;
        Ok(())
    })?;
    let value =
        report.timed(SECTION, format!("add + RMS norm (fused), {n} × {hidden}"), &t, add_norm_bytes(n, hidden, 2));
    report.key(SECTION, format!("add + norm: {value}"));
    let gu = randn(&[n, 2 * inter], 1.0, dtype, dev)?;
    let t = measured(dev, ITERS, || {
        silu_mul(&gu, inter)?.ok_or_else(|| anyhow::anyhow!("silu_mul did not take bf16 on this device"))?;
        Ok(())
    })?;
    let value = report.timed(SECTION, format!("SiLU · up (fused), {n} × {inter}"), &t, silu_mul_bytes(n, inter, 2));
    report.key(SECTION, format!("SiLU · up: {value}"));
    Ok(())
}

/// Our kernels' names, for `ncu --kernel-name` (the prefixes of `multilora_kernels::kernel`'s).
const OUR_KERNELS: &str = "regex:^(lora_|paged_|rope_kv_write|add_rms_norm|silu_mul)";

/// The Nsight Compute command line that measures this section's kernels' DRAM bytes and time,
/// when `ncu` is on `PATH` or in the CUDA toolkit (`CUDA_HOME`, `/usr/local/cuda`): this binary
/// with its own arguments, only this section, no report files.
fn ncu_command() -> Option<String> {
    let ncu = ncu_path()?;
    let mut args = std::env::args();
    let exe = args.next()?;
    let mut kept = Vec::new();
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        match a.as_str() {
            "--only" | "--report" => skip = true,
            _ if a.starts_with("--only=") || a.starts_with("--report=") => {}
            _ => kept.push(a),
        }
    }
    Some(format!(
        "{} --kernel-name '{OUR_KERNELS}' --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
         --csv {exe} {} --only {SECTION}",
        ncu.display(),
        kept.join(" ")
    ))
}

/// `ncu` on `PATH`, else under `$CUDA_HOME/bin` or `/usr/local/cuda/bin`.
fn ncu_path() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let home = std::env::var_os("CUDA_HOME").map(|h| std::path::PathBuf::from(h).join("bin"));
    std::env::split_paths(&path)
        .chain(home)
        .chain([std::path::PathBuf::from("/usr/local/cuda/bin")])
        .map(|d| d.join("ncu"))
        .find(|p| p.is_file())
}
