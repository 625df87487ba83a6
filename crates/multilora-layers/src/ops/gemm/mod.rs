//! `linear`: `y = x · Wᵀ` on the CPU with the crate's own kernels, the base matmul of every
//! [`crate::LoraLinear`] (and so of `lm_head`), and the LoRA segment products. `x` and `y` are
//! f32; `W` is f32, bf16 or f16, widened to f32 in registers as it is read, so a half-precision
//! weight costs half the bytes of memory traffic and is multiplied exactly as its f32 value
//! would be (f32 accumulation).
//!
//! ```text
//! y[i, j] = Σ_k x[i, k] · W[j, k]        x: [m, k], W: [n, k] (PyTorch's [out, in]), y: [m, n]
//! ```
//!
//! Up to `DECODE_ROWS` (64) rows (a decode step, bound by reading `W` from memory), both operands are
//! read in place, rows contiguous along `k`, in register tiles of `RM × RN` vector accumulators
//! (llama.cpp's tinyBLAS); `W` is read once, one tile of its rows at a time through all rows of
//! `x`. Above it (prefill, compute-bound), panels of `W` are packed `k`-major and multiplied as
//! outer products, with no horizontal sums. Either way the output is cut into rectangles that run
//! on the rayon pool ([`kernel`]). The instruction set is picked at run time: AVX-512F, else
//! AVX2 + FMA, else a portable path the compiler vectorises (streaming only).
//!
//! Anything other than a 2-D f32 input and a contiguous 2-D f32 / bf16 / f16 weight on the CPU
//! goes through candle's matmul instead.

// The one module of the crate allowed `unsafe`: vector loads and the shared output pointer.
#[allow(unsafe_code)]
mod kernel;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result};
use kernel::Rect;
pub use kernel::{Elem, ElemKind};
pub(crate) use kernel::{
    Head, NORM_ROWS, argmax, attend, attend_supports, exp_weights, gelu_tanh_mul, rms_rows, row_max, silu_mul, softmax,
};
#[cfg(test)]
pub(crate) use kernel::{exp, exp_sum};

/// Which vector instructions the CPU linear kernel uses, declared narrowest first (the order
/// [`Isa::set_max`]'s cap compares them in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isa {
    /// Plain Rust, vectorised by the compiler for the build target.
    Portable,
    /// x86-64 AVX2, FMA and F16C, 8 lanes, 4 × 3 tiles.
    Avx2,
    /// x86-64 AVX-512F, 16 lanes, 4 × 6 tiles.
    Avx512,
}

/// The widest instruction set [`Isa::best`] and [`crate::QuantIsa::best`] pick
/// ([`Isa::set_max`]), as an `Isa` in the enum's order (AVX-512, the default, caps nothing).
static MAX_ISA: AtomicU8 = AtomicU8::new(Isa::Avx512 as u8);

impl Isa {
    /// The fastest instruction set this CPU has, within [`Isa::set_max`]'s cap.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2].into_iter().find(|&i| i.available() && i.allowed()).unwrap_or(Isa::Portable)
    }

    /// Caps the instruction sets the kernels pick from here on, for this process: every CPU
    /// kernel's `best` (the f32 / bf16 products, the LoRA, norm and attention kernels, and the
    /// quantized products, whose AVX-VNNI and AVX-512 VNNI kernels only `Avx512`, no cap, lets
    /// through), e.g. to measure on an AVX-512 machine what an AVX2-only CPU such as Zen 3 runs
    /// (as PyTorch's `ATEN_CPU_CAPABILITY`). Kernels called with an explicit set (tests,
    /// benchmarks) are not affected.
    pub fn set_max(max: Isa) {
        MAX_ISA.store(max as u8, Ordering::Relaxed);
    }

    /// The cap [`Isa::set_max`] set.
    pub fn max() -> Isa {
        [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().rfind(|i| i.allowed()).unwrap_or(Isa::Portable)
    }

    /// Whether the cap lets kernels pick `self` (the variants are declared narrowest first).
    pub(crate) fn allowed(self) -> bool {
        self as u8 <= MAX_ISA.load(Ordering::Relaxed)
    }

    /// Whether this CPU can run it.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU can run, the portable one first.
    pub fn all_available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()).collect()
    }
}

