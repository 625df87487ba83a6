//! The weight elements the kernels read (f32, bf16, f16) and how each is stored: plain data, no
//! `unsafe`; the vector loads that widen them are the instruction sets' (`Simd::load_elem`).

use candle_core::CpuStorage;
use half::{bf16, f16};

/// How an [`Elem`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemKind {
    /// f32.
    F32,
    /// bf16.
    Bf16,
    /// f16.
    F16,
}

/// A weight element the kernels read (f32, bf16 or f16): widened to f32 as it is loaded.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    /// How it is stored.
    const KIND: ElemKind;
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// The values of a CPU storage of this dtype.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
}

impl Elem for f32 {
    const KIND: ElemKind = ElemKind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn slice(s: &CpuStorage) -> Option<&[f32]> {
        if let CpuStorage::F32(v) = s { Some(v) } else { None }
    }
}

impl Elem for bf16 {
    const KIND: ElemKind = ElemKind::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    fn slice(s: &CpuStorage) -> Option<&[bf16]> {
        if let CpuStorage::BF16(v) = s { Some(v) } else { None }
    }
}

impl Elem for f16 {
    const KIND: ElemKind = ElemKind::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn slice(s: &CpuStorage) -> Option<&[f16]> {
        if let CpuStorage::F16(v) = s { Some(v) } else { None }
    }
}
