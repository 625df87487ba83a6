//! Every invalid fixture adapter is refused with its own error kind and a message naming the
//! adapter and the cause; the embedding adapter is accepted only with the base's own embedding.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::{base_shapes, fixtures};
use multilora_adapter::{Error, LoadOptions, load_dir};

fn load(name: &str, dir: &Path) -> multilora_adapter::Result<multilora_adapter::LoraAdapter> {
    load_dir(name, dir, &base_shapes(), &LoadOptions::default().max_lora_rank(64))
}

#[test]
fn each_invalid_fixture_has_its_own_kind_and_a_clear_message() {
    let expected = [
        ("dora", "dora", "dora"),
        ("lora_bias", "lora_bias", "bias"),
        ("truncated", "truncated", "truncated"),
        ("corrupt_header", "corrupt_header", "header"),
        ("shape_mismatch", "shape_mismatch", "[8, 96]"),
    ];
    let mut kinds = BTreeSet::new();
    for (name, kind, cause) in expected {
        let err = load(name, &fixtures().join("invalid_adapters").join(name)).unwrap_err();
        let msg = err.to_string();
        assert_eq!(err.kind(), kind, "{name}: {msg}");
        assert!(msg.contains(&format!("{name:?}")), "{name}: message does not name the adapter: {msg}");
        assert!(msg.to_lowercase().contains(cause), "{name}: message does not name the cause: {msg}");
        kinds.insert(err.kind());
    }
    assert_eq!(kinds.len(), 5);
}

#[test]
fn shape_mismatch_names_the_tensor_and_both_shapes() {
    let err = load("sm", &fixtures().join("invalid_adapters/shape_mismatch")).unwrap_err();
    let Error::ShapeMismatch { tensor, got, expected, .. } = &err else { panic!("{err}") };
    assert!(tensor.ends_with("lora_A.weight"), "{tensor}");
    assert_eq!((got.as_slice(), expected.as_slice()), (&[8, 96][..], &[8, 128][..]));
}

#[test]
fn embed_target_loads_when_its_saved_embedding_equals_the_base() {
    let adapter = load("embed", &fixtures().join("invalid_adapters/embed_target")).unwrap();
    let id = multilora_adapter::ModuleId::embed_tokens();
    let m = adapter.module(&id).unwrap();
    assert_eq!((m.a.dims(), m.b().unwrap().dims()), (&[8, 512][..], &[128, 8][..]));
    assert_eq!(adapter.modules().len(), 5);
}

#[test]
fn embed_target_is_refused_when_the_base_embedding_differs_or_is_unknown() {
    let mut shapes = base_shapes();
    let dir = fixtures().join("invalid_adapters/embed_target");
    shapes.embed_digest = Some([7; 32]);
    let err = load_dir("embed", &dir, &shapes, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "embedding_mismatch", "{err}");
    assert!(err.to_string().contains("embed_tokens.base_layer.weight"), "{err}");
    shapes.embed_digest = None;
    let err = load_dir("embed", &dir, &shapes, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "embedding_mismatch", "{err}");
}

#[test]
fn bias_all_without_bias_tensors_is_plain_lora() {
    let bias_all = load("b", &fixtures().join("invalid_adapters/bias_all")).unwrap();
    assert_eq!(bias_all.config().bias, "all");
    assert_eq!(bias_all.modules().len(), 8);
    assert!(bias_all.modules().values().all(|m| m.rank == 8 && m.scaling == 2.0));
}

