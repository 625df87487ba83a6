//! The weight elements the kernels read (f32, bf16, f16) and how each is stored: plain data, no
//! `unsafe`; the vector loads that widen them are the instruction sets' (`FloatSimd::load_elem`).

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
}

/// `impl Elem` for a type, its kind and its exact widening.
macro_rules! elem {
    ($t:ty, $kind:ident, |$v:ident| $to_f32:expr) => {
        impl Elem for $t {
            const KIND: ElemKind = ElemKind::$kind;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                let $v = self;
                $to_f32
            }
        }
    };
}

elem!(f32, F32, |v| v);
// The high half of an f32: a shift the compiler vectorises.
elem!(bf16, Bf16, |v| f32::from_bits(u32::from(v.to_bits()) << 16));
elem!(f16, F16, |v| f16::to_f32(v));
