//! The LoRA ops: `shrink` (x · Aᵀ, to rank width) and `expand` (· Bᵀ, added into the output), in a
//! segmented form (SGMV: rows grouped by slot, one GEMM pair per adapter) and a slow gathered
//! form (BGMV: each row's A and B gathered by slot) that serves as the oracle; and
//! [`lora_apply`], the two as one layer's path.
//!
//! Each op is one type ([`shrink::Shrink`], [`expand::Expand`]) with its CPU and CUDA forwards
//! side by side (`cpu.rs`, `cuda.rs`), as a candle `CustomOp` has them; its operands are checked
//! once, when it is made (`check_input`, `check_output` here).

pub(crate) mod attention;
// The CUDA glue and the emulated kernel tests use the plan; a CPU build only tests it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod bgmv;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod expand;
pub(crate) mod fused;
pub(crate) mod gemm;
pub(crate) mod kv_write;
pub(crate) mod norm;
// The CUDA glue and the emulated kernel tests use the plan; a CPU build only tests it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod plan;
pub(crate) mod quant;
pub(crate) mod shrink;
pub(crate) mod slow;
pub(crate) mod swiglu;

use candle_core::{Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::mapping::LoraMapping;
use crate::ops::expand::Expand;
use crate::ops::shrink::Shrink;
use crate::slots::LoraSlots;

/// `y` plus every LoRA row's delta through `slices` (one layer's modules, their outputs side by
/// side in `y`'s columns): the path [`crate::LoraLinear::forward`] takes after the base product.
/// On the CPU the shrink and expand run fused per segment; on CUDA the shrink splits K as the
/// step needs and the expand sums the partials. `y`'s storage is updated in place where the
/// device allows, so pass a tensor nothing else reads (such as a fresh base output).
pub fn lora_apply(x: &Tensor, y: Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<Tensor> {
    if mapping.no_lora() {
        return Ok(y);
    }
    let shrink = Shrink::new("lora_apply", x, slices, mapping)?;
    if x.device().is_cpu() && y.is_contiguous() {
        Expand::fused(&shrink, "lora_apply", &y)?.cpu_fused_fwd(x, &y)?;
        return Ok(y);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return Expand::fused(&shrink, "lora_apply", &y)?.cuda_fused_fwd(&shrink, x, y);
    }
    let s = shrink.forward(x)?;
    Expand::after(&shrink, "lora_apply", &y, &s)?.forward(y, &s)
}

/// Checks `x: [rows, in]` against a mapping and the slices, and that all slices read the same input.
pub(crate) fn check_input(op: &str, x: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<()> {
    let (rows, width) = x.dims2().map_err(|_| Error::shape(op, "input", x.dims(), &[mapping.num_rows(), 0]))?;
    if rows != mapping.num_rows() {
        return Err(Error::RowMismatch { op: op.to_string(), input: rows, mapping: mapping.num_rows() });
    }
    for s in slices {
        if s.a_transposed() {
            return Err(Error::InvalidLayer {
                module: s.module().to_string(),
                reason: format!("{op} needs row-major A slots, not the embedding's"),
            });
        }
        if s.in_features() != width {
            return Err(Error::shape(s.module(), "input", x.dims(), &[rows, s.in_features()]));
        }
        check_slots(op, s, mapping)?;
    }
    Ok(())
}

/// Checks that the slots hold at least the slots the mapping names.
pub(crate) fn check_slots(op: &str, s: &LoraSlots, mapping: &LoraMapping) -> Result<()> {
    if s.max_loras() < mapping.max_loras() {
        return Err(Error::InvalidLayer {
            module: s.module().to_string(),
            reason: format!("{op}: {} slots, but the mapping was built for {}", s.max_loras(), mapping.max_loras()),
        });
    }
    Ok(())
}

/// Checks `y: [rows, Σ out]` against the slices and the mapping.
pub(crate) fn check_y(op: &str, y: &Tensor, slices: &[&LoraSlots], mapping: &LoraMapping) -> Result<()> {
    let total: usize = slices.iter().map(|s| s.out_features()).sum();
    let (rows, width) = y.dims2().map_err(|_| Error::shape(op, "output", y.dims(), &[mapping.num_rows(), total]))?;
    if rows != mapping.num_rows() {
        return Err(Error::RowMismatch { op: op.to_string(), input: rows, mapping: mapping.num_rows() });
    }
    if width != total {
        return Err(Error::shape(op, "output", y.dims(), &[rows, total]));
    }
    Ok(())
}

/// Checks `y: [rows, Σ out]` and the shrink outputs against the slices (and, with
/// `slot_counts`, that the slices hold the slots the mapping names: not again after a shrink's
/// check).
pub(crate) fn check_output(
    op: &str,
    y: &Tensor,
    s: &[Tensor],
    slices: &[&LoraSlots],
    mapping: &LoraMapping,
    packed: bool,
    slot_counts: bool,
) -> Result<()> {
    check_y(op, y, slices, mapping)?;
    let rows = mapping.num_rows();
    if s.len() != slices.len() {
        return Err(Error::InvalidLayer {
            module: op.to_string(),
            reason: format!("{} shrink outputs for {} slices", s.len(), slices.len()),
        });
    }
    let want_rows = if packed { mapping.num_lora_rows() } else { rows };
    for (t, sl) in s.iter().zip(slices) {
        if slot_counts {
            check_slots(op, sl, mapping)?;
        }
        let (r, w) = t.dims2().map_err(|_| Error::shape(sl.module(), "shrink output", t.dims(), &[want_rows, 0]))?;
        let need = if packed { sl.active_rank(mapping) } else { sl.max_rank() };
        if r != want_rows || w < need {
            return Err(Error::shape(sl.module(), "shrink output", t.dims(), &[want_rows, need]));
        }
    }
    Ok(())
}

/// The contiguous values of a CPU tensor of element `E` from its layout's start, if it is one.
pub(crate) fn cpu_values<'a, E: gemm::StorageElem>(storage: &'a Storage, layout: &Layout) -> Option<&'a [E]> {
    match storage {
        Storage::Cpu(cpu) if layout.is_contiguous() => E::slice(cpu)?.get(layout.start_offset()..),
        _ => None,
    }
}

/// Below this many multiply-adds in one op call, threads cost more than they save.
pub(crate) const PARALLEL_WORK: usize = 1 << 18;

/// An element-wise pass (norm, activation, rotation) over at least this many values is split
/// across the pool: inside a step's kept-awake pool ([`crate::with_hot_pool`]) a region costs well
/// under a microsecond, a pass over 4096 values one or two. Run alone on the step's thread, the
/// three passes of a 16-row SmolLM2 layer left the other core waiting ~0.8 ms a step.
pub(crate) const PARALLEL_VALUES: usize = 1 << 12;

/// Runs `f` over `tasks`, on the rayon pool when `work` (multiply-adds in all) pays for it.
pub(crate) fn run_tasks<T: Sync, R: Send>(
    tasks: &[T],
    work: usize,
    f: impl Fn(&T) -> Result<R> + Sync + Send,
) -> Result<Vec<R>> {
    if work < PARALLEL_WORK || tasks.len() < 2 {
        return tasks.iter().map(f).collect();
    }
    tasks.par_iter().map(f).collect()
}
