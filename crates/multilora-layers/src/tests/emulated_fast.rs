//! The decode-path kernels' own source (`kv_write.cu`, the BGMV-shaped LoRA kernels, the
//! split-context decode attention) run on the CPU by the host emulator with the parameters the
//! host plan makes, against their slow references: f32, bf16 and f16, odd and misaligned shapes
//! (the scalar tails), padding and empty slots, long contexts and GQA groups of 1, 3, 4 and 8.

use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_kernels::{Emulator, kernel};
use multilora_types::ModuleKind;

use super::emulated::{Buffers, PagedCase, bytes_tensor, check_layer, kernel_dtype, paged_case, tensor_bytes};
use super::ops::random_slots;
use super::{Rng, bits, rel_err, slot_map, test_device};
use crate::mapping::slot_table;
use crate::ops::attention::split::split_plan;
use crate::ops::bgmv::BgmvPlan;
use crate::ops::kv_write::kv_write_launch;
use crate::{
    LoraMapping, LoraSlots, PagedDecodeDims, lora_apply, lora_bgmv_expand, lora_bgmv_shrink, paged_decode_attention,
    paged_decode_attention_slow, paged_kv_write, paged_kv_write_slow,
};

/// The KV write against `scatter_set`: a strided source (V as a column range of the fused qkv
/// output), aligned and misaligned rows, a padding slot that writes nothing, in every dtype; the
/// caches must match bit for bit.
#[test]
fn emulated_kv_write_matches_scatter() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let dev = &Device::Cpu;
    let mut rng = Rng::new(17);
    // (tokens, width, columns of the fused source before the row, its total width, dtype)
    let cases = [
        (7, 128, 256, 512, DType::BF16),
        (5, 64, 64, 192, DType::F32),
        (9, 256, 512, 768, DType::F16),
        // 15 elements: rows 30 or 60 bytes long, never 16-byte aligned: the scalar tail only.
        (6, 15, 3, 33, DType::BF16),
        (4, 15, 1, 17, DType::F32),
        // Aligned rows with a tail (72 elements = 9 vectors of bf16; 36 f32 = 9 vectors).
        (3, 72, 8, 80, DType::F16),
        (1, 36, 0, 36, DType::F32),
    ];
    for (tokens, width, off, fused, dtype) in cases {
        let num_rows = 40;
        let src = rng.tensor(&[tokens, fused], 1.0, dtype, dev)?;
        let cache0 = rng.tensor(&[num_rows, width], 1.0, dtype, dev)?;
        let mut pool: Vec<u32> = (0..num_rows as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.range(0, i));
        }
        let mut slots: Vec<u32> = pool[..tokens].to_vec();
        // The last token is padding: no row.
        slots[tokens - 1] = u32::MAX;

        let want_k = cache0.copy()?;
        let want_v = cache0.copy()?;
        let live = tokens - 1;
        if live > 0 {
            let rows = src.narrow(0, 0, live)?.narrow(1, off, width)?;
            let idx = Tensor::from_vec(slots[..live].to_vec(), live, dev)?;
            paged_kv_write_slow(&want_k, &want_v, &rows, &rows, &idx)?;
        }

        let mut l = kv_write_launch(tokens, width, fused, dtype, num_rows)?;
        let mut bufs = Buffers::default();
        let s = bufs.add(tensor_bytes(&src)?);
        l.params.src = s + (off * dtype.size_in_bytes()) as u64;
        l.params.slots = bufs.add(slots.iter().flat_map(|v| v.to_le_bytes()).collect());
        l.params.cache = bufs.add(tensor_bytes(&cache0)?);
        emu.launch(kernel::PAGED_KV_WRITE, l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
        let got = bytes_tensor(bufs.get(l.params.cache), dtype, &[num_rows, width])?;
        anyhow::ensure!(
            bits(&got)? == bits(&want_k)?,
            "tokens {tokens} width {width} offset {off} of {fused} {dtype:?}: the cache differs from scatter_set"
        );
    }
    Ok(())
}

