//! Runs the built `multilora` binary as a process on the project's PEFT fixtures and on a
//! written config.json: what another program relying on the command sees.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny")
}

fn multilora(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_multilora")).args(args).output().expect("run multilora")
}

fn cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap()).unwrap()
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32;
    row.iter().map(|x| x - lse).collect()
}

/// Runs generate over `lines` with every valid fixture adapter; returns the exit output and lines.
fn generate(dir: &Path, lines: &[Value], extra: &[&str]) -> (Output, Vec<Value>) {
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&input, text).unwrap();
    let f = fixtures();
    let base = f.join("base");
    let mut args: Vec<String> = vec!["generate".into(), "--model".into(), base.display().to_string()];
    for name in cases()["adapters"].as_object().unwrap().keys() {
        args.push("--lora".into());
        args.push(format!("{name}={}", f.join("adapters").join(name).display()));
    }
    args.extend(["--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = multilora(&args);
    let results = std::fs::read_to_string(&output)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("output line is JSON"))
        .collect();
    (out, results)
}

#[test]
fn every_fixture_row_and_greedy_case_matches_peft_in_input_order() {
    let dir = tempfile::tempdir().unwrap();
    let cases = cases();
    let base = fixtures().join("base").display().to_string();
    let mut lines = Vec::new();
    let mut expected_rows = Vec::new(); // (line index, ids, log-softmax rows)
    for batch in cases["batches"].as_array().unwrap() {
        let tensors = candle_core::safetensors::load(
            fixtures().join(batch["expected"].as_str().unwrap()),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        for (i, row) in batch["rows"].as_array().unwrap().iter().enumerate() {
            let ids: Vec<u32> = serde_json::from_value(row["input_ids"].clone()).unwrap();
            let logits: Vec<Vec<f32>> = tensors[row["tensor"].as_str().unwrap()].to_vec2().unwrap();
            let model = row["adapter"].as_str().unwrap_or(&base);
            let id = format!("{}/{i}", batch["name"].as_str().unwrap());
            expected_rows.push((lines.len(), ids.clone(), logits.iter().map(|r| log_softmax(r)).collect::<Vec<_>>()));
            lines.push(json!({"id": id, "model": model, "input_ids": ids, "max_tokens": 1, "prompt_logprobs": true}));
        }
        // An unknown model in the middle of the file: its line is an error, the rest still run.
        lines.push(json!({"id": "unknown", "model": "no-such-adapter", "input_ids": [1, 2, 3]}));
    }
    let mut expected_gen = Vec::new();
    for (i, g) in cases["generation"].as_array().unwrap().iter().enumerate() {
        let model = g["adapter"].as_str().unwrap_or(&base);
        expected_gen.push((lines.len(), g["output_ids"].clone()));
        lines.push(json!({"id": format!("gen/{i}"), "model": model, "input_ids": g["input_ids"],
            "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "logprobs": 2}));
    }
    let (out, results) = generate(dir.path(), &lines, &[]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(results.len(), lines.len());
    for (line, result) in lines.iter().zip(&results) {
        assert_eq!(line["id"], result["id"], "output order must be input order");
    }
    let mut worst = 0f32;
    for (at, ids, lsm) in &expected_rows {
        let r = &results[*at];
        assert_eq!(r["prompt_ids"], json!(ids), "{}", r["id"]);
        let lps = r["prompt_logprobs"].as_array().unwrap_or_else(|| panic!("no prompt_logprobs: {r}"));
        assert_eq!(lps.len(), ids.len());
        assert!(lps[0].is_null());
        for t in 1..ids.len() {
            let got = lps[t].as_f64().unwrap() as f32;
            let want = lsm[t - 1][ids[t] as usize];
            worst = worst.max((got - want).abs());
            assert!((got - want).abs() < 1e-4, "{} token {t}: {got} vs {want}", r["id"]);
        }
    }
    for (at, want) in &expected_gen {
        let r = &results[*at];
        assert_eq!(&r["output_ids"], want, "{}", r["id"]);
        assert_eq!(r["finish_reason"], "length");
        assert_eq!(r["logprobs"].as_array().unwrap().len(), 16);
        let tops = r["top_logprobs"].as_array().unwrap();
        assert_eq!(tops.len(), 16);
        // Greedy: the chosen token is the most likely alternative.
        assert_eq!(tops[0][0]["id"], r["output_ids"][0]);
        assert!(tops[0][0]["logprob"].is_number());
    }
    let errors: Vec<&Value> = results.iter().filter(|r| r.get("error").is_some()).collect();
    assert_eq!(errors.len(), cases["batches"].as_array().unwrap().len());
    for e in errors {
        assert_eq!(e["id"], "unknown");
        assert_eq!(e["error"]["kind"], "model_not_found");
    }
    eprintln!("worst prompt logprob difference: {worst:e}");
}

#[test]
fn text_prompts_defaults_and_bad_fields() {
    let dir = tempfile::tempdir().unwrap();
    let lines = [
        json!({"id": 1, "model": "qv_r8", "prompt": "Hello world", "temperature": 0.0, "max_tokens": 3}),
        json!({"id": 2, "input_ids": [1, 2], "max_tokens": 0}),
        json!({"id": 3, "input_ids": [1, 2], "max_tokenz": 4}),
        json!({"id": 4, "input_ids": [1, 2], "seed": 7}),
    ];
    let (out, r) = generate(dir.path(), &lines, &["--served-model-name", "base"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(r[0]["prompt_ids"][0], 1, "the tokenizer adds BOS: {}", r[0]);
    assert_eq!(r[0]["output_ids"].as_array().unwrap().len(), 3);
    assert!(r[0].get("logprobs").is_none());
    assert_eq!(r[1]["error"]["kind"], "invalid_request");
    assert_eq!(r[2]["error"]["kind"], "invalid_request");
    assert!(r[2]["error"]["message"].as_str().unwrap().contains("max_tokenz"));
    assert_eq!(r[3]["model"], "base");
    assert!(r[3]["output_ids"].as_array().unwrap().len() <= 16, "vLLM's default max_tokens is 16");
}

fn assert_one_clean_line(out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.starts_with("error: ") && err.trim_end().lines().count() == 1, "one line: {err}");
    assert!(!err.contains("panicked") && !err.contains("backtrace"), "{err}");
}

#[test]
fn each_invalid_adapter_stops_the_command_naming_it() {
    let cases = cases();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"input_ids\": [1]}\n").unwrap();
    let output = dir.path().join("out.jsonl");
    let base = fixtures().join("base");
    for name in cases["invalid_adapters"].as_object().unwrap().keys() {
        let src = fixtures().join("invalid_adapters").join(name);
        let lora = format!("bad-{name}={}", src.display());
        let out = multilora(&[
            "generate",
            "--model",
            base.to_str().unwrap(),
            "--lora",
            &lora,
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ]);
        assert_one_clean_line(&out);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("bad-{name}")), "{name}: {err}");
        assert!(err.contains(src.to_str().unwrap()), "{name}: names the file: {err}");
        assert_eq!(std::fs::read_to_string(&output).unwrap_or_default(), "", "{name}: no request ran");
    }
}

/// `--device cuda:0` for `generate` and `serve` on the fixture model, with a valid input.
fn run_on_cuda_device() -> Vec<Output> {
    let dir = tempfile::tempdir().unwrap();
    let base = fixtures().join("base");
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"input_ids\": [1]}\n").unwrap();
    let output = dir.path().join("out.jsonl");
    let (base, input, output) = (base.to_str().unwrap(), input.to_str().unwrap(), output.to_str().unwrap());
    vec![
        multilora(&["generate", "--model", base, "--input", input, "--output", output, "--device", "cuda:0"]),
        multilora(&["serve", "--model", base, "--port", "0", "--device", "cuda:0"]),
    ]
}

/// A build without the `cuda` feature says in one line how to get one, and exits 2.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_device_without_the_feature_says_how_to_rebuild() {
    for out in run_on_cuda_device() {
        assert_one_clean_line(&out);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--device cuda:0") && err.contains("built without CUDA support"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
    }
}

/// A `cuda` build on a machine without a GPU says no device was found, in one line, and exits 2.
#[cfg(feature = "cuda")]
#[test]
fn cuda_device_without_a_gpu_says_none_was_found() {
    if candle_core::Device::new_cuda(0).is_ok() {
        println!("SKIPPED cuda_device_without_a_gpu_says_none_was_found: this machine has a CUDA device");
        return;
    }
    for out in run_on_cuda_device() {
        assert_one_clean_line(&out);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--device cuda:0: no CUDA device found"), "{err}");
    }
}

#[test]
fn bad_input_is_one_line_and_status_two() {
    let dir = tempfile::tempdir().unwrap();
    let base = fixtures().join("base");
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let run = || {
        multilora(&[
            "generate",
            "--model",
            base.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ])
    };
    let out = run();
    assert_one_clean_line(&out); // the input file does not exist
    std::fs::write(&input, "{\"input_ids\": [1]}\n{not json\n").unwrap();
    let out = run();
    assert_one_clean_line(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
    std::fs::write(&input, "[1, 2]\n").unwrap();
    assert_one_clean_line(&run());
    let out = multilora(&["plan", "--model", dir.path().join("missing").to_str().unwrap()]);
    assert_one_clean_line(&out);
}

#[test]
fn plan_reproduces_the_seed_figures() {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 100000,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"});
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let plan = |extra: &[&str]| {
        let mut args = vec!["plan", "--model", dir.path().to_str().unwrap()];
        args.extend(extra);
        let out = multilora(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = plan(&[]);
    for want in [
        "base weights:                 14.53 GiB",
        "rank 8 :       40 MiB",
        "rank 16:       80 MiB",
        "rank 64:       320 MiB",
        "100 adapters at rank 16:      7.81 GiB",
        "slots (4 x rank 16):          0.31 GiB",
        "KV cache per token:           131,072 bytes",
        "100 full fine-tuned copies:   1,453 GiB",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    // (80 GiB - 7,798,788,096 values x 2 bytes - 4 x 80 MiB) / 128 KiB per token, rounded down.
    assert!(text.contains("KV tokens in 80.00 GiB after base and slots: 533,799"), "{text}");
    for (n, r, want) in [("8", "16", "0.625 GiB"), ("4", "64", "1.25 GiB"), ("16", "64", "5.00 GiB")] {
        let text = plan(&["--max-loras", n, "--max-lora-rank", r]);
        assert!(text.contains(&format!("slots ({n} x rank {r}):")) && text.contains(want), "{want}:\n{text}");
    }
    let with_embed =
        plan(&["--target-modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,embed_tokens"]);
    assert!(with_embed.contains("rank 16:       83.18 MiB"), "{with_embed}");
    let f32_text = plan(&["--dtype", "f32"]);
    assert!(f32_text.contains("29.05 GiB"), "{f32_text}");
}

#[test]
fn demo_builds_once_and_shows_the_contrast() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().to_str().unwrap();
    let run = || {
        let out = multilora(&["demo", "--cache-dir", cache, "--requests", "24", "--max-tokens", "4"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
    };
    let (first, err) = run();
    assert!(err.contains("building the demo model"), "{err}");
    for want in
        ["== max_loras 4 ==", "== max_loras 1 ==", "prefix-cache hit rate", "adapter tier moves", "=> with 4 slots"]
    {
        assert!(first.contains(want), "missing {want:?}:\n{first}");
    }
    // Exact figures: every step counted, TTFT from the requests' own clocks.
    assert!(!first.contains("sampled"), "{first}");
    let steps: Vec<u64> = first
        .lines()
        .filter_map(|l| l.strip_prefix("engine steps:"))
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert!(steps.len() == 2 && steps.iter().all(|&s| s >= 4), "{first}");
    assert!(first.contains("(failed requests: 0)") && first.contains("time to first token:       p50"), "{first}");
    let model = std::fs::read(dir.path().join("v2/model.safetensors")).unwrap();
    let (_, err) = run();
    assert!(!err.contains("building"), "the second run reuses the cache: {err}");
    // No arguments at all is the demo with its defaults (300 requests); here only check it starts.
    let out = Command::new(env!("CARGO_BIN_EXE_multilora")).args(["demo", "--requests", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "--requests 0 is bad input");
    assert_eq!(std::fs::read(dir.path().join("v2/model.safetensors")).unwrap(), model);
    // Deterministic: a fresh build writes the same bytes.
    let other = tempfile::tempdir().unwrap();
    let out =
        multilora(&["demo", "--cache-dir", other.path().to_str().unwrap(), "--requests", "1", "--max-tokens", "1"]);
    assert!(out.status.success());
    assert_eq!(std::fs::read(other.path().join("v2/model.safetensors")).unwrap(), model);
}

/// A run whose requests failed for the engine's own reason (its loop panicked: the fail point,
/// set through FAILPOINTS) writes every error line and exits 1, not 0.
#[test]
fn generate_exits_non_zero_when_the_engine_fails() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    std::fs::write(
        &input,
        "{\"id\": 1, \"input_ids\": [1, 2, 3], \"max_tokens\": 2}\n{\"id\": 2, \"prompt\": \"hi\"}\n",
    )
    .unwrap();
    let base = fixtures().join("base");
    let out = Command::new(env!("CARGO_BIN_EXE_multilora"))
        .args(["generate", "--model", base.to_str().unwrap(), "--input", input.to_str().unwrap()])
        .args(["--output", output.to_str().unwrap()])
        .env("FAILPOINTS", "engine-step=panic(injected)")
        .output()
        .expect("run multilora");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("internal reason"), "{stderr}");
    let lines: Vec<Value> =
        std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "every line is written");
    for l in &lines {
        assert_eq!(l["error"]["kind"], "internal", "{l}");
        assert!(l["error"]["message"].as_str().unwrap().contains("injected"), "{l}");
    }
}

/// `generate` on a bf16 checkpoint (the fixture's base rounded to bf16, `config.json` naming
/// `bfloat16`) with no `--dtype`: served in bf16, as the start-up log says with the kernels'
/// instruction set, and every request answered.
#[test]
fn generate_serves_a_bf16_checkpoint_in_bf16() {
    use candle_core::{DType, Device};
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base-bf16");
    std::fs::create_dir_all(&base).unwrap();
    let from = fixtures().join("base");
    let tensors = candle_core::safetensors::load(from.join("model.safetensors"), &Device::Cpu).unwrap();
    let bf16: std::collections::HashMap<_, _> =
        tensors.into_iter().map(|(k, t)| (k, t.to_dtype(DType::BF16).unwrap())).collect();
    candle_core::safetensors::save(&bf16, base.join("model.safetensors")).unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    cfg["dtype"] = json!("bfloat16");
    std::fs::write(base.join("config.json"), cfg.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(from.join(f), base.join(f)).unwrap();
    }
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    std::fs::write(&input, "{\"id\": 1, \"input_ids\": [1, 294, 488], \"max_tokens\": 4, \"ignore_eos\": true}\n")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_multilora"))
        .args(["generate", "--model", base.to_str().unwrap(), "--input", input.to_str().unwrap()])
        .args(["--output", output.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .output()
        .expect("run multilora");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let ready = stderr.lines().find(|l| l.contains("multilora engine ready")).unwrap_or_default();
    assert!(ready.contains("dtype=BF16") && ready.contains("over BF16 weights"), "{stderr}");
    let line: Value = serde_json::from_str(std::fs::read_to_string(&output).unwrap().trim()).unwrap();
    assert_eq!(line["output_ids"].as_array().map(Vec::len), Some(4), "{line}");
}
