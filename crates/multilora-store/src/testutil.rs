//! Helpers for the in-file tests: small adapters built in memory, generations by number.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use multilora_adapter::{AdapterConfig, LoraAdapter, LoraModule, ModuleId};
use multilora_types::{AdapterGen, AdapterId, Fingerprint, ModuleKind};

/// Generation `fp` of adapter `id`.
pub(crate) fn generation(id: u64, fp: u8) -> AdapterGen {
    AdapterGen { id: AdapterId(id), fingerprint: Fingerprint([fp; 32]) }
}

/// A rank-`rank` adapter on q_proj of layer 0 with 8 inputs and 8 outputs, in float32:
/// `rank · 16 · 4` bytes.
pub(crate) fn adapter(name: &str, fp: u8, rank: usize) -> LoraAdapter {
    let config = AdapterConfig::parse(r#"{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}"#).unwrap();
    let a = Tensor::zeros((rank, 8), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::zeros((8, rank), DType::F32, &Device::Cpu).unwrap();
    let module = LoraModule::new(a, &b, rank, 8.0, 8.0 / rank as f64).unwrap();
    let modules = BTreeMap::from([(ModuleId::layer(0, ModuleKind::QProj), module)]);
    LoraAdapter::new(name, config, modules, Fingerprint([fp; 32]))
}