/// Copies a fixture adapter into a temp dir and rewrites its config with `edit`.
fn edited(src: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let from = fixtures().join(src);
    std::fs::copy(from.join("adapter_model.safetensors"), tmp.path().join("adapter_model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("adapter_config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(tmp.path().join("adapter_config.json"), cfg.to_string()).unwrap();
    tmp
}

/// An edit of a config, applied to a copy of a fixture.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

#[test]
fn config_level_refusals() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("r zero", Box::new(|c| c["r"] = 0.into()), "config_invalid"),
        ("r negative", Box::new(|c| c["r"] = (-8).into()), "config_invalid"),
        ("dora flag", Box::new(|c| c["use_dora"] = true.into()), "dora"),
        ("lora_bias flag", Box::new(|c| c["lora_bias"] = true.into()), "lora_bias"),
        (
            "unknown module",
            Box::new(|c| c["target_modules"] = serde_json::json!(["q_proj", "fc1"])),
            "unsupported_module",
        ),
        ("pissa", Box::new(|c| c["init_lora_weights"] = "pissa".into()), "unsupported"),
        ("not lora", Box::new(|c| c["peft_type"] = "IA3".into()), "unsupported"),
        ("targets nothing", Box::new(|c| c["target_modules"] = serde_json::json!(["k_proj"])), "tensor_unexpected"),
        (
            "targets more",
            Box::new(|c| c["target_modules"] = serde_json::json!(["q_proj", "k_proj", "v_proj"])),
            "tensor_missing",
        ),
        ("bad type", Box::new(|c| c["use_rslora"] = "yes".into()), "config_invalid"),
        ("rank pattern mismatch", Box::new(|c| c["rank_pattern"] = serde_json::json!({"q_proj": 4})), "shape_mismatch"),
    ];
    for (what, edit, kind) in cases {
        let tmp = edited("adapters/qv_r8", edit);
        let err = load("qv", tmp.path()).unwrap_err();
        assert_eq!(err.kind(), kind, "{what}: {err}");
        assert!(err.to_string().contains("\"qv\""), "{what}: {err}");
    }
    // Unknown fields are kept and ignored.
    let tmp = edited("adapters/qv_r8", |c| c["a_field_from_the_future"] = serde_json::json!({"x": 1}));
    let a = load("qv", tmp.path()).unwrap();
    assert!(a.config().raw.contains_key("a_field_from_the_future"));
}

#[test]
fn missing_files_and_strict_base_check() {
    let tmp = tempfile::tempdir().unwrap();
    let err = load("none", tmp.path()).unwrap_err();
    assert_eq!(err.kind(), "config_missing", "{err}");
    let tmp = edited("adapters/qv_r8", |_| {});
    std::fs::remove_file(tmp.path().join("adapter_model.safetensors")).unwrap();
    assert_eq!(load("qv", tmp.path()).unwrap_err().kind(), "io");

    // The fixtures name "../../base", which is the served Llama: strict mode accepts it.
    let dir = fixtures().join("adapters/qv_r8");
    let strict = LoadOptions::default().strict_base_model(true);
    load_dir("qv", &dir, &base_shapes(), &strict).unwrap();
    let mut other = base_shapes();
    other.architecture = "Qwen2ForCausalLM".into();
    other.model_type = "qwen2".into();
    let err = load_dir("qv", &dir, &other, &strict).unwrap_err();
    assert_eq!(err.kind(), "base_model_mismatch", "{err}");
    assert!(err.to_string().contains("LlamaForCausalLM"), "{err}");
}

#[test]
fn fan_in_fan_out_changes_nothing_for_linear_targets() {
    // PEFT resets fan_in_fan_out to false for nn.Linear targets (with a warning) and saves
    // lora_A: [r, in], lora_B: [out, r] either way, so the same tensors mean the same function.
    let plain = load("qv", &fixtures().join("adapters/qv_r8")).unwrap();
    let tmp = edited("adapters/qv_r8", |c| c["fan_in_fan_out"] = true.into());
    let flagged = load("qv", tmp.path()).unwrap();
    assert!(flagged.config().fan_in_fan_out);
    assert_eq!(plain.fingerprint(), flagged.fingerprint());
    for (id, m) in plain.modules() {
        let f = flagged.module(id).unwrap();
        assert_eq!(m.a.to_vec2::<f32>().unwrap(), f.a.to_vec2::<f32>().unwrap(), "{id}");
        assert_eq!(m.b().unwrap().to_vec2::<f32>().unwrap(), f.b().unwrap().to_vec2::<f32>().unwrap(), "{id}");
    }
}