/// One layer's BGMV shrink then expand through the emulated kernels, the shrink's output buffer
/// filled with NaN first: `(plan, s [k_split, n_lora, s_width], y)`.
fn bgmv_layer(
    emu: &Emulator,
    x: &Tensor,
    y: &Tensor,
    slices: &[&LoraSlots],
    mapping: &LoraMapping,
) -> anyhow::Result<(BgmvPlan, Tensor, Tensor)> {
    let plan = BgmvPlan::for_layer(mapping, slices).ok_or_else(|| anyhow::anyhow!("no BGMV plan"))?;
    let n = mapping.num_lora_rows();
    let (tx, tw) = (kernel_dtype(x.dtype())?, kernel_dtype(slices[0].dtype())?);
    let mut bufs = Buffers::default();
    let xp = bufs.add(tensor_bytes(x)?);
    let rows = bufs.add(tensor_bytes(mapping.lora_index().expect("lora rows"))?);
    let segments: Vec<_> = mapping.lora_segments().copied().collect();
    let table = slot_table(&segments, mapping.num_base_rows(), mapping.max_loras());
    let meta = bufs.add(table.iter().flat_map(|v| v.to_le_bytes()).collect());
    let a: Vec<u64> = slices.iter().map(|s| Ok(bufs.add(tensor_bytes(s.a())?))).collect::<anyhow::Result<_>>()?;
    let out = bufs.add(vec![0xff; 4 * plan.k_split * n * plan.s_width]);
    let l = plan.shrink((xp, x.dim(1)?), (rows, meta), &a, out, n)?;
    emu.launch(&kernel::lora_shrink_bgmv(tx, tw, plan.rank), l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
    let yp = bufs.add(tensor_bytes(y)?);
    let b: Vec<u64> = slices.iter().map(|s| Ok(bufs.add(tensor_bytes(s.b())?))).collect::<anyhow::Result<_>>()?;
    let mut col_off = Vec::new();
    let mut at = 0;
    for s in slices {
        col_off.push(at);
        at += s.out_features();
    }
    let l = plan.expand((yp, y.dim(1)?), (rows, meta), &b, out, n, &col_off)?;
    emu.launch(&kernel::lora_expand_bgmv(tx, tw, plan.rank), l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
    let s = bytes_tensor(bufs.get(out), DType::F32, &[plan.k_split, n, plan.s_width])?;
    let y = bytes_tensor(bufs.get(yp), y.dtype(), y.dims())?;
    Ok((plan, s, y))
}

/// The BGMV (decode-shaped) shrink and expand against the slow references: every rank bucket
/// (8, 16, 32, 64), empty slots and base rows, aligned rows (16-byte loads) and odd widths (the
/// scalar tails), a K split, several slices and column chunks, mixed dtypes; the shrink must write
/// every element of its output (it starts as NaN), base rows and untargeted slices keep every bit.
#[test]
fn emulated_bgmv_matches_the_slow_reference() -> anyhow::Result<()> {
    let (f32_, bf16, f16) = (DType::F32, DType::BF16, DType::F16);
    check_bgmv(
        29,
        &[
            (37, 96, &[64, 32, 32], 5, 16, f32_, f32_),
            (37, 96, &[64, 32, 32], 5, 16, bf16, bf16),
            (20, 1100, &[40], 3, 64, f16, f16),
            (12, 1024, &[520, 24], 4, 24, bf16, f32_),
        ],
    )
}

/// [`emulated_bgmv_matches_the_slow_reference`]'s odd shapes: ragged inputs and widths (the
/// scalar paths), a full decode batch over 8 slots, one row, more slots than row blocks.
#[test]
fn emulated_bgmv_odd_shapes_match_the_slow_reference() -> anyhow::Result<()> {
    let (f32_, bf16, f16) = (DType::F32, DType::BF16, DType::F16);
    check_bgmv(
        31,
        &[
            (9, 67, &[1500, 7], 3, 8, f32_, f32_),
            (64, 512, &[64], 8, 8, bf16, bf16),
            (1, 64, &[16], 2, 8, f16, bf16),
            (70, 40, &[24], 9, 4, f32_, bf16),
            (16, 256, &[128, 64], 4, 32, f32_, f16),
        ],
    )
}

/// `(rows, in, outs, max_loras, max_rank, x dtype, slot dtype)` of one BGMV case.
type BgmvCase<'a> = (usize, usize, &'a [usize], usize, usize, DType, DType);

fn check_bgmv(seed: u64, cases: &[BgmvCase<'_>]) -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let dev = &Device::Cpu;
    let mut rng = Rng::new(seed);
    let kinds = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj];
    for &(rows, inp, outs, max_loras, max_rank, xd, wd) in cases {
        let what = format!("rows {rows} in {inp} outs {outs:?} slots {max_loras} rank {max_rank} {xd:?}/{wd:?}");
        let slots: Vec<LoraSlots> = outs
            .iter()
            .zip(kinds)
            .map(|(&o, k)| random_slots(&mut rng, ModuleId::layer(0, k), (max_loras, max_rank, inp, o), wd, dev))
            .collect::<anyhow::Result<_>>()?;
        let refs: Vec<&LoraSlots> = slots.iter().collect();
        let mut slot_list = rng.slots(rows, max_loras);
        // A run of one slot longer than a row block, so a slot spans several blocks.
        let run = rng.range(0, max_loras - 1) as i32;
        for s in slot_list.iter_mut().take(rows / 2) {
            *s = run;
        }
        let mapping = slot_map(&slot_list, max_loras, dev)?;
        if mapping.no_lora() || BgmvPlan::for_layer(&mapping, &refs).is_none() {
            anyhow::bail!("{what}: the case must run the BGMV kernels");
        }
        let x = rng.tensor(&[rows, inp], 1.0, xd, dev)?;
        let total: usize = outs.iter().sum();
        let y0 = rng.tensor(&[rows, total], 1.0, xd, dev)?;
        let (plan, s, y) = bgmv_layer(emu, &x, &y0, &refs, &mapping)?;
        let written = s.flatten_all()?.to_vec1::<f32>()?.iter().all(|v| !v.is_nan());
        anyhow::ensure!(written, "{what}: the shrink left elements of its output unwritten");

        check_layer(&what, &x, &y0, &y, &s, (&plan.s_offsets, &plan.active), &refs, &mapping, &slot_list, wd)?;
    }
    Ok(())
}

/// The split decode attention (partitions and their reduce) against the gathered reference over
/// scattered blocks: long contexts (several thousand tokens, one KV head so the data stays
/// small) under GQA 8 and 3, next to a one-token context; the output and scratch start as NaN.
#[test]
fn emulated_split_decode_long_contexts() -> anyhow::Result<()> {
    // The first sequence of each case is one token long, the second several thousand.
    check_split(43, &[(2, 8, 1, 64, 16, DType::BF16, 2600), (2, 3, 1, 128, 16, DType::F16, 4100)])
}

/// [`emulated_split_decode_long_contexts`]'s shapes: GQA 4, 2 and 1, two head groups (16 heads on
/// one KV head), head sizes 32 and 256, one partition.
#[test]
fn emulated_split_decode_shapes() -> anyhow::Result<()> {
    check_split(
        47,
        &[
            (3, 8, 2, 128, 16, DType::F32, 560),
            (4, 4, 2, 64, 8, DType::F32, 80),
            (2, 16, 1, 32, 16, DType::BF16, 530),
            (2, 4, 1, 256, 32, DType::BF16, 700),
            (3, 4, 4, 32, 4, DType::F16, 200),
        ],
    )
}

/// `(sequences, heads, kv_heads, head_dim, block_size, dtype, longest context)` of one case.
type SplitCase = (usize, usize, usize, usize, usize, DType, usize);

fn check_split(seed: u64, cases: &[SplitCase]) -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let mut rng = Rng::new(seed);
    for &(n, heads, kv_heads, hd, bs, dtype, max_len) in cases {
        let what = format!("n {n} heads {heads}/{kv_heads} d {hd} bs {bs} {dtype:?} ctx {max_len}");
        let PagedCase { d, q, k, v, bt, cl, max_blocks, want } =
            paged_case(&mut rng, (n, heads, kv_heads, hd, bs, dtype), max_len.div_ceil(bs) + 5, max_len)?;

        let mut plan = split_plan(n, max_blocks, d).ok_or_else(|| anyhow::anyhow!("{what}: no split plan"))?;
        anyhow::ensure!(plan.reduce.is_some() == (max_blocks * bs > 512), "{what}: reduce planned wrongly");
        let mut bufs = Buffers::default();
        let ptrs = [
            bufs.add(tensor_bytes(&q)?),
            bufs.add(tensor_bytes(&k)?),
            bufs.add(tensor_bytes(&v)?),
            bufs.add(tensor_bytes(&bt)?),
            bufs.add(tensor_bytes(&cl)?),
            // The output and the scratch start as NaN (the op allocates them unzeroed): every
            // output must be written, and whatever the reduce reads must have been.
            bufs.add(vec![0xff; n * heads * hd * dtype.size_in_bytes()]),
            bufs.add(vec![0xff; 4 * plan.acc_len.max(1)]),
            bufs.add(vec![0xff; 4 * plan.ml_len.max(1)]),
        ];
        for p in std::iter::once(&mut plan.split.params).chain(plan.reduce.as_mut().map(|r| &mut r.params)) {
            [p.q, p.k_cache, p.v_cache, p.block_tables, p.ctx_lens, p.out, p.part_acc, p.part_ml] = ptrs;
        }
        let (split, reduce) =
            kernel::paged_decode_split(kernel_dtype(dtype)?, hd, plan.heads_per_block).expect("a split head size");
        let l = plan.split;
        emu.launch(&split, l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
        if let Some(r) = plan.reduce {
            emu.launch(&reduce, r.grid, r.block, &r.params.to_bytes(), &mut bufs.0)?;
        }
        let got = bytes_tensor(bufs.get(ptrs[5]), dtype, &[n, heads * hd])?;
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let err = rel_err(&got, &want)?;
        anyhow::ensure!(err <= tol, "{what}: relative error {err:e}");
    }
    Ok(())
}

/// The KV write and the split decode attention on the device itself (the CUDA twins of the
/// emulated tests; on the CPU the kernels' ops refuse, naming the oracle to use instead).
fn device_kernels(dev: &Device) -> anyhow::Result<()> {
    let mut rng = Rng::new(53);
    let (tokens, width, rows) = (9, 256, 64);
    let cache_k = rng.tensor(&[rows, width], 1.0, DType::BF16, dev)?;
    let cache_v = cache_k.copy()?;
    let fused = rng.tensor(&[tokens, 3 * width], 1.0, DType::BF16, dev)?;
    let (k, v) = (fused.narrow(1, width, width)?, fused.narrow(1, 2 * width, width)?);
    let slots = Tensor::from_vec((0..tokens as u32).map(|t| (t * 7) % rows as u32).collect::<Vec<_>>(), tokens, dev)?;
    // A decode step of 12 rows over 4 slots: the BGMV kernels one by one, as the device check
    // times them, against lora_apply.
    let lora = random_slots(&mut rng, ModuleId::layer(0, ModuleKind::OProj), (4, 16, 256, 136), DType::BF16, dev)?;
    let mapping = slot_map(&rng.slots(12, 4), 4, dev)?;
    let x = rng.tensor(&[12, 256], 1.0, DType::BF16, dev)?;
    let y0 = rng.tensor(&[12, 136], 1.0, DType::BF16, dev)?;
    if dev.is_cpu() {
        let e = paged_kv_write(&cache_k, &cache_v, &k, &v, &slots).unwrap_err();
        anyhow::ensure!(e.to_string().contains("paged_kv_write_slow"), "{e}");
        if !mapping.no_lora() {
            anyhow::ensure!(lora_bgmv_shrink(&x, &[&lora], &mapping).is_err(), "the BGMV shrink ran on the CPU");
        }
        return Ok(());
    }
    if let Some(s) = lora_bgmv_shrink(&x, &[&lora], &mapping)? {
        let y = y0.copy()?;
        lora_bgmv_expand(&y, &s, &[&lora], &mapping)?;
        let want = lora_apply(&x, y0.copy()?, &[&lora], &mapping)?;
        anyhow::ensure!(bits(&y)? == bits(&want)?, "the BGMV kernels one by one differ from lora_apply");
    }
    let (want_k, want_v) = (cache_k.copy()?, cache_v.copy()?);
    paged_kv_write_slow(&want_k, &want_v, &k, &v, &slots)?;
    paged_kv_write(&cache_k, &cache_v, &k, &v, &slots)?;
    anyhow::ensure!(bits(&cache_k)? == bits(&want_k)? && bits(&cache_v)? == bits(&want_v)?, "KV write differs");

    // GQA 4 over a 3000-token context (six partitions) and a one-token one.
    let d = PagedDecodeDims { heads: 8, kv_heads: 2, head_dim: 128, block_size: 16 };
    let num_blocks = 200;
    let (lens, tables, max_blocks) = rng.paged_contexts(2, 16, num_blocks, 3000);
    let q = rng.tensor(&[2, 8, 128], 0.5, DType::BF16, dev)?;
    let kc = rng.tensor(&[num_blocks * 16, 256], 1.0, DType::BF16, dev)?;
    let vc = rng.tensor(&[num_blocks * 16, 256], 1.0, DType::BF16, dev)?;
    let bt = Tensor::from_vec(tables, (2, max_blocks), dev)?;
    let cl = Tensor::from_vec(lens, 2, dev)?;
    let got = paged_decode_attention(&q, &kc, &vc, &bt, &cl, d)?;
    let want = paged_decode_attention_slow(&q, &kc, &vc, &bt, &cl, d)?;
    let err = rel_err(&got, &want)?;
    anyhow::ensure!(err <= 1e-2, "split decode attention relative error {err:e}");
    Ok(())
}

test_device!(device_kernels, device_kernels_cpu, device_kernels_cuda);
