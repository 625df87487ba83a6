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
        let key = if id.kind == multilora_types::ModuleKind::EmbedTokens {
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
    let id = ModuleId::layer(0, multilora_types::ModuleKind::KProj);
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

/// A PEFT adapter written as llama.cpp's converter writes it and read back: the same modules,
/// ranks and scales, and the same `A` and scaled `Bᵀ` (the q / k rows permuted for ggml's RoPE on
/// the way out and put back on the way in); an rsLoRA adapter, which llama.cpp's files cannot
/// express, is refused.
#[test]
fn a_gguf_lora_file_round_trips_its_peft_adapter() {
    let shapes = base_shapes();
    let opts = LoadOptions::default().max_lora_rank(32);
    let dir = tempfile::tempdir().unwrap();
    for rel in ["adapters/qv_r8", "adapters/all_r16"] {
        let peft = load_dir("p", &fixtures().join(rel), &shapes, &opts).unwrap();
        let path = dir.path().join("a.gguf");
        multilora_adapter::write_gguf_lora(&peft, &shapes, &path).unwrap();
        let gguf = multilora_adapter::load_gguf_lora("g", &path, &shapes, &opts).unwrap();
        assert_eq!(peft.modules().keys().collect::<Vec<_>>(), gguf.modules().keys().collect::<Vec<_>>(), "{rel}");
        for (id, p) in peft.modules() {
            let g = &gguf.modules()[id];
            assert_eq!((p.rank, p.alpha, p.scaling), (g.rank, g.alpha, g.scaling), "{rel} {id}");
            for (x, y, what) in [(&p.a, &g.a, "a"), (&p.b_t, &g.b_t, "b_t")] {
                let d = (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let scale = x.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d <= 1e-6 * scale.max(1.0), "{rel} {id} {what}: differs by {d}");
            }
        }
    }
    let rslora = load_dir("r", &fixtures().join("adapters/rslora_r4"), &shapes, &opts).unwrap();
    let err = multilora_adapter::write_gguf_lora(&rslora, &shapes, &dir.path().join("r.gguf")).unwrap_err();
    assert!(err.to_string().contains("alpha / rank"), "{err}");
}

/// What a llama.cpp LoRA file must be: an adapter (a base model's GGUF is refused as such), of the
/// served architecture, with tensors that fit the base.
#[test]
fn gguf_lora_files_that_do_not_fit_are_refused() {
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
    let shapes = base_shapes();
    let opts = LoadOptions::default().max_lora_rank(32);
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, meta: &[(&str, gguf_file::Value)], tensors: &[(&str, (usize, usize))]| {
        let qs: Vec<(String, QTensor)> = tensors
            .iter()
            .map(|(n, s)| {
                (
                    n.to_string(),
                    QTensor::quantize(
                        &candle_core::Tensor::zeros(*s, DType::F32, &Device::Cpu).unwrap(),
                        GgmlDType::F32,
                    )
                    .unwrap(),
                )
            })
            .collect();
        let refs: Vec<(&str, &QTensor)> = qs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let path = dir.path().join(name);
        gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &meta, &refs).unwrap();
        path
    };
    let s = |v: &str| gguf_file::Value::String(v.into());
    let lora = [("general.type", s("adapter")), ("adapter.type", s("lora")), ("general.architecture", s("llama"))];
    let (hidden, q) = shapes.in_out(multilora_types::ModuleKind::QProj);
    let good = [("blk.0.attn_q.weight.lora_a", (4, hidden)), ("blk.0.attn_q.weight.lora_b", (q, 4))];
    let load = |p: &std::path::Path| multilora_adapter::load_gguf_lora("x", p, &shapes, &opts);
    assert!(load(&write("ok.gguf", &lora, &good)).is_ok());
    let model = write("model.gguf", &[("general.type", s("model")), ("general.architecture", s("llama"))], &good);
    assert!(load(&model).unwrap_err().to_string().contains("not a LoRA file"));
    let qwen = [("general.type", s("adapter")), ("adapter.type", s("lora")), ("general.architecture", s("qwen2"))];
    assert_eq!(load(&write("qwen.gguf", &qwen, &good)).unwrap_err().kind(), "base_model_mismatch");
    let wide = [("blk.0.attn_q.weight.lora_a", (4, hidden + 1)), ("blk.0.attn_q.weight.lora_b", (q, 4))];
    assert_eq!(load(&write("wide.gguf", &lora, &wide)).unwrap_err().kind(), "shape_mismatch");
    let lonely = [("blk.0.attn_q.weight.lora_a", (4, hidden))];
    assert_eq!(load(&write("lonely.gguf", &lora, &lonely)).unwrap_err().kind(), "tensor_missing");
    let rank = [("blk.0.attn_q.weight.lora_a", (64, hidden)), ("blk.0.attn_q.weight.lora_b", (q, 64))];
    assert_eq!(load(&write("rank.gguf", &lora, &rank)).unwrap_err().kind(), "rank_too_large");
    let odd = [("blk.0.attn_qkv.weight.lora_a", (4, hidden)), ("blk.0.attn_qkv.weight.lora_b", (q, 4))];
    assert_eq!(load(&write("odd.gguf", &lora, &odd)).unwrap_err().kind(), "unsupported_module");
    std::fs::write(dir.path().join("junk.gguf"), b"GGUF\x03\0\0\0junk").unwrap();
    assert!(matches!(load(&dir.path().join("junk.gguf")).unwrap_err().kind(), "corrupt_header" | "truncated"));
}
