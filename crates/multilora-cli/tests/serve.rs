//! `multilora serve` as a process: the official `openai` Python client against it (with a chat
//! template given by `--chat-template`, and without one), the `openai` and `anthropic` clients
//! through the Responses and Messages APIs on SmolLM2's file, a graceful exit 0 on SIGTERM, a bf16
//! checkpoint served in its own dtype within its own bytes, and a GGUF file served quantized
//! within its own bytes with no other flag.
//!
//! The Python part needs `python3` with the `openai` and `anthropic` packages. `.ci/run` installs it and sets
//! `MULTILORA_REQUIRE_OPENAI=1`, so in CI its absence fails the test; elsewhere the Python part
//! is skipped with a message saying how to run it, and the shutdown checks still run.

#[path = "../../../tests/support/real_models.rs"]
mod real_models;
use real_models::smollm2;

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Serve, fixtures, get, post, python_has, serve_model};

fn serve(extra: &[&str]) -> Serve {
    serve_with_env(extra, &[])
}

fn serve_with_env(extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let f = fixtures();
    let mut args: Vec<String> = ["--served-model-name", "base", "--lora-modules"].map(String::from).to_vec();
    for name in ["qv_r8", "all_r16"] {
        args.push(format!("{name}={}", f.join("adapters").join(name).display()));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    serve_model(&f.join("base"), &args, env)
}

/// Whether the Python client can run here; fails when CI requires it.
fn python_openai() -> bool {
    python_has("openai")
}

fn run_client(url: &str, mode: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new("python3").arg(&script).args([url, "test-key", mode]).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "openai client ({mode}) failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("OK"), "{stdout}");
    eprintln!("{stdout}");
}

#[test]
fn the_openai_python_client_works_and_sigterm_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("chat.jinja");
    std::fs::write(
        &template,
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant:{% endif %}",
    )
    .unwrap();
    let with_python = python_openai();

    let server = serve(&["--chat-template", template.to_str().unwrap()]);
    if with_python {
        run_client(&server.url, "with-template");
    }
    let status = server.terminate();
    assert_eq!(status.code(), Some(0), "graceful shutdown exits 0");

    let server = serve(&[]);
    if with_python {
        run_client(&server.url, "no-template");
    }
    assert_eq!(server.terminate().code(), Some(0));
}

/// The official `openai` and `anthropic` clients through the Responses and Messages APIs, on
/// SmolLM2's GGUF file with a PEFT adapter named as the model: each API answers with chat
/// completions' greedy text for the same conversation, streamed through the clients' own stream
/// helpers; `count_tokens` and `/tokenize` count chat's prompt tokens (`tests/agent_clients.py`).
#[test]
fn the_agent_clients_speak_responses_and_messages() {
    let Some(gguf) = smollm2::gguf("the_agent_clients_speak_responses_and_messages") else { return };
    if !python_has("openai, anthropic") {
        return;
    }
    let pirate = smollm2::fixtures().join("adapters/pirate");
    let server = serve_model(&gguf, &["--lora-modules".into(), format!("pirate={}", pirate.display())], &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agent_clients.py");
    let out = Command::new("python3").arg(&script).args([&server.url, "test-key", "pirate"]).output().expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "agent clients failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("OK"), "{stdout}");
    eprintln!("{stdout}");
    assert_eq!(server.terminate().code(), Some(0));
}

#[test]
fn a_bad_chat_template_file_is_refused_at_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_multilora"))
        .args(["serve", "--model", fixtures().join("base").to_str().unwrap(), "--port", "0"])
        .args(["--chat-template", "/nonexistent/chat.jinja"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--chat-template") && err.contains("/nonexistent/chat.jinja"), "{err}");
}

/// A random bf16 checkpoint of the engine bench's layer shapes (hidden 1024, intermediate 2816,
/// 16 / 8 heads, vocab 32000) with 4 layers, `config.json` naming `bfloat16`: 224 MB of weights.
/// Returns its weight bytes.
fn write_bf16_checkpoint(dir: &Path) -> u64 {
    use candle_core::{DType, Device, Tensor};
    let (h, i, v, layers) = (1024usize, 2816usize, 32000usize, 4usize);
    let config = serde_json::json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 8, "vocab_size": v, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
        "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let r =
        |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
    let mut w = std::collections::HashMap::new();
    w.insert("model.embed_tokens.weight".to_string(), r((v, h)));
    w.insert("lm_head.weight".to_string(), r((v, h)));
    w.insert("model.norm.weight".to_string(), Tensor::ones(h, DType::BF16, &Device::Cpu).unwrap());
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("self_attn.q_proj", (h, h)),
            ("self_attn.k_proj", (h / 2, h)),
            ("self_attn.v_proj", (h / 2, h)),
            ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ] {
            w.insert(format!("{p}.{n}.weight"), r(shape));
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(format!("{p}.{n}.weight"), Tensor::ones(h, DType::BF16, &Device::Cpu).unwrap());
        }
    }
    let bytes = w.values().map(|t| (t.elem_count() * 2) as u64).sum();
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    bytes
}

