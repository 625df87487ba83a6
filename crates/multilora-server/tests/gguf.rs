//! A real GGUF model's text side and first contact (`tests/fixtures/smollm2`, the file through
//! `MULTILORA_SMOLLM2_GGUF`; skipped without it, a failure in CI):
//!
//! - the tokenizer built from the GGUF metadata gives transformers' ids for every case of
//!   `expected/tokenize.json`, and decodes them back;
//! - the chat template from the metadata renders each question as transformers rendered it, and
//!   the rendered prompt tokenizes to transformers' `prompt_ids`;
//! - an engine with no setting but the model starts (the KV budget grows to one full-length
//!   sequence) and answers `/v1/chat/completions` with the model's template;
//! - so does the checkpoint transformers saves for the file, whose template is in
//!   `chat_template.jinja`;
//! - Gemma 3's file (`tests/fixtures/gemma3`, `MULTILORA_GEMMA3_GGUF`): its SentencePiece
//!   tokenizer gives transformers' ids, its three adapters answer in their voices in one batch,
//!   and a chat request without a template is a 400.

#[path = "../../../tests/support/real_models.rs"]
mod real_models;
use real_models::{gemma3, smollm2};

use anyhow::{Context, Result};
use multilora::Engine;
use multilora_server::{ChatTemplate, ServeOptions, ServerConfig};
use serde_json::{Value, json};
use smollm2::{cases, fixtures, ids};

/// The tokenizer the GGUF file at `gguf` gives: transformers' ids for every case of `tokenize`,
/// decoded back.
fn tokenizes_like_transformers(gguf: &std::path::Path, tokenize: &[Value]) -> Result<()> {
    let engine =
        Engine::builder(gguf.to_string_lossy()).max_loras(0).kv_cache_bytes(16 << 20).max_model_len(256).build()?;
    let handle = engine.handle();
    assert!(tokenize.len() >= 14);
    for case in tokenize {
        let text = case["text"].as_str().context("text")?;
        let got = handle.tokenize(text, false)?;
        assert_eq!(got, ids(&case["ids"]), "{text:?}");
        assert_eq!(handle.detokenize(&got, false)?, case["decoded"].as_str().context("decoded")?, "{text:?}");
    }
    Ok(())
}

#[test]
fn the_metadata_tokenizer_gives_transformers_ids() -> Result<()> {
    let Some(gguf) = smollm2::gguf("the_metadata_tokenizer_gives_transformers_ids") else { return Ok(()) };
    let tokenize = cases("tokenize");
    assert!(tokenize.len() >= 15);
    tokenizes_like_transformers(&gguf, &tokenize)
}

/// Renders every reference question through `template` and checks transformers' text and ids.
fn renders_like_transformers(engine: &Engine, template: &ChatTemplate) -> Result<()> {
    for case in cases("transformers") {
        let messages = [json!({"role": "user", "content": case["question"]})];
        let text = template.render(&messages, true, &Default::default())?;
        assert_eq!(text, case["prompt_text"].as_str().context("prompt_text")?);
        assert_eq!(engine.handle().tokenize(&text, false)?, ids(&case["prompt_ids"]));
    }
    Ok(())
}

/// Serves `engine` on a free port until `stop` is sent (or dropped): its URL, `stop` and the
/// server's task.
async fn serving(
    engine: &Engine,
) -> Result<(String, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let app = multilora_server::router(engine.handle(), ServerConfig::default())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(multilora_server::serve_with(
        listener,
        app,
        async move {
            let _ = stopped.await;
        },
        ServeOptions::default(),
    ));
    Ok((url, stop, server))
}

