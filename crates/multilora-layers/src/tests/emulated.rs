//! The CUDA kernels' own source, run on the CPU by the host emulator of `multilora-kernels` with
//! the parameters the host plan makes, against the slow gathered reference: tiles, true ranks per
//! slice, the K split and its in-order reduction, several slices in one launch, column chunks and
//! ragged tails, many adapters in several launches, and every dtype pair, on every machine with a
//! C++ compiler. On a GPU the same kernels run for real through the `*_cuda` tests.

use candle_core::{DType, Device, Tensor};
use multilora_adapter::ModuleId;
use multilora_kernels::{Emulator, KernelDtype, Memory, kernel};
use multilora_types::ModuleKind;

use super::ops::random_slots;
use super::{Rng, bits, rel_err, slot_map};
use crate::ops::attention::decode_params;
use crate::ops::plan::{ExpandPtrs, SegmentedPlan, ShrinkPtrs};
use crate::{LoraMapping, LoraSlots, PagedDecodeDims, lora_expand_slow, lora_shrink_slow, paged_decode_attention_slow};

pub(crate) fn kernel_dtype(d: DType) -> anyhow::Result<KernelDtype> {
    Ok(match d {
        DType::F32 => KernelDtype::F32,
        DType::BF16 => KernelDtype::Bf16,
        DType::F16 => KernelDtype::F16,
        other => anyhow::bail!("no kernel for {other:?}"),
    })
}

/// A CPU tensor's values as little-endian bytes.
pub(crate) fn tensor_bytes(t: &Tensor) -> anyhow::Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::U32 => t.to_vec1::<u32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        other => anyhow::bail!("no bytes for {other:?}"),
    })
}

