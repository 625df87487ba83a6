//! The config table: the fixture's `config.json` and the variants real checkpoints use, each read
//! once and checked field by field, with the shapes adapters are validated against.

use multilora_types::ModuleKind;
use serde_json::{Value, json};

use super::*;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny/base/config.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture config.json")).expect("fixture json")
}

/// The fixture with `changes` applied (`null` removes a field).
fn variant(changes: Value) -> Value {
    let mut v = fixture();
    let obj = v.as_object_mut().expect("object");
    for (k, x) in changes.as_object().expect("object") {
        if x.is_null() {
            obj.remove(k);
        } else {
            obj.insert(k.clone(), x.clone());
        }
    }
    v
}

const LLAMA3_ROPE: RopeScaling = RopeScaling::Llama3 {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
};

#[test]
fn the_fixture_reads_as_transformers_wrote_it() {
    let c = ModelConfig::from_json(&fixture()).unwrap();
    let got = (c.architecture, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads);
    assert_eq!(got, (Architecture::Llama, 128, 352, 4, 4, 2));
    assert_eq!((c.head_dim, c.vocab_size, c.max_position_embeddings, c.max_model_len()), (32, 512, 512, 512));
    assert_eq!((c.rope_theta, c.rope_scaling.clone(), c.hidden_act), (10_000.0, RopeScaling::Default, HiddenAct::Silu));
    assert_eq!((c.rms_norm_eps, c.bos_token_id, c.eos_token_ids.clone()), (1e-5, Some(1), vec![2]));
    assert_eq!((c.checkpoint_dtype(), c.tie_word_embeddings, c.attention_bias), (Some(DType::F32), false, false));
    let s = c.shapes();
    assert_eq!((s.architecture.as_str(), s.model_type.as_str()), ("LlamaForCausalLM", "llama"));
    assert_eq!((s.num_layers, s.hidden_size, s.head_dim, s.num_kv_heads, s.vocab_size), (4, 128, 32, 2, 512));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny/base/config.json");
    assert_eq!(ModelConfig::from_file(&path).unwrap(), c, "file and value read the same");
    assert_eq!(s.in_out(ModuleKind::KProj), (128, 64));
    assert_eq!(s.in_out(ModuleKind::EmbedTokens), (512, 128));
    assert_eq!(s.modules().len(), 4 * 7 + 2);
    assert!(ModelConfig::from_json(&json!({"hidden_size": 1})).is_err());
}

