//! `linear`: `y = x · Wᵀ` on the CPU through `multilora_cpu::float`, the base matmul of every
//! [`crate::LoraLinear`] (and so of `lm_head`): the candle ops around the slice kernels, and
//! [`PackedWeight`], a weight packed once for them. `x` and `y` are f32; `W` is f32, bf16 or f16,
//! widened to f32 in registers as it is read (f32 accumulation). Anything other than a 2-D f32
//! input and a contiguous 2-D f32 / bf16 / f16 weight on the CPU goes through candle's matmul.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};
use multilora_cpu::Isa;
use multilora_cpu::float::{self, Elem, Packed};

use crate::error::Result;

/// A kernel element a candle CPU storage holds: f32, bf16 or f16.
pub(crate) trait StorageElem: Elem {
    /// The values of a CPU storage of this dtype.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
}

/// `impl StorageElem` for a type and its `CpuStorage` variant.
macro_rules! storage_elem {
    ($t:ty, $storage:ident) => {
        impl StorageElem for $t {
            fn slice(s: &CpuStorage) -> Option<&[$t]> {
                if let CpuStorage::$storage(v) = s { Some(v) } else { None }
            }
        }
    };
}

storage_elem!(f32, F32);
storage_elem!(bf16, BF16);
storage_elem!(f16, F16);

/// An error unless this CPU runs `isa`.
fn check_isa(isa: Isa) -> Result<()> {
    if isa.available() {
        return Ok(());
    }
    Err(multilora_cpu::Error::IsaUnavailable { op: "linear".into(), isa: isa.describe().into() }.into())
}

/// `x: [m, k]` · `weight: [n, k]`ᵀ → `[m, n]`, with the best kernel of this CPU.
pub fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    linear_with(x, weight, Isa::best())
}

/// [`linear`] with a chosen instruction set (for tests and benchmarks); an error when the CPU
/// lacks it.
pub fn linear_with(x: &Tensor, weight: &Tensor, isa: Isa) -> Result<Tensor> {
    check_isa(isa)?;
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

/// A weight `W: [n, k]` packed once for the CPU kernel ([`multilora_cpu::float::Packed`]): every
/// product with it, whatever the number of rows, runs as outer products and reads `W` as one
/// sequential stream. Layers hold their CPU weights this way instead of as a tensor: the same
/// bytes in the same dtype (f32, bf16 or f16), not a second copy. A row's result is bit for bit
/// the same whatever the other rows of the batch are.
#[derive(Clone)]
pub struct PackedWeight(Panels);

/// The packed values, in the weight's own dtype.
#[derive(Clone)]
enum Panels {
    F32(Packed<f32>),
    Bf16(Packed<bf16>),
    F16(Packed<f16>),
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, k) = self.dims();
        write!(f, "PackedWeight[{n}, {k}, {:?}]", self.dtype())
    }
}

/// The values of each contiguous CPU tensor of element `E`, in place.
fn values<'a, E: StorageElem, G: std::ops::Deref<Target = Storage>>(
    guards: &'a [(G, &Layout)],
) -> Option<Vec<&'a [E]>> {
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
            DType::F32 => values::<f32, _>(&guards).map(|v| Panels::F32(Packed::pack(&v, n, k))),
            DType::BF16 => values::<bf16, _>(&guards).map(|v| Panels::Bf16(Packed::pack(&v, n, k))),
            _ => values::<f16, _>(&guards).map(|v| Panels::F16(Packed::pack(&v, n, k))),
        };
        Ok(panels.map(PackedWeight))
    }

    /// `(n, k)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        match &self.0 {
            Panels::F32(p) => p.dims(),
            Panels::Bf16(p) => p.dims(),
            Panels::F16(p) => p.dims(),
        }
    }

    /// The dtype the weight is held (and read) in.
    pub fn dtype(&self) -> DType {
        match self.0 {
            Panels::F32(_) => DType::F32,
            Panels::Bf16(_) => DType::BF16,
            Panels::F16(_) => DType::F16,
        }
    }

    /// The weight as a `[n, k]` tensor of its dtype again (a copy).
    pub fn unpack(&self) -> Result<Tensor> {
        let (n, k) = self.dims();
        let dev = &candle_core::Device::Cpu;
        Ok(match &self.0 {
            Panels::F32(p) => Tensor::from_vec(p.unpack(), (n, k), dev)?,
            Panels::Bf16(p) => Tensor::from_vec(p.unpack(), (n, k), dev)?,
            Panels::F16(p) => Tensor::from_vec(p.unpack(), (n, k), dev)?,
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
        check_isa(isa)?;
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        Ok(x.apply_op1_no_bwd(&PackedOp { w: self, isa })?)
    }
}

/// The candle op around the pre-packed kernel: `x` contiguous f32 against a [`PackedWeight`].
struct PackedOp<'a> {
    w: &'a PackedWeight,
    isa: Isa,
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
        let y = match &self.w.0 {
            Panels::F32(p) => p.product(self.isa, x, m),
            Panels::Bf16(p) => p.product(self.isa, x, m),
            Panels::F16(p) => p.product(self.isa, x, m),
        };
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// The candle op around the kernel: lhs `x`, rhs `W`, both contiguous f32.
#[derive(Debug)]
struct LinearOp {
    isa: Isa,
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
        let (x, isa) = (&xs[x0..x1], self.isa);
        let y = match s2 {
            CpuStorage::F32(w) => float::linear(isa, x, &w[w0..w1], (m, n, k)),
            CpuStorage::BF16(w) => float::linear(isa, x, &w[w0..w1], (m, n, k)),
            CpuStorage::F16(w) => float::linear(isa, x, &w[w0..w1], (m, n, k)),
            other => candle_core::bail!("multilora-linear: an f32, bf16 or f16 weight only, got {:?}", other.dtype()),
        };
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}
