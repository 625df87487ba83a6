//! multilora's CPU kernel library: slices in, slices out, no tensors.
//!
//! - [`isa`]: the one instruction-set enum ([`Isa`]), its detection and cap, and when a kernel is
//!   written once over a SIMD trait and when per set; every kernel takes an `Isa`.
//! - [`float`]: the f32 / bf16 / f16 family: products (streaming and packed, [`float::Packed`]),
//!   the LoRA segment products and the fused LoRA kernel, attention rows, exp / softmax / SiLU /
//!   GELU, RMS norm rows, the sampler's passes over a row of logits.
//! - [`quant`]: the GGML block-quantized family: [`quant::QuantType`], the weights' layout and
//!   huge-page arena, activation quantization and the integer tiles ([`quant::QuantMatrix`]).
//! - [`logits`]: the sampler's passes over a row of logits (maximum, argmax, softmax weights) on
//!   the best set, the same bits on every one.
//! - [`pool`]: the step's parallel regions on the rayon pool, the hot pool of a model step, and
//!   how many row groups a step of `n` rows is split into ([`pool::row_groups`]).
//! - [`host_memory`]: huge-page advice and read-only file maps.
//!
//! All CPU `unsafe` of the workspace lives in this crate: the vector kernels (`float`,
//! `quant::kernel`), the quantized weights' arena and the host memory calls; every block carries a
//! `// SAFETY:` comment, and every `#[target_feature]` function is reached only after
//! [`Isa::available`]. The layers crate wraps these kernels as candle ops; the CUDA side is
//! `multilora-kernels`.
//!
//! ```
//! use multilora_cpu::Isa;
//! use multilora_cpu::float::linear;
//! // y = x · Wᵀ for x: [2, 3] and W: [1, 3], on the widest set this CPU has.
//! let y = linear::<f32>(Isa::best(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[1.0, 0.0, 1.0], (2, 1, 3));
//! assert_eq!(y, vec![4.0, 10.0]);
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod error;
// The f32 / bf16 / f16 kernels: vector loads, `#[target_feature]` entry points, the output pointer.
#[allow(unsafe_code)]
pub mod float;
// `madvise` and file maps.
#[allow(unsafe_code)]
pub mod host_memory;
pub mod isa;
pub mod logits;
pub mod pool;
pub mod quant;

pub use error::{Error, Result};
pub use isa::Isa;

#[cfg(test)]
mod tests;
