//! CUDA kernels for multilora, in the spirit of Punica (arXiv 2310.18547) and S-LoRA's MBGMV:
//! the segmented LoRA shrink and expand every adapted linear runs (SGMV for prefill; with the
//! host plan's K split, the BGMV shape of decode), the embedding LoRA's gather, and paged decode
//! attention that reads the block table on the device.
//!
//! - `src/*.cu`: the kernels, one stem per op (`lora_shrink.cu`, `lora_expand.cu`, `lora_embed.cu`,
//!   `lora_bgmv.cu` for decode-shaped steps, `paged_attention.cu`, `paged_decode_split.cu` for long
//!   contexts and GQA, `kv_write.cu`), sharing `multilora.cuh`, `vec.cuh` (16-byte accesses) and
//!   the launch parameters of `params.h`;
//! - [`params`]: the `#[repr(C)]` mirrors of those parameters and the tile sizes the host plans
//!   with (the plan itself, which segments, tiles, grids and ranks, is computed in
//!   `multilora-layers` and `multilora-models`, in Rust, and tested on every machine);
//! - [`kernel`]: the entry-point names (`lora_shrink_bf16_f32`, `paged_decode_bf16_d128`, …);
//! - `fatbins` (feature `cuda`): the fatbin nvcc made of each `.cu` file (SASS for each
//!   architecture of `MULTILORA_CUDA_SASS`, default sm_80, sm_89, sm_90a, and compute_90 PTX),
//!   loaded by the host as machine code; [`fatbin`] reads what one holds;
//! - [`emulate`]: a host emulation that compiles the same `.cu` sources with the host C++
//!   compiler and runs a kernel on the CPU, so the kernels' logic is tested without a GPU.
//!
//! Without feature `cuda` nothing is compiled by nvcc and no CUDA toolkit is needed.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod emulate;
pub mod fatbin;
pub mod kernel;
pub mod params;

pub use emulate::{Emulator, Error, FaultKind, Memory};
pub use kernel::{KernelDtype, Module};

/// The fatbin of each `.cu` file, and the architectures they were built for (`build.rs`).
#[cfg(feature = "cuda")]
pub mod fatbins {
    include!(concat!(env!("OUT_DIR"), "/fatbin.rs"));
}