/// Bytes back into a CPU tensor.
pub(crate) fn bytes_tensor(b: &[u8], dtype: DType, shape: &[usize]) -> anyhow::Result<Tensor> {
    let dev = &Device::Cpu;
    let words = |n: usize| b.chunks_exact(n);
    Ok(match dtype {
        DType::F32 => {
            Tensor::from_vec(words(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), shape, dev)?
        }
        DType::BF16 => Tensor::from_vec(
            words(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>(),
            shape,
            dev,
        )?,
        DType::F16 => Tensor::from_vec(
            words(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>(),
            shape,
            dev,
        )?,
        other => anyhow::bail!("no tensor for {other:?}"),
    })
}

/// The buffers of one emulated launch sequence; `add` returns the pointer value naming a buffer,
/// in a view of the whole buffer: every access through it is checked against the buffer's length.
#[derive(Default)]
pub(crate) struct Buffers(pub(crate) Memory);

impl Buffers {
    pub(crate) fn add(&mut self, bytes: Vec<u8>) -> u64 {
        self.0.add(bytes)
    }

    pub(crate) fn get(&self, ptr: u64) -> &[u8] {
        self.0.get(ptr).expect("a pointer this memory made")
    }
}

/// One layer's shrink then expand through the emulated kernels: the shared shrink buffer
/// `[k_split, n_lora, s_width]` and the updated `y`.
fn emulated_layer(
    emu: &Emulator,
    x: &Tensor,
    y: &Tensor,
    slices: &[&LoraSlots],
    mapping: &LoraMapping,
    k_split: Option<usize>,
) -> anyhow::Result<(SegmentedPlan, Tensor, Tensor)> {
    let plan = SegmentedPlan::for_layer(mapping, slices, k_split)?;
    let n = mapping.num_lora_rows();
    let (tx, tw) = (kernel_dtype(x.dtype())?, kernel_dtype(slices[0].dtype())?);
    let mut bufs = Buffers::default();
    let xp = bufs.add(tensor_bytes(x)?);
    let rows = bufs.add(tensor_bytes(mapping.lora_index().expect("lora rows"))?);
    let tiles = bufs.add(tensor_bytes(mapping.tile_index().expect("tiles"))?);
    let a: Vec<u64> = slices.iter().map(|s| Ok(bufs.add(tensor_bytes(s.a())?))).collect::<anyhow::Result<_>>()?;
    // NaN first, as the fused path leaves it unzeroed: whatever the expand reads must have been
    // written by the shrink.
    let out = bufs.add(vec![0xff; 4 * plan.k_split * n * plan.s_width]);
    let sp = ShrinkPtrs::shared_output(&plan, (xp, x.dim(1)?), (rows, tiles), &a, out, n);
    for l in plan.shrink(&sp)? {
        emu.launch(&kernel::lora_shrink(tx, tw), l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
    }
    let yp = bufs.add(tensor_bytes(y)?);
    let b: Vec<u64> = slices.iter().map(|s| Ok(bufs.add(tensor_bytes(s.b())?))).collect::<anyhow::Result<_>>()?;
    let ep = ExpandPtrs::shared_input(&plan, (yp, y.dim(1)?), (rows, tiles), &b, out, n);
    let mut col_off = Vec::new();
    let mut at = 0;
    for s in slices {
        col_off.push(at);
        at += s.out_features();
    }
    for l in plan.expand(&ep, &col_off)? {
        emu.launch(&kernel::lora_expand(tx, tw), l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
    }
    let s = bytes_tensor(bufs.get(out), DType::F32, &[plan.k_split, n, plan.s_width])?;
    let y = bytes_tensor(bufs.get(yp), y.dtype(), y.dims())?;
    Ok((plan, s, y))
}

struct Case {
    rows: usize,
    inp: usize,
    outs: Vec<usize>,
    max_loras: usize,
    max_rank: usize,
    x: DType,
    w: DType,
    k_split: Option<usize>,
}

fn check(emu: &Emulator, rng: &mut Rng, c: &Case) -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    let what = format!(
        "rows {} in {} outs {:?} slots {} rank {} x {:?} w {:?} split {:?}",
        c.rows, c.inp, c.outs, c.max_loras, c.max_rank, c.x, c.w, c.k_split
    );
    let kinds = [ModuleKind::QProj, ModuleKind::KProj, ModuleKind::VProj];
    let slots: Vec<LoraSlots> = c
        .outs
        .iter()
        .zip(kinds)
        .map(|(&o, k)| random_slots(rng, ModuleId::layer(0, k), (c.max_loras, c.max_rank, c.inp, o), c.w, dev))
        .collect::<anyhow::Result<_>>()?;
    let refs: Vec<&LoraSlots> = slots.iter().collect();
    // Long runs of one slot (several tiles), base rows, and singletons.
    let mut slot_list = rng.slots(c.rows, c.max_loras);
    let run = rng.range(0, c.max_loras - 1) as i32;
    for s in slot_list.iter_mut().take(c.rows / 2) {
        *s = run;
    }
    let mapping = slot_map(&slot_list, c.max_loras, dev)?;
    if mapping.no_lora() {
        return Ok(());
    }
    let x = rng.tensor(&[c.rows, c.inp], 1.0, c.x, dev)?;
    let total: usize = c.outs.iter().sum();
    let y0 = rng.tensor(&[c.rows, total], 1.0, c.x, dev)?;
    let (plan, s, y) = emulated_layer(emu, &x, &y0, &refs, &mapping, c.k_split)?;
    if let Some(k) = c.k_split {
        anyhow::ensure!(plan.k_split == k, "{what}: planned split {}", plan.k_split);
    }
    let s = written_part(&s, &plan, &refs, &mapping)?;

    check_layer(&what, &x, &y0, &y, &s, (&plan.s_offsets, &plan.active), &refs, &mapping, &slot_list, c.w)
}

/// The segmented shrink's buffer with what the kernel does not write (a row's columns of a slice
/// past its adapter's rank there, left as the allocation had them) set to zero, as the
/// reference has them; every column it must write has to be a number.
fn written_part(
    s: &Tensor,
    plan: &SegmentedPlan,
    refs: &[&LoraSlots],
    mapping: &LoraMapping,
) -> anyhow::Result<Tensor> {
    let (splits, n, width) = s.dims3()?;
    let mut v = s.flatten_all()?.to_vec1::<f32>()?;
    let mut slot_of = vec![0; n];
    for seg in mapping.lora_segments() {
        let p = seg.start - mapping.num_base_rows();
        slot_of[p..p + seg.len].fill(seg.slot.index());
    }
    for (z, p) in (0..splits).flat_map(|z| (0..n).map(move |p| (z, p))) {
        let row = &mut v[(z * n + p) * width..][..width];
        for (i, sl) in refs.iter().enumerate() {
            let rank = sl.rank(slot_of[p]);
            let cols = &mut row[plan.s_offsets[i]..plan.s_offsets[i] + plan.active[i]];
            anyhow::ensure!(cols[..rank].iter().all(|x| !x.is_nan()), "split {z} row {p} slice {i}: unwritten");
            cols[rank..].fill(0.0);
        }
    }
    Ok(Tensor::from_vec(v, (splits, n, width), s.device())?)
}

/// What every emulated LoRA layer must show against the slow references: the shrink's partials
/// (`s`, summed in order; each slice at `s_offsets[i]`, `active[i]` wide) equal the reference's
/// in packed order, the expand's delta equals the reference's applied to the reference's own
/// shrink, and base rows, and the columns of slices a row's adapter does not target, are
/// bit-for-bit untouched.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_layer(
    what: &str,
    x: &Tensor,
    y0: &Tensor,
    y: &Tensor,
    s: &Tensor,
    (s_offsets, active): (&[usize], &[usize]),
    refs: &[&LoraSlots],
    mapping: &LoraMapping,
    slot_list: &[i32],
    w_dtype: DType,
) -> anyhow::Result<()> {
    let s_slow = lora_shrink_slow(x, refs, mapping)?;
    let index = mapping.lora_index().expect("lora rows");
    let summed = s.sum(0)?;
    let tol = if x.dtype() == DType::F32 && w_dtype == DType::F32 { 1e-5 } else { 2e-3 };
    for (i, slow) in s_slow.iter().enumerate() {
        let got = summed.narrow(1, s_offsets[i], active[i])?;
        let want = slow.index_select(index, 0)?.narrow(1, 0, active[i])?;
        let err = rel_err(&got, &want)?;
        anyhow::ensure!(err <= tol, "{what}: slice {i} shrink relative error {err:e}");
    }
    let y_slow = lora_expand_slow(y0, &s_slow, refs, mapping)?;
    let tol = if x.dtype() == DType::F32 { 1e-5 } else { 1e-2 };
    let err = rel_err(&(y - y0)?.to_dtype(DType::F32)?, &(&y_slow - y0)?.to_dtype(DType::F32)?)?;
    anyhow::ensure!(err <= tol, "{what}: expand relative error of the delta {err:e}");
    let total = y.dim(1)?;
    let (yb, bb) = (bits(y)?, bits(y0)?);
    for (row, &slot) in slot_list.iter().enumerate() {
        let (own, base) = (&yb[row * total..(row + 1) * total], &bb[row * total..(row + 1) * total]);
        if slot < 0 {
            anyhow::ensure!(own == base, "{what}: base row {row} changed");
        }
        let mut at = 0;
        for sl in refs {
            let w = sl.out_features();
            if slot >= 0 && sl.rank(slot as usize) == 0 {
                anyhow::ensure!(own[at..at + w] == base[at..at + w], "{what}: row {row} of an untargeted slice");
            }
            at += w;
        }
    }
    Ok(())
}

#[test]
fn emulated_kernels_match_the_slow_reference() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let mut rng = Rng::new(41);
    let (f32_, bf16, f16) = (DType::F32, DType::BF16, DType::F16);
    let case = |rows, inp, outs: &[usize], max_loras, max_rank, x, w, k_split| Case {
        rows,
        inp,
        outs: outs.to_vec(),
        max_loras,
        max_rank,
        x,
        w,
        k_split,
    };
    let cases = [
        // A qkv-like layer, three slices of different widths, in every dtype pair worth having.
        case(37, 96, &[64, 32, 32], 5, 16, f32_, f32_, None),
        case(37, 96, &[64, 32, 32], 5, 16, bf16, bf16, None),
        case(37, 96, &[64, 32, 32], 5, 16, f16, f16, None),
        case(21, 96, &[64, 32], 4, 16, bf16, f32_, None),
        case(21, 96, &[64, 32], 4, 16, f32_, bf16, None),
        case(21, 96, &[64, 32], 4, 16, f16, bf16, None),
        // K split in two (the second chunk short) and forced to one; ranks past one rank group.
        case(19, 1100, &[40], 3, 64, f32_, f32_, None),
        case(19, 1100, &[40], 3, 64, f32_, f32_, Some(1)),
        case(12, 1100, &[40, 24], 3, 24, bf16, bf16, Some(3)),
        // Odd widths past one column chunk (1024 per block), and a ragged input.
        case(9, 67, &[1500, 7], 3, 8, f32_, f32_, None),
        // More adapters than one launch takes: two launches of whole segments.
        case(90, 40, &[24], 70, 4, f32_, f32_, None),
        // One row.
        case(1, 64, &[16], 2, 8, bf16, bf16, None),
    ];
    for c in &cases {
        check(emu, &mut rng, c)?;
    }
    Ok(())
}

/// One decode-attention case over a paged cache of `num_blocks` scattered blocks: its dims, `q`
/// `[n, heads, head_dim]`, the caches, the block tables (`max_blocks` wide) and context lengths
/// (the longest `max_len`), and the gathered reference's output.
pub(super) struct PagedCase {
    pub(super) d: PagedDecodeDims,
    pub(super) q: Tensor,
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    pub(super) bt: Tensor,
    pub(super) cl: Tensor,
    pub(super) max_blocks: usize,
    pub(super) want: Tensor,
}

/// A [`PagedCase`] of `(sequences, heads, kv_heads, head_dim, block_size, dtype)`, on the CPU.
pub(super) fn paged_case(
    rng: &mut Rng,
    (n, heads, kv_heads, hd, bs, dtype): (usize, usize, usize, usize, usize, DType),
    num_blocks: usize,
    max_len: usize,
) -> anyhow::Result<PagedCase> {
    let dev = &Device::Cpu;
    let d = PagedDecodeDims { heads, kv_heads, head_dim: hd, block_size: bs };
    let (lens, tables, max_blocks) = rng.paged_contexts(n, bs, num_blocks, max_len);
    let q = rng.tensor(&[n, heads, hd], 0.5, dtype, dev)?;
    let k = rng.tensor(&[num_blocks * bs, kv_heads * hd], 1.0, dtype, dev)?;
    let v = rng.tensor(&[num_blocks * bs, kv_heads * hd], 1.0, dtype, dev)?;
    let bt = Tensor::from_vec(tables, (n, max_blocks), dev)?;
    let cl = Tensor::from_vec(lens, n, dev)?;
    let want = paged_decode_attention_slow(&q, &k, &v, &bt, &cl, d)?;
    Ok(PagedCase { d, q, k, v, bt, cl, max_blocks, want })
}

/// Decode attention over a paged cache whose blocks are scattered (the block table is a
/// permutation), with contexts of different lengths, GQA groups and several head sizes.
#[test]
fn emulated_paged_decode_matches_the_slow_reference() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let mut rng = Rng::new(5);
    // (sequences, heads, kv_heads, head_dim, block_size, dtype)
    let cases = [
        (3, 4, 2, 64, 16, DType::F32),
        (5, 8, 2, 128, 16, DType::F32),
        (2, 6, 6, 96, 4, DType::F32),
        (4, 4, 1, 128, 16, DType::BF16),
        (3, 2, 2, 32, 8, DType::F16),
        (1, 2, 1, 256, 16, DType::BF16),
    ];
    for (n, heads, kv_heads, hd, bs, dtype) in cases {
        let PagedCase { d, q, k, v, bt, cl, max_blocks, want } =
            paged_case(&mut rng, (n, heads, kv_heads, hd, bs, dtype), 24, 80)?;

        let (grid, block, mut p) = decode_params(n, max_blocks, d);
        let mut bufs = Buffers::default();
        p.q = bufs.add(tensor_bytes(&q)?);
        p.k_cache = bufs.add(tensor_bytes(&k)?);
        p.v_cache = bufs.add(tensor_bytes(&v)?);
        p.block_tables = bufs.add(tensor_bytes(&bt)?);
        p.ctx_lens = bufs.add(tensor_bytes(&cl)?);
        // NaN first, as the op allocates it unzeroed: the kernel must write every output.
        p.out = bufs.add(vec![0xff; n * heads * hd * dtype.size_in_bytes()]);
        let name = kernel::paged_decode(kernel_dtype(dtype)?, hd).expect("a supported head size");
        emu.launch(&name, grid, block, &p.to_bytes(), &mut bufs.0)?;
        let got = bytes_tensor(bufs.get(p.out), dtype, &[n, heads * hd])?;
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let err = rel_err(&got, &want)?;
        anyhow::ensure!(err <= tol, "n {n} heads {heads}/{kv_heads} d {hd} bs {bs} {dtype:?}: relative error {err:e}");
    }
    Ok(())
}