/// Each variant: what changes, and what must be read.
#[test]
fn variants_real_checkpoints_use() {
    type Check = fn(&ModelConfig);
    let table: Vec<(&str, Value, Check)> = vec![
        (
            "legacy rope_theta, no rope_parameters",
            json!({"rope_parameters": null, "rope_theta": 500000.0, "rope_scaling": null}),
            |c| assert_eq!((c.rope_theta, c.rope_scaling.clone()), (5e5, RopeScaling::Default)),
        ),
        (
            "linear rope scaling (legacy rope_scaling)",
            json!({"rope_parameters": null, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
            |c| assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 }),
        ),
        (
            "rope_parameters with llama3 scaling (transformers 5)",
            json!({"rope_theta": null, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                   "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}}),
            |c| assert_eq!((c.rope_theta, c.rope_scaling.clone()), (5e5, LLAMA3_ROPE)),
        ),
        (
            "legacy rope_scaling llama3 (Llama 3.1 as first released)",
            json!({"rope_parameters": null, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3",
                   "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}}),
            |c| assert_eq!((c.rope_theta, c.rope_scaling.clone()), (5e5, LLAMA3_ROPE)),
        ),
        (
            "legacy rope_scaling spelled with `type`",
            json!({"rope_parameters": null, "rope_scaling": {"type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
            |c| assert_eq!((c.rope_theta, c.rope_scaling.clone()), (10_000.0, LLAMA3_ROPE)),
        ),
        ("tied embeddings", json!({"tie_word_embeddings": true}), |c| {
            assert!(c.tie_word_embeddings && c.shapes().tie_word_embeddings)
        }),
        ("torch_dtype bf16", json!({"dtype": null, "torch_dtype": "bfloat16"}), |c| {
            assert_eq!((c.checkpoint_dtype(), c.auto_dtype()), (Some(DType::BF16), DType::BF16))
        }),
        ("no dtype at all: f32, as transformers loads it", json!({"dtype": null}), |c| {
            assert_eq!((c.checkpoint_dtype(), c.auto_dtype()), (None, DType::F32))
        }),
        (
            "Mistral's sliding window is read, and is not a context cap",
            json!({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 256}),
            |c| {
                assert_eq!(
                    (c.architecture, c.sliding_window, c.max_model_len()),
                    (Architecture::Mistral, Some(256), 512)
                );
                assert_eq!(c.shapes().architecture, "MistralForCausalLM");
            },
        ),
        (
            "Qwen2's window is off unless use_sliding_window; q/k/v biases on",
            json!({"model_type": "qwen2", "sliding_window": 256, "attention_bias": null}),
            |c| assert_eq!((c.sliding_window, c.attention_bias, c.max_model_len()), (None, true, 512)),
        ),
        (
            "Qwen3: q/k norms per head, no biases, the window off unless use_sliding_window",
            json!({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "sliding_window": 256}),
            |c| {
                assert_eq!((c.architecture, c.qk_norm, c.attention_bias), (Architecture::Qwen3, true, false));
                assert_eq!((c.sliding_window, c.shapes().architecture.as_str()), (None, "Qwen3ForCausalLM"));
            },
        ),
        (
            "Phi-3: fused projections, and its adapters target them",
            json!({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
            |c| {
                assert_eq!((c.architecture, c.fused_projections, c.qk_norm), (Architecture::Phi3, true, false));
                let s = c.shapes();
                assert!(s.fused_projections);
                let k = multilora_adapter::ModuleId::layer(1, multilora_types::ModuleKind::KProj);
                assert_eq!(s.peft_module(k), ("model.layers.1.self_attn.qkv_proj".to_string(), 128));
            },
        ),
        ("architectures alone names the family", json!({"model_type": null}), |c| {
            assert_eq!(c.architecture, Architecture::Llama)
        }),
        (
            "eos list and defaults for absent fields",
            json!({"eos_token_id": [2, 7], "head_dim": null, "num_key_value_heads": null, "rms_norm_eps": null,
                   "max_position_embeddings": null, "bos_token_id": null, "hidden_act": null}),
            |c| {
                assert_eq!((c.eos_token_ids.clone(), c.head_dim, c.num_kv_heads), (vec![2, 7], 32, 4));
                assert_eq!((c.rms_norm_eps, c.max_position_embeddings, c.bos_token_id), (1e-6, 4096, None));
                assert_eq!(c.hidden_act, HiddenAct::Silu);
            },
        ),
        ("hidden_act swish is SiLU", json!({"hidden_act": "swish"}), |c| assert_eq!(c.hidden_act, HiddenAct::Silu)),
        ("hidden_act gelu is exact GELU", json!({"hidden_act": "gelu"}), |c| assert_eq!(c.hidden_act, HiddenAct::Gelu)),
        ("gelu_pytorch_tanh is the tanh GELU", json!({"hidden_act": "gelu_pytorch_tanh"}), |c| {
            assert_eq!(c.hidden_act, HiddenAct::GeluTanh)
        }),
        ("gelu_new is the tanh GELU", json!({"hidden_act": "gelu_new"}), |c| {
            assert_eq!(c.hidden_act, HiddenAct::GeluTanh)
        }),
    ];
    for (what, changes, check) in table {
        let c = ModelConfig::from_json(&variant(changes)).unwrap_or_else(|e| panic!("{what}: {e}"));
        check(&c);
    }
}

/// Each refusal: what changes, the error kind, and what the message must name.
#[test]
fn refusals_name_the_field() {
    let table = [
        (json!({"hidden_act": "quick_gelu"}), "unsupported_activation", "hidden_act"),
        (json!({"hidden_act": "relu"}), "unsupported_activation", "\"relu\""),
        (json!({"model_type": "gpt2"}), "unsupported_architecture", "gpt2"),
        (json!({"model_type": null, "architectures": null}), "config", "model_type"),
        (json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}), "unsupported_rope_scaling", "yarn"),
        (json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}), "config", "low_freq_factor"),
        (json!({"rope_parameters": {"rope_type": "linear"}}), "config", "factor"),
        (json!({"rope_parameters": {"rope_type": "linear", "factor": 0.0}}), "config", "factor"),
        (json!({"vocab_size": null}), "config", "vocab_size"),
        (json!({"hidden_size": "big"}), "config", "hidden_size"),
        (json!({"num_hidden_layers": -1}), "config", "num_hidden_layers"),
        (json!({"num_key_value_heads": 3}), "config", "num_key_value_heads"),
        (json!({"head_dim": 7}), "config", "head_dim"),
        // Found by the fuzz target: the query width overflowed in `q_size`.
        (
            json!({"num_attention_heads": 1u64 << 40, "num_key_value_heads": 1, "head_dim": 1u64 << 40}),
            "config",
            "head_dim",
        ),
        (json!({"rope_parameters": "default"}), "config", "rope_parameters"),
        // Phi-4-mini's partial rotary: refused, not rotated wrongly; LongRoPE's factors must be
        // one per rotary frequency, and it needs the original context.
        (json!({"model_type": "phi3", "partial_rotary_factor": 0.75}), "config", "partial_rotary_factor"),
        (
            json!({"model_type": "phi3", "original_max_position_embeddings": 16,
                   "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}),
            "config",
            "short_factor",
        ),
        (
            json!({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope"}}),
            "config",
            "original_max_position_embeddings",
        ),
    ];
    for (changes, kind, names) in table {
        let e = ModelConfig::from_json(&variant(changes.clone())).unwrap_err();
        assert_eq!(e.kind(), kind, "{changes}: {e}");
        assert!(e.to_string().contains(names), "{changes}: {e} does not name {names}");
        assert!(e.to_string().starts_with("config.json: "), "{changes}: {e} does not name the file");
    }
}

#[test]
fn only_a_small_regular_file_is_read() {
    let dir = std::env::temp_dir().join(format!("multilora-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = ModelConfig::from_file(&dir).unwrap_err();
    assert!(e.kind() == "config" && e.to_string().contains("not a regular file"), "{e}");
    let big = dir.join("config.json");
    std::fs::write(&big, vec![b' '; MAX_CONFIG_BYTES as usize + 1]).unwrap();
    let e = ModelConfig::from_file(&big).unwrap_err();
    assert!(e.to_string().contains("more than"), "{e}");
    let e = ModelConfig::from_file(&dir.join("absent.json")).unwrap_err();
    assert_eq!(e.kind(), "io", "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Phi-3-mini-128k's LongRoPE: both factor sets, the original context, and the cos / sin scale
/// transformers derives when the config gives none (`√(1 + ln 32 / ln 4096)`), or the one given.
#[test]
fn longrope_is_read_with_its_attention_factor() {
    let factors = |v: f64| vec![v; 48];
    let cfg = json!({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32064, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": factors(1.0), "long_factor": factors(2.5)}});
    let c = ModelConfig::from_json(&cfg).unwrap();
    let RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor } =
        c.rope_scaling
    else {
        panic!("not longrope: {:?}", c.rope_scaling)
    };
    assert_eq!((short_factor.len(), long_factor[0], original_max_position_embeddings), (48, 2.5, 4096));
    assert!((attention_factor - (1.0 + 32f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-12, "{attention_factor}");
    let mut given = cfg.clone();
    given["rope_scaling"]["attention_factor"] = json!(1.0);
    let c = ModelConfig::from_json(&given).unwrap();
    assert!(matches!(c.rope_scaling, RopeScaling::LongRope { attention_factor: 1.0, .. }));
}

/// Gemma 3 4B–27B scale the full-attention layers' RoPE linearly (factor 8) and leave the sliding
/// layers' alone (their own base): transformers' `inv_freq / factor` on the first, the plain
/// frequencies on the second, to the bit in f32.
#[test]
fn gemma3_linear_scaling_applies_to_the_full_attention_layers_only() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families/gemma3/base/config.json");
    let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    raw["rope_parameters"]["full_attention"] = json!({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6});
    let c = ModelConfig::from_json(&raw).unwrap();
    assert_eq!(
        (c.rope_scaling.clone(), c.rope_theta, c.rope_local_theta),
        (RopeScaling::Linear { factor: 8.0 }, 1e6, Some(1e4))
    );
    let d = c.head_dim;
    let plain = |base: f32| -> Vec<f32> { (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32)).collect() };
    let global: Vec<f32> = plain(1e6).iter().map(|f| f / 8.0).collect();
    assert_eq!(crate::rope::inv_freq(&c, false), global);
    assert_eq!(crate::rope::inv_freq(&c, true), plain(1e4));
    // Scaling the sliding layers' RoPE is refused, not ignored.
    raw["rope_parameters"]["sliding_attention"] = json!({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4});
    let err = ModelConfig::from_json(&raw).unwrap_err().to_string();
    assert!(err.contains("sliding layers"), "{err}");
}
