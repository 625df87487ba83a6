//! LoRA-aware layers for multilora: one batch, many adapters, one pass over the shared base weight.
//!
//! Every adapted linear computes `y = x · Wᵀ` for all rows, then adds each row's own
//! `B_k · A_k · x`, with `k` the row's slot (none = base model: the row keeps the base output bit
//! for bit). Rows are grouped by slot once per step in a [`LoraMapping`], shared by every layer, and
//! each layer runs one small GEMM pair per adapter at its true rank ([`lora_shrink`] /
//! [`lora_expand`], Punica's SGMV); [`lora_shrink_slow`] / [`lora_expand_slow`] gather each row's
//! matrices instead (BGMV) and are the oracle the segmented ops are tested against.
//!
//! Each op is a candle op over `multilora-cpu`'s kernels (`cpu.rs`) and `multilora-kernels`' (`cuda.rs`).
//!
//! - [`LoraSlots`]: the stacked `A[max_loras, max_rank, in]` and `Bᵀ[max_loras, max_rank, out]` of
//!   one module and the real rank of each slot; [`SlotConfig`] says how many, how big, where;
//! - [`PackedWeight`]: an f32 / bf16 / f16 base weight packed once for the CPU kernel, which
//!   every layer's base product runs on, whatever the batch size;
//! - [`QuantWeight`]: a GGUF (GGML block-quantized) base weight kept quantized
//!   (`multilora_cpu::quant::QuantMatrix`), multiplied by integer dot products against
//!   activations quantized to about 16 bits, whatever the batch size;
//! - [`LoraLinear`]: a plain or fused (qkv, gate_up) linear with one set of slots per module, and
//!   `merge` / `unmerge` for a deployment dominated by one adapter; `lm_head` is a `LoraLinear` too,
//!   driven by a mapping over logit rows;
//! - [`LoraEmbedding`]: the input embedding with PEFT's `lora_embedding_A/B`;
//! - [`ReadAhead`] / [`HostRows`]: what a step reads next (LoRA slots, KV rows), handed to a
//!   quantized product that asks for it to be cached while it computes;
//! - [`RowsToHost`]: a step's logits back to the host (through a kept page-locked buffer on CUDA);
//! - [`StepMeta`] / [`MetaToDevice`]: a step's small integer tables (ids, positions, cache rows,
//!   block tables, the mappings' indexes) to the device in one copy (page-locked on CUDA).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use multilora_adapter::ModuleId;
//! use multilora_layers::{LoraLinear, LoraMapping, SlotConfig};
//! use multilora_types::{ModuleKind, SlotId};
//! # fn main() -> multilora_layers::Result<()> {
//! let dev = Device::Cpu;
//! let cfg = SlotConfig::new(4, 16, DType::F32, &dev);
//! let w = Tensor::randn(0f32, 1.0, (64, 32), &dev)?;
//! let q = ModuleId::layer(0, ModuleKind::QProj);
//! let layer = LoraLinear::new(w, None, vec![(q, 64)], Some(&cfg))?;
//! // Six rows: slots 2 and 0, a base-model row (no slot), slots 2, 3 and 0.
//! let s = |i| Some(SlotId::new(i));
//! let slots = [s(2), s(0), None, s(2), s(3), s(0)];
//! let mapping = LoraMapping::new(&slots, cfg.max_loras, &dev)?;
//! let x = Tensor::randn(0f32, 1.0, (6, 32), &dev)?;
//! assert_eq!(layer.forward(&x, &mapping)?.dims(), &[6, 64]);
//! # Ok(()) }
//! ```
// Denied but in the CUDA glue (`ops::cuda`, `upload`, `readback`, with feature `cuda`): all CPU
// `unsafe` lives in `multilora-cpu`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod ahead;
mod embedding;
mod error;
mod linear;
mod mapping;
mod ops;
mod readback;
mod slots;
mod staging;
mod upload;
mod zeros;

pub use ahead::{HostRows, ReadAhead};
pub use embedding::LoraEmbedding;
pub use error::{Error, Result};
pub use linear::{LinearWeight, LoraLinear};
pub use mapping::{LoraMapping, PendingMapping, Segment};
pub use ops::attention::cpu::{CausalSpan, decode_attention_rows, prefill_attention_rows};
pub use ops::attention::{PagedDecodeDims, paged_decode_attention, paged_decode_attention_slow};
pub use ops::bgmv::{lora_bgmv_expand, lora_bgmv_shrink};
#[cfg(feature = "cuda")]
pub use ops::cuda::{ModuleLoad, kernel_fatbins, load_kernel_modules, prepare_cuda_device};
pub use ops::expand::lora_expand;
pub use ops::fused::{GreedyPick, greedy_rows, rope_kv_write};
pub use ops::gemm::{PackedWeight, linear, linear_with};
pub use ops::kv_write::cpu::{rope_write_kv, write_kv_rows};
pub use ops::kv_write::{paged_kv_write, paged_kv_write_slow};
pub use ops::lora_apply;
pub use ops::norm::{add_rms_norm, rms_norm};
pub use ops::quant::{QuantWeight, ggml_dtype, quant_type};
pub use ops::shrink::lora_shrink;
pub use ops::slow::{lora_expand_slow, lora_shrink_slow};
pub use ops::swiglu::{gelu_tanh_mul, silu_mul};
pub use readback::RowsToHost;
pub use slots::{LoraSlots, SlotConfig};
pub use staging::stage as stage_adapter;
pub use upload::{MetaPart, MetaToDevice, StepMeta, Uploaded};
pub use zeros::{huge_zeros, lazy_zeros};

#[cfg(test)]
mod tests;