/// `x: [m, k]` · `weight: [n, k]`ᵀ → `[m, n]`, with the best kernel of this CPU.
pub fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    linear_with(x, weight, Isa::best())
}

/// [`linear`] with a chosen instruction set (for tests and benchmarks); an error when the CPU
/// lacks it.
pub fn linear_with(x: &Tensor, weight: &Tensor, isa: Isa) -> Result<Tensor> {
    if !isa.available() {
        return Err(Error::InvalidLayer {
            module: "linear".to_string(),
            reason: format!("this cpu cannot run {isa:?}"),
        });
    }
    let fast = x.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(weight.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && x.rank() == 2
        && weight.rank() == 2
        && weight.is_contiguous();
    if !fast {
        return Ok(x.matmul(&weight.t()?)?);
    }
    Ok(x.contiguous()?.apply_op2_no_bwd(weight, &LinearOp { isa })?)
}

/// `y[i·ldy + j] = Σ_{p<k} x[i·ldx + p] · w[j·ldw + p]` for `i < m`, `j < n`, on this thread with
/// the streaming kernel, whatever `m` (so a row's result does not depend on its segment's size):
/// the LoRA shrink `x · Aᵀ` of a segment, segments side by side on the pool.
///
/// # Panics
/// When a row reaches outside its slice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_t_into<E: Elem>(
    x: &[f32],
    ldx: usize,
    w: &[E],
    ldw: usize,
    mnk: (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
) {
    matmul_t_into_with(Isa::best(), x, ldx, w, ldw, mnk, y, ldy);
}

/// [`matmul_t_into`] on a chosen instruction set (portable if the CPU lacks it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_t_into_with<E: Elem>(
    isa: Isa,
    x: &[f32],
    ldx: usize,
    w: &[E],
    ldw: usize,
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
) {
    let o = kernel::Operands { x, ldx, w, ldw, k };
    kernel::fill(isa, o, y, ldy, &[Rect { m0: 0, m1: m, n0: 0, n1: n }], 1, false, false);
}

/// A weight `W: [n, k]` packed once for the CPU kernel: panels of 32 output columns, each stored
/// `k`-major, so that every product with it, whatever the number of rows, runs as outer products
/// (no horizontal sums, nothing packed during a step) and reads `W` as one sequential stream.
/// Layers hold their CPU weights this way instead of as a tensor: the same bytes in the same
/// dtype (f32, bf16 or f16; plus the zero padding of the last panel), not a second copy.
///
/// Each output is one chain of f32 FMAs over `k` in order, so a row's result is bit for bit the
/// same whatever the other rows of the batch are: batch invariance holds across decode and
/// prefill, in every dtype.
#[derive(Clone)]
pub struct PackedWeight {
    panels: Panels,
    n: usize,
    k: usize,
}

/// The packed values, in the weight's own dtype.
#[derive(Clone)]
enum Panels {
    F32(Arc<Vec<f32>>),
    Bf16(Arc<Vec<bf16>>),
    F16(Arc<Vec<f16>>),
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedWeight[{}, {}, {:?}]", self.n, self.k, self.dtype())
    }
}

/// Packs the rows of `parts` (one weight `[n, k]` cut along its rows: `[n_i, k]` each, in order)
/// into panels of `PANEL` columns, `k`-major, zero past `n`; the parts are read in place.
fn pack_panels<E: Elem>(parts: &[&[E]], k: usize) -> Arc<Vec<E>> {
    let n: usize = parts.iter().map(|p| p.len() / k.max(1)).sum();
    let row = |mut j: usize| -> &[E] {
        for p in parts {
            let rows = p.len() / k.max(1);
            if j < rows {
                return &p[j * k..][..k];
            }
            j -= rows;
        }
        &[]
    };
    let mut panels = vec![E::default(); n.div_ceil(kernel::PANEL) * k * kernel::PANEL];
    panels.par_chunks_mut((k * kernel::PANEL).max(1)).enumerate().for_each(|(p, dst)| {
        let j0 = p * kernel::PANEL;
        for c in 0..kernel::PANEL.min(n.saturating_sub(j0)) {
            for (d, &v) in dst[c..].iter_mut().step_by(kernel::PANEL).zip(row(j0 + c)) {
                *d = v;
            }
        }
    });
    Arc::new(panels)
}

