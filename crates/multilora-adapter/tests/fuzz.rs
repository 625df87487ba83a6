//! Fuzz-style tests: random bytes and random JSON fed to the config parser and the loader give
//! errors, never panics.

mod common;

use common::{base_shapes, fixtures};
use multilora_adapter::{AdapterConfig, LoadOptions, load_dir};
use proptest::prelude::*;

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
        "[a-z_.\\\\()|*+?\\[\\]0-9]{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

const FIELDS: &[&str] = &[
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "bias",
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "init_lora_weights",
    "peft_type",
    "task_type",
    "layer_replication",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn config_parser_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = AdapterConfig::parse(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn loader_never_panics_on_random_configs(
        values in prop::collection::vec((0..FIELDS.len(), json_value()), 0..8)
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("adapters/pattern_r8/adapter_config.json")).unwrap()).unwrap();
        for (field, value) in values {
            cfg[FIELDS[field]] = value;
        }
        std::fs::write(tmp.path().join("adapter_config.json"), cfg.to_string()).unwrap();
        std::fs::copy(fixtures().join("adapters/pattern_r8/adapter_model.safetensors"),
            tmp.path().join("adapter_model.safetensors")).unwrap();
        let _ = load_dir("fuzz", tmp.path(), &base_shapes(), &LoadOptions::default().max_lora_rank(64));
    }

    #[test]
    fn loader_never_panics_on_damaged_weights(
        cut in 0usize..20_000, flips in prop::collection::vec((0usize..20_000, any::<u8>()), 0..16)
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let src = fixtures().join("adapters/qv_r8");
        std::fs::copy(src.join("adapter_config.json"), tmp.path().join("adapter_config.json")).unwrap();
        let mut bytes = std::fs::read(src.join("adapter_model.safetensors")).unwrap();
        for (at, value) in flips {
            let n = bytes.len();
            bytes[at % n] = value;
        }
        bytes.truncate(bytes.len().saturating_sub(cut % bytes.len()));
        std::fs::write(tmp.path().join("adapter_model.safetensors"), &bytes).unwrap();
        if let Err(e) = load_dir("fuzz", tmp.path(), &base_shapes(), &LoadOptions::default()) {
            prop_assert!(e.to_string().contains("\"fuzz\""), "{}", e);
        }
    }
}