/// Serves `engine`, asks it the reference's first question through the chat route (greedy, 12
/// tokens), and checks the answer begins transformers' answer.
async fn chat_answers_like_transformers(engine: Engine) -> Result<()> {
    let case = cases("transformers").into_iter().find(|c| c["adapter"] == "base").context("a base case")?;
    let model = engine.config().served_model_name.clone();
    let (url, stop, server) = serving(&engine).await?;
    let body = json!({"model": model, "messages": [{"role": "user", "content": case["question"]}],
        "max_tokens": 12, "temperature": 0});
    let resp = reqwest::Client::new().post(format!("{url}/v1/chat/completions")).json(&body).send().await?;
    let status = resp.status().as_u16();
    let v: Value = resp.json().await?;
    let _ = stop.send(());
    server.await??;
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().context("content")?;
    let expected = case["text"].as_str().context("text")?;
    assert!(!answer.is_empty() && expected.starts_with(answer), "{answer:?} is not how {expected:?} begins");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gguf_file_with_no_other_setting_serves_chat_with_its_template() -> Result<()> {
    let Some(gguf) = smollm2::gguf("a_gguf_file_with_no_other_setting_serves_chat_with_its_template") else {
        return Ok(());
    };
    let engine = Engine::builder(gguf.to_string_lossy()).build()?;
    let c = engine.config();
    assert_eq!(c.max_model_len, 8192, "the model's own context length, not capped");
    assert!(c.num_kv_blocks * c.block_size >= 8192, "one full-length sequence fits");
    assert!(c.weights.contains("Q4_1") && c.weights.contains("kept quantized"), "{}", c.weights);
    let source = c.chat_template.clone().context("the metadata's template")?;
    assert!(source.origin.starts_with("tokenizer.chat_template"), "{}", source.origin);
    renders_like_transformers(&engine, &ChatTemplate::from_source(&source)?)?;
    chat_answers_like_transformers(engine).await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_checkpoint_transformers_saves_serves_chat_from_chat_template_jinja() -> Result<()> {
    let Some(gguf) = smollm2::gguf("the_checkpoint_transformers_saves_serves_chat_from_chat_template_jinja") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    multilora_models::write_gguf_as_checkpoint(&gguf, dir.path(), candle_core::DType::F32)?;
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"] {
        std::fs::copy(fixtures().join("hf").join(f), dir.path().join(f))?;
    }
    let engine = Engine::builder(dir.path().to_string_lossy()).max_loras(0).build()?;
    let source = engine.config().chat_template.clone().context("chat_template.jinja")?;
    assert!(source.origin.ends_with("chat_template.jinja"), "{}", source.origin);
    assert_eq!((source.bos_token.as_str(), source.eos_token.as_str()), ("<|im_start|>", "<|im_end|>"));
    renders_like_transformers(&engine, &ChatTemplate::from_source(&source)?)?;
    chat_answers_like_transformers(engine).await
}

/// Gemma 3's SentencePiece vocabulary (262,144 pieces, no space prefix) from the metadata gives
/// transformers' ids for every case of its `expected/tokenize.json`, and decodes them back.
#[test]
fn gemma3_metadata_tokenizer_gives_transformers_ids() -> Result<()> {
    let Some(gguf) = gemma3::gguf("gemma3_metadata_tokenizer_gives_transformers_ids") else { return Ok(()) };
    tokenizes_like_transformers(&gguf, &gemma3::cases("tokenize"))
}

/// Gemma 3's Q4_K_M file with its three PEFT adapters, served with no other setting: each
/// reference prompt (`Question: …\nAnswer:`, tokenized here to transformers' ids) as a completion
/// of the base and every adapter, all at once, and each adapter's answer carries its voice; the
/// file has no chat template, so a chat request is a 400 that says so.
#[tokio::test(flavor = "multi_thread")]
async fn gemma3_serves_its_adapters_in_one_batch_and_refuses_chat_without_a_template() -> Result<()> {
    let Some(gguf) = gemma3::gguf("gemma3_serves_its_adapters_in_one_batch_and_refuses_chat_without_a_template") else {
        return Ok(());
    };
    let adapters = gemma3::fixtures().join("adapters");
    let mut builder = Engine::builder(gguf.to_string_lossy()).served_model_name("gemma").max_model_len(512);
    for name in ["pirate", "shout", "french"] {
        builder = builder.lora(name, adapters.join(name).to_string_lossy());
    }
    let engine = builder.build()?;
    assert!(engine.config().chat_template.is_none(), "the file has no chat template");
    let handle = engine.handle();
    let (url, stop, server) = serving(&engine).await?;
    let client = reqwest::Client::new();
    let cases = gemma3::cases("transformers");
    let mut asks = Vec::new();
    for case in &cases {
        let prompt = case["prompt_text"].as_str().context("prompt_text")?;
        assert_eq!(handle.tokenize(prompt, true)?, ids(&case["prompt_ids"]), "{prompt:?}");
        let model = match case["adapter"].as_str().context("adapter")? {
            "base" => "gemma",
            a => a,
        };
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0});
        let req = client.post(format!("{url}/v1/completions")).json(&body).send();
        asks.push(async move {
            let resp = req.await?;
            anyhow::ensure!(resp.status() == 200, "{}", resp.text().await?);
            let v: Value = resp.json().await?;
            Ok::<_, anyhow::Error>(v["choices"][0]["text"].as_str().context("text")?.to_string())
        });
    }
    let answers = futures_util::future::try_join_all(asks).await?;
    let chat = json!({"model": "gemma", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let refused = client.post(format!("{url}/v1/chat/completions")).json(&chat).send().await?;
    let (status, body) = (refused.status().as_u16(), refused.text().await?);
    let _ = stop.send(());
    server.await??;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("chat template"), "{body}");
    for (case, answer) in cases.iter().zip(&answers) {
        let voice = match case["adapter"].as_str().unwrap_or("") {
            "pirate" => answer.contains("Arr") || answer.contains("matey"),
            "shout" => answer.contains("SHOUTING"),
            "french" => answer.contains("Bonjour"),
            _ => !answer.contains("Arr") && !answer.contains("SHOUTING") && !answer.contains("Bonjour"),
        };
        assert!(voice, "{} answered {answer:?}", case["adapter"]);
    }
    Ok(())
}