/// The `[n, k]` rows of panels packed by [`pack_panels`].
fn unpack_panels<E: Elem>(panels: &[E], n: usize, k: usize) -> Vec<E> {
    let mut w = vec![E::default(); n * k];
    w.par_chunks_mut(k.max(1)).enumerate().for_each(|(j, row)| {
        let panel = &panels[(j / kernel::PANEL) * k * kernel::PANEL..];
        for (d, &v) in row.iter_mut().zip(panel[j % kernel::PANEL..].iter().step_by(kernel::PANEL)) {
            *d = v;
        }
    });
    w
}

/// The values of each contiguous CPU tensor of element `E`, in place.
fn values<'a, E: Elem, G: std::ops::Deref<Target = Storage>>(guards: &'a [(G, &Layout)]) -> Option<Vec<&'a [E]>> {
    guards
        .iter()
        .map(|(s, l)| {
            let Storage::Cpu(cpu) = &**s else { return None };
            E::slice(cpu)?.get(l.start_offset()..l.start_offset() + l.shape().elem_count())
        })
        .collect()
}

impl PackedWeight {
    /// Packs a 2-D f32, bf16 or f16 weight on the CPU, keeping its dtype; `None` for any other
    /// dtype, rank or device (those run through candle's matmul).
    pub fn pack(w: &Tensor) -> Result<Option<PackedWeight>> {
        PackedWeight::pack_parts(std::slice::from_ref(w))
    }

    /// Packs the weight whose rows are those of `parts` in order (e.g. q, k and v of a fused
    /// projection), read in place: no concatenated copy is made. `None` unless every part is a
    /// 2-D CPU tensor of one dtype among f32, bf16 and f16 with the same number of columns.
    pub fn pack_parts(parts: &[Tensor]) -> Result<Option<PackedWeight>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let dt = first.dtype();
        let k = if first.rank() == 2 { first.dim(1)? } else { return Ok(None) };
        let fits = |w: &Tensor| w.device().is_cpu() && w.dtype() == dt && w.rank() == 2 && w.dim(1).ok() == Some(k);
        if !matches!(dt, DType::F32 | DType::BF16 | DType::F16) || !parts.iter().all(fits) {
            return Ok(None);
        }
        let n = parts.iter().map(|w| w.dim(0)).sum::<candle_core::Result<usize>>()?;
        let parts = parts.iter().map(|w| w.contiguous()).collect::<candle_core::Result<Vec<_>>>()?;
        let guards: Vec<_> = parts.iter().map(|w| w.storage_and_layout()).collect();
        let panels = match dt {
            DType::F32 => values::<f32, _>(&guards).map(|v| Panels::F32(pack_panels(&v, k))),
            DType::BF16 => values::<bf16, _>(&guards).map(|v| Panels::Bf16(pack_panels(&v, k))),
            _ => values::<f16, _>(&guards).map(|v| Panels::F16(pack_panels(&v, k))),
        };
        Ok(panels.map(|panels| PackedWeight { panels, n, k }))
    }

    /// `(n, k)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The dtype the weight is held (and read) in.
    pub fn dtype(&self) -> DType {
        match self.panels {
            Panels::F32(_) => DType::F32,
            Panels::Bf16(_) => DType::BF16,
            Panels::F16(_) => DType::F16,
        }
    }

    /// The weight as a `[n, k]` tensor of its dtype again (a copy).
    pub fn unpack(&self) -> Result<Tensor> {
        let (n, k, dev) = (self.n, self.k, &candle_core::Device::Cpu);
        Ok(match &self.panels {
            Panels::F32(p) => Tensor::from_vec(unpack_panels(p, n, k), (n, k), dev)?,
            Panels::Bf16(p) => Tensor::from_vec(unpack_panels(p, n, k), (n, k), dev)?,
            Panels::F16(p) => Tensor::from_vec(unpack_panels(p, n, k), (n, k), dev)?,
        })
    }

    /// `x: [m, k]` · `Wᵀ` → `[m, n]` f32 with the best kernel of this CPU; `x` is made contiguous
    /// f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Isa::best())
    }

    /// [`PackedWeight::forward`] with a chosen instruction set (for tests and benchmarks); an
    /// error when the CPU lacks it.
    pub fn forward_with(&self, x: &Tensor, isa: Isa) -> Result<Tensor> {
        if !isa.available() {
            return Err(Error::InvalidLayer {
                module: "linear".to_string(),
                reason: format!("this cpu cannot run {isa:?}"),
            });
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        Ok(x.apply_op1_no_bwd(&PackedOp { w: self, isa })?)
    }
}