/// `VmRSS` and `VmHWM` of a process, in bytes (Linux).
fn resident(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// A bf16 checkpoint served with no `--dtype`: served in bf16 (the start-up log and
/// `/v1/models` say so, with the kernels' instruction set), a request answered, and the
/// resident memory once serving at most 1.25× the checkpoint's bytes plus the KV budget.
#[test]
fn a_bf16_checkpoint_is_served_in_bf16_within_its_own_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let weights = write_bf16_checkpoint(dir.path());
    let kv = 64u64 << 20;
    let args: Vec<String> = ["--served-model-name", "base", "--max-loras", "0", "--kv-cache-bytes", &kv.to_string()]
        .map(String::from)
        .to_vec();
    let server = serve_model(dir.path(), &args, &[("RUST_LOG", "info")]);
    let body = r#"{"model": "base", "prompt": [1, 5, 9, 13], "max_tokens": 4}"#;
    let resp = post(&server.url, "/v1/completions", body);
    assert!(resp.starts_with("HTTP/1.1 200") && resp.contains("\"completion_tokens\":4"), "{resp}");
    let models = get(&server.url, "/v1/models");
    assert!(models.contains("\"dtype\":\"bfloat16\""), "{models}");
    let ready = server.lines.lock().unwrap().iter().find(|l| l.contains("multilora engine ready")).cloned();
    let ready = ready.expect("the start-up log line");
    assert!(ready.contains("dtype=BF16") && ready.contains("over BF16 weights"), "{ready}");
    if let Some((rss, hwm)) = resident(server.child.id()) {
        let bound = weights as f64 * 1.25 + kv as f64;
        eprintln!(
            "bf16 checkpoint {:.1} MB, KV budget {:.1} MB: resident {:.1} MB (bound {:.1} MB), peak {:.1} MB",
            weights as f64 / 1e6,
            kv as f64 / 1e6,
            rss as f64 / 1e6,
            bound / 1e6,
            hwm as f64 / 1e6
        );
        assert!((rss as f64) <= bound, "resident {rss} bytes > {bound}");
    } else {
        eprintln!("SKIPPED the resident-memory check: no /proc/<pid>/status on this system");
    }
    assert_eq!(server.terminate().code(), Some(0));
}

/// The field `name=VALUE` of a log line, as a number.
fn log_field(line: &str, name: &str) -> Option<f64> {
    line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}=")))?.trim_matches('"').parse().ok()
}

/// The GGUF file users hold, given as the model and nothing else an engine takes: it starts (the
/// KV budget grows to one full-length sequence), answers a chat request with the model's own
/// template, and holds at most 1.2 times the file's bytes plus the KV cache and the slots.
#[test]
fn a_gguf_file_with_no_other_flag_serves_chat_within_its_bytes() {
    let Some(gguf) = smollm2::gguf("a_gguf_file_with_no_other_flag_serves_chat_within_its_bytes") else { return };
    let file_bytes = std::fs::metadata(&gguf).unwrap().len();
    let server = serve_model(&gguf, &[], &[("RUST_LOG", "info")]);
    let body = serde_json::json!({"model": gguf.to_str().unwrap(), "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of Spain?"}]});
    let resp = post(&server.url, "/v1/chat/completions", &body.to_string());
    // The model's own answer (transformers' too, `expected/transformers.json`).
    assert!(resp.starts_with("HTTP/1.1 200") && resp.contains("El Salvador"), "{resp}");
    let ready = server.lines.lock().unwrap().iter().find(|l| l.contains("multilora engine ready")).cloned();
    let ready = ready.expect("the start-up log line");
    assert!(ready.contains("Q4_1") && ready.contains("kept quantized"), "{ready}");
    let kv = log_field(&ready, "kv_bytes").expect("kv_bytes in the log");
    let slots = log_field(&ready, "lora_slot_bytes").expect("lora_slot_bytes in the log");
    if let Some((rss, hwm)) = resident(server.child.id()) {
        let bound = file_bytes as f64 * 1.2 + kv + slots;
        eprintln!(
            "gguf file {:.1} MB, KV {:.1} MB, slots {:.1} MB: resident {:.1} MB (bound {:.1} MB), peak {:.1} MB",
            file_bytes as f64 / 1e6,
            kv / 1e6,
            slots / 1e6,
            rss as f64 / 1e6,
            bound / 1e6,
            hwm as f64 / 1e6
        );
        assert!((rss as f64) <= bound, "resident {rss} bytes > {bound}");
    } else {
        eprintln!("SKIPPED the resident-memory check: no /proc/<pid>/status on this system");
    }
    assert_eq!(server.terminate().code(), Some(0));
}

#[test]
fn vllm_env_switch_enables_the_adapter_routes() {
    let body = r#"{"lora_name": "nope"}"#;
    let off = serve(&[]);
    let resp = post(&off.url, "/v1/unload_lora_adapter", body);
    assert!(resp.starts_with("HTTP/1.1 404") && !resp.contains("model_not_found"), "no route: {resp}");
    assert_eq!(off.terminate().code(), Some(0));

    let on = serve_with_env(&[], &[("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")]);
    let resp = post(&on.url, "/v1/unload_lora_adapter", body);
    assert!(resp.starts_with("HTTP/1.1 404") && resp.contains("model_not_found"), "the route answers: {resp}");
    assert_eq!(on.terminate().code(), Some(0));
}

/// The engine loop panics (its fail point, set through FAILPOINTS for the binary under test):
/// the request gets 503 `engine_failed`, and `multilora serve` shuts down by itself and exits
/// 1 so that a supervisor restarts it.
#[test]
fn a_failed_engine_makes_serve_exit_non_zero() {
    let mut s = serve_with_env(&["--shutdown-grace-secs", "1"], &[("FAILPOINTS", "engine-step=panic(injected)")]);
    let body = r#"{"model": "base", "prompt": "hi", "max_tokens": 4}"#;
    let resp = post(&s.url, "/v1/completions", body);
    assert!(resp.starts_with("HTTP/1.1 503") && resp.contains("engine_failed"), "{resp}");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = s.child.try_wait().expect("wait") {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "serve still runs 30 s after its engine failed");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(1), "{status:?}");
}
