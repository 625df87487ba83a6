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
//! - `ptx` (feature `cuda`): the PTX nvcc made of each `.cu` file, for
//!   `CudaDevice::get_or_load_custom_func`;
//! - [`emulate`]: a host emulation that compiles the same `.cu` sources with the host C++
//!   compiler and runs a kernel on the CPU, so the kernels' logic is tested without a GPU.
//!
//! Without feature `cuda` nothing is compiled by nvcc and no CUDA toolkit is needed.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod emulate;
pub mod kernel;
pub mod params;

pub use emulate::{Emulator, Error, FaultKind, Memory};
pub use kernel::{KernelDtype, Module};

/// The PTX of each `.cu` file, as nvcc made it for `CUDA_COMPUTE_CAP` (default 90).
#[cfg(feature = "cuda")]
#[allow(missing_docs)]
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}