/// The candle op around the pre-packed kernel: `x` contiguous f32 against a [`PackedWeight`].
struct PackedOp<'a> {
    w: &'a PackedWeight,
    isa: Isa,
}

impl PackedOp<'_> {
    fn run<E: Elem>(&self, x: &[f32], panels: &[E], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        let plan = Plan::new(m, n, k, crate::pool::threads(), true, kernel::PANEL);
        kernel::fill_prepacked(self.isa, (x, k), (panels, n, k), &mut y, n, &plan.rects, plan.parallel);
        y
    }
}

impl CustomOp1 for PackedOp<'_> {
    fn name(&self) -> &'static str {
        "multilora-linear-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(xs) = s else {
            candle_core::bail!("multilora-linear: f32 input only, got {:?}", s.dtype());
        };
        let (m, k) = l.shape().dims2()?;
        let (n, kw) = self.w.dims();
        if k != kw {
            candle_core::bail!("multilora-linear: x is [{m}, {k}] but the weight is [{n}, {kw}]");
        }
        let Some((x0, x1)) = l.contiguous_offsets() else {
            candle_core::bail!("multilora-linear: the input must be contiguous");
        };
        let x = &xs[x0..x1];
        let y = match &self.w.panels {
            Panels::F32(p) => self.run(x, p, (m, n, k)),
            Panels::Bf16(p) => self.run(x, p, (m, n, k)),
            Panels::F16(p) => self.run(x, p, (m, n, k)),
        };
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// `y[i·ldy + j] = Σ_{p<k} x[i·ldx + p] · wt[p·ldw + j]` for `i < m`, `j < n`, on this thread:
/// `wt` is stored `k`-major (`[k, n]`), as a LoRA slot's `Bᵀ` is, so the product is a sum of
/// outer products with no horizontal sums (the LoRA expand). With `accumulate`, the products are
/// added into `y`: each output's chain of FMAs starts from its value there (a product cut along
/// `k` into runs is the same chain as one uncut).
///
/// # Panics
/// When a row reaches outside its slice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_into<E: Elem>(
    x: &[f32],
    ldx: usize,
    wt: &[E],
    ldw: usize,
    mnk: (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    matmul_into_with(Isa::best(), x, ldx, wt, ldw, mnk, y, ldy, accumulate);
}

/// [`matmul_into`] on a chosen instruction set (portable if the CPU lacks it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_into_with<E: Elem>(
    isa: Isa,
    x: &[f32],
    ldx: usize,
    wt: &[E],
    ldw: usize,
    mnk: (usize, usize, usize),
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    kernel::outer(isa, (x, ldx), (wt, ldw), mnk, y, ldy, accumulate);
}

/// Rows a [`lora_rows`] call takes at most.
pub(crate) const LORA_ROWS: usize = kernel::LORA_ROWS;

/// `ys[i] += (xs[i] · Aᵀ) · Bᵀ` for up to [`LORA_ROWS`] rows through one adapter's slot (`a`:
/// `[rank, k]`, `bt`: `[rank, out]`, `k` and `out` the rows' lengths), on `isa` (portable if the
/// CPU lacks it) with `scratch` of at least `rows · rank` values: bit for bit what
/// [`matmul_t_into_with`] then [`matmul_into_with`] and an add give on the same `isa`, reading
/// each operand once, in order.
pub(crate) fn lora_rows<E: Elem>(
    isa: Isa,
    xs: &[&[f32]],
    (a, bt, rank): (&[E], &[E], usize),
    ys: &mut [&mut [f32]],
    scratch: &mut [f32],
) {
    kernel::lora_rows(isa, xs, kernel::Slot { a, bt, rank }, ys, scratch);
}

/// The candle op around the kernel: lhs `x`, rhs `W`, both contiguous f32.
#[derive(Debug)]
struct LinearOp {
    isa: Isa,
}

