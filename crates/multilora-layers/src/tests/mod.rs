//! In-crate tests: one body per check, run on the CPU and, with feature `cuda`, on the first GPU.
//! They live inside the crate so the device-generic op path can be checked on the CPU too.

mod attention_cpu;
mod emulated;
mod emulated_fast;
mod emulated_fused;
mod gemm;
mod layers;
mod ops;
mod quant;
mod quant_kernels;
mod swiglu;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{AdapterConfig, LoraAdapter, LoraModule, ModuleId};
use multilora_types::{Fingerprint, SlotId, SplitMix64};

use crate::LoraMapping;

/// `test_device!`, shared with the models' tests.
#[path = "../../../../tests/support/test_device.rs"]
mod test_device;
pub(crate) use test_device::test_device;

/// Seeded test data over the workspace's one generator, [`SplitMix64`].
pub(crate) struct Rng(SplitMix64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.0.below((hi - lo + 1) as u64) as usize
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        self.0.unit_f32()
    }

    pub(crate) fn tensor(&mut self, shape: &[usize], scale: f32, dtype: DType, dev: &Device) -> anyhow::Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.unit() * scale).collect();
        Ok(Tensor::from_vec(v, shape, dev)?.to_dtype(dtype)?)
    }

    /// Paged contexts for `n` sequences over `num_blocks` blocks of `bs` tokens: lengths (the
    /// first 1, the others in `2..=max_len`) and block tables `[n, max_blocks]` flattened, each
    /// sequence's blocks drawn without repetition from a shuffled pool (they may overlap between
    /// sequences, as shared prefix blocks do); returns `(lens, tables, max_blocks)`.
    pub(crate) fn paged_contexts(
        &mut self,
        n: usize,
        bs: usize,
        num_blocks: usize,
        max_len: usize,
    ) -> (Vec<u32>, Vec<u32>, usize) {
        let lens: Vec<u32> = (0..n).map(|i| if i == 0 { 1 } else { self.range(2, max_len) as u32 }).collect();
        let max_blocks = lens.iter().map(|&l| (l as usize).div_ceil(bs)).max().unwrap_or(1);
        let mut tables = Vec::with_capacity(n * max_blocks);
        for _ in 0..n {
            let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
            for i in (1..pool.len()).rev() {
                pool.swap(i, self.range(0, i));
            }
            tables.extend_from_slice(&pool[..max_blocks]);
        }
        (lens, tables, max_blocks)
    }

    /// A random slot list: each row -1 or a slot below `max_loras`.
    pub(crate) fn slots(&mut self, rows: usize, max_loras: usize) -> Vec<i32> {
        (0..rows).map(|_| self.range(0, max_loras) as i32 - 1).collect()
    }
}

/// The mapping of a slot list written compactly, `-1` for a base-model row (the tests' reference
/// computations index with these numbers).
pub(crate) fn slot_map(slots: &[i32], max_loras: usize, dev: &Device) -> crate::Result<LoraMapping> {
    let ids: Vec<Option<SlotId>> = slots.iter().map(|&s| usize::try_from(s).ok().map(SlotId::new)).collect();
    LoraMapping::new(&ids, max_loras, dev)
}

/// An in-memory adapter with random `(A, B)` for each `(module, rank, in, out)`, on the CPU in f32.
pub(crate) fn adapter(
    name: &str,
    modules: &[(ModuleId, usize, usize, usize)],
    seed: u64,
) -> anyhow::Result<LoraAdapter> {
    let mut rng = Rng::new(seed);
    let mut map = BTreeMap::new();
    for &(id, rank, i, o) in modules {
        let a = rng.tensor(&[rank, i], 0.3, DType::F32, &Device::Cpu)?;
        let b = rng.tensor(&[o, rank], 0.3, DType::F32, &Device::Cpu)?;
        map.insert(id, LoraModule::new(a, &b, rank, rank as f64, 1.0)?);
    }
    let config = AdapterConfig::parse(r#"{"target_modules": ["q_proj"]}"#).map_err(anyhow::Error::msg)?;
    Ok(LoraAdapter::new(name, config, map, Fingerprint([seed as u8; 32])))
}

/// ‖a − b‖ / ‖b‖ in f64 (0 when both are zero).
pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    anyhow::ensure!(a.len() == b.len(), "lengths differ: {} vs {}", a.len(), b.len());
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    Ok(if den == 0.0 { num } else { num / den })
}

/// The raw bits of a tensor's values, for bit-for-bit comparisons.
pub(crate) fn bits(t: &Tensor) -> anyhow::Result<Vec<u64>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().map(|v| v.to_bits() as u64).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().map(|v| v.to_bits() as u64).collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().map(|v| v.to_bits() as u64).collect(),
        _ => t.to_dtype(DType::F64)?.to_vec1::<f64>()?.iter().map(|v| v.to_bits()).collect(),
    })
}