impl LinearOp {
    fn run<E: Elem>(&self, x: &[f32], w: &[E], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        let threads = crate::pool::threads();
        let packed = m > DECODE_ROWS && self.isa != Isa::Portable;
        let plan = Plan::new(m, n, k, threads, packed, COL_ALIGN);
        let o = kernel::Operands { x, ldx: k, w, ldw: k, k };
        kernel::fill(self.isa, o, &mut y, n, &plan.rects, plan.panel, plan.parallel, packed);
        y
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "multilora-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(xs) = s1 else {
            candle_core::bail!("multilora-linear: f32 input only, got {:?}", s1.dtype());
        };
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("multilora-linear: x is [{m}, {k}] but the weight is [{n}, {k2}]");
        }
        let (Some((x0, x1)), Some((w0, w1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("multilora-linear: operands must be contiguous");
        };
        let x = &xs[x0..x1];
        let y = match s2 {
            CpuStorage::F32(w) => self.run(x, &w[w0..w1], (m, n, k)),
            CpuStorage::BF16(w) => self.run(x, &w[w0..w1], (m, n, k)),
            CpuStorage::F16(w) => self.run(x, &w[w0..w1], (m, n, k)),
            other => candle_core::bail!("multilora-linear: an f32, bf16 or f16 weight only, got {:?}", other.dtype()),
        };
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// How one product is cut into rectangles of the output.
#[derive(Debug)]
struct Plan {
    rects: Vec<Rect>,
    /// Rows of `W` a rectangle works through at a time (about 256 KiB of them, so they stay in L2).
    panel: usize,
    parallel: bool,
}

/// Up to this many rows (decode steps) the product streams `W` in place; above it (prefill),
/// panels of `W` are packed and multiplied as outer products.
const DECODE_ROWS: usize = 64;

/// Below this many multiply-adds, threads cost more than they save.
const PARALLEL_WORK: usize = 1 << 20;

/// Bytes of `x` one rectangle's rows may take, so they stay in L2 while `W` streams past.
const X_BLOCK_BYTES: usize = 1 << 20;

/// Bytes of `W` in one panel.
const PANEL_BYTES: usize = 256 << 10;

/// Columns of a rectangle are a multiple of this (a multiple of every tile width).
const COL_ALIGN: usize = 96;

impl Plan {
    /// `align`: rectangles start on multiples of it (the tile widths, or the packed panels).
    fn new(m: usize, n: usize, k: usize, threads: usize, packed: bool, align: usize) -> Plan {
        let row_bytes = 4 * k.max(1);
        let parallel = threads > 1 && m * n * k >= PARALLEL_WORK;
        // Small batches (decode) keep all rows in one block, so `W` is read from memory once;
        // so does the packed kernel, which packs each panel of `W` once (cutting the rows into
        // L2-sized blocks instead, with each panel packed and read once per block, measured
        // slower: `W` then comes from memory several times); large unpacked ones (the portable
        // path) cut rows into blocks of `x` that fit in L2, in whole tiles.
        let mb = if m <= DECODE_ROWS || packed { m.max(1) } else { (X_BLOCK_BYTES / row_bytes).clamp(16, m) / 4 * 4 };
        let m_blocks = m.div_ceil(mb).max(1);
        // Several rectangles per thread, so a thread slowed by another process is caught up on.
        let wanted = if parallel { threads * 8 } else { 1 };
        let n_chunks = wanted.div_ceil(m_blocks).clamp(1, n.div_ceil(2 * align).max(1));
        let nc = n.div_ceil(n_chunks).div_ceil(align) * align;
        let mut rects = Vec::new();
        for m0 in (0..m).step_by(mb) {
            for n0 in (0..n).step_by(nc.max(1)) {
                rects.push(Rect { m0, m1: (m0 + mb).min(m), n0, n1: (n0 + nc).min(n) });
            }
        }
        // A decode step takes one tile of `W` rows at a time through all its rows, so each
        // row of `W` is read from memory once and the stream never pauses for a second pass.
        let panel = if m <= DECODE_ROWS { 1 } else { (PANEL_BYTES / row_bytes).max(COL_ALIGN) / COL_ALIGN * COL_ALIGN };
        Plan { rects, panel, parallel }
    }
}
