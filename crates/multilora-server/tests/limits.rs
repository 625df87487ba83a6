//! The server's bounds, each hit on purpose: prompts × `n` beyond the per-request cap (400) or
//! the in-flight budget (429), counted before any request is built; stop lists beyond their
//! count and length (400 naming the limit) and at the limit (served), refused before the `n`
//! choices are built; fields that would change the output refused by name; a runtime adapter
//! path outside the allowed roots answered alike whatever is there; a client that sends its
//! headers too slowly dropped; `/metrics` behind the API key when asked.

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use common::{BASE, Server, builder};
use multilora::{MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS};
use multilora_server::{ServeOptions, ServerConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_is_counted_before_it_is_built() -> Result<()> {
    let config = ServerConfig::default().max_choices_per_request(16).max_waiting_requests(0);
    let server = Server::start(builder().max_num_seqs(4), config).await?;
    let prompts = |k: usize| (0..k).map(|i| vec![1u32, 5 + i as u32]).collect::<Vec<_>>();
    // 4 prompts × n 5 = 20 > 16 per request: 400, naming n.
    let body = json!({"model": BASE, "prompt": prompts(4), "n": 5, "max_tokens": 2});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("n")), "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("at most 16"), "{err}");
    // A huge fan-out is refused the same way, at once (nothing was built to refuse it).
    let body = json!({"model": BASE, "prompt": prompts(2000), "n": 128, "max_tokens": 2});
    let started = Instant::now();
    let (status, _) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 400);
    assert!(started.elapsed() < Duration::from_secs(10));
    // 3 × 2 = 6 within the cap but beyond the 4 the engine may hold: 429.
    let body = json!({"model": BASE, "prompt": prompts(3), "n": 2, "max_tokens": 2});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, code(&err)), (429, "rate_limit_exceeded"), "{err}");
    // 2 × 2 fits.
    let body = json!({"model": BASE, "prompt": prompts(2), "n": 2, "max_tokens": 2});
    let (status, ok) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["choices"].as_array().map(Vec::len), Some(4));
    server.wait_idle().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_lists_are_bounded_and_served_at_the_limit() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    let stops = |n: usize, len: usize| (0..n).map(|i| format!("{i:04}{}", "z".repeat(len - 4))).collect::<Vec<_>>();
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 4, "stop": stops(MAX_STOP_STRINGS + 1, 8)});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, code(&err)), (400, "invalid_request"), "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains(&format!("at most {MAX_STOP_STRINGS}")), "{err}");
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 4, "stop": stops(1, MAX_STOP_STRING_BYTES + 1)});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains(&format!("{MAX_STOP_STRING_BYTES} bytes")), "{err}");
    let too_many_ids: Vec<u32> = (0..2000).map(|i| i % 100).collect();
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 4, "stop_token_ids": too_many_ids});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("stop_token_ids"), "{err}");
    // At the limit: served, with the same text as without the (never matching) stops.
    let plain = json!({"model": BASE, "prompt": "Once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let mut limited = plain.clone();
    limited["stop"] = json!(stops(MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES));
    let (s1, a) = server.post("/v1/completions", &plain).await?;
    let (s2, b) = server.post("/v1/completions", &limited).await?;
    assert_eq!((s1, s2), (200, 200), "{b}");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    // And a stop taken from the text itself cuts it there.
    let text = a["choices"][0]["text"].as_str().unwrap().to_string();
    let cut: String = text.chars().skip(3).take(3).collect();
    if !cut.trim().is_empty() {
        let mut stopping = plain.clone();
        stopping["stop"] = json!([cut.clone()]);
        let (_, c) = server.post("/v1/completions", &stopping).await?;
        let got = c["choices"][0]["text"].as_str().unwrap();
        assert_eq!(got, &text[..text.find(&cut).unwrap()], "{c}");
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
    }
    server.wait_idle().await?;
    server.stop().await
}

/// 80,000 stop strings (or 200,000 stop token ids) with `n` 128: refused by name before the
/// list is copied into the engine's parameters, let alone into 128 choices (the refusal names the
/// field, which only the check ahead of the fan-out does); a parameter only the engine checks is
/// refused once, before the fan-out, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_are_refused_before_the_fan_out() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    let stops: Vec<String> = (0..80_000).map(|i| format!("{i}")).collect();
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2, "n": 128, "stop": stops});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("stop")), "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("got 80000"), "{err}");
    let ids: Vec<u32> = (0..200_000).map(|i| i % 100).collect();
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2, "n": 128, "stop_token_ids": ids});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("stop_token_ids")), "{err}");
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2, "n": 128, "top_p": 0});
    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, code(&err)), (400, "invalid_request"), "{err}");
    let s = server.scrape().await?;
    assert_eq!(common::value(&s, "vllm:prompt_tokens", &[]), 0.0, "no choice reached the engine");
    server.stop().await
}

/// A runtime adapter path outside the allowed roots gets one answer whether it is a missing
/// directory, an existing directory or an existing file, and the answer does not list the
/// roots: nothing about the file system outside them can be learnt from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_outside_the_roots_gets_one_answer() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("loras");
    std::fs::create_dir_all(&root)?;
    std::fs::create_dir_all(tmp.path().join("dir"))?;
    std::fs::write(tmp.path().join("file"), "x")?;
    let engine = builder().allow_runtime_lora_updating(true).allowed_lora_root(&root);
    let server = Server::start(engine, ServerConfig::default()).await?;
    let mut answers = Vec::new();
    for path in [tmp.path().join("missing"), tmp.path().join("dir"), tmp.path().join("file")] {
        let path = path.display().to_string();
        let (status, err) = server.post("/v1/load_lora_adapter", &json!({"lora_name": "x", "lora_path": path})).await?;
        let message = err["error"]["message"].as_str().unwrap_or_default().replace(&path, "P");
        answers.push((status, code(&err).to_string(), message));
    }
    assert_eq!(answers[0].0, 400, "{answers:?}");
    assert!(answers.iter().all(|a| a == &answers[0]), "one answer: {answers:?}");
    assert!(answers[0].2.contains("outside the allowed roots"), "{answers:?}");
    assert!(!answers[0].2.contains(&root.display().to_string()), "the roots are not listed: {answers:?}");
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_that_would_change_the_output_are_refused() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    for (field, value) in [
        ("tools", json!([{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        ("tool_choice", json!("required")),
        ("use_beam_search", json!(true)),
        ("logits_processors", json!(["x"])),
    ] {
        let mut body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2});
        body[field] = value;
        let (status, err) = server.post("/v1/completions", &body).await?;
        assert_eq!((status, err["error"]["param"].as_str()), (400, Some(field)), "{err}");
    }
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}});
    assert_eq!(server.post("/v1/completions", &body).await?.0, 200, "plain text is the off value");
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2, "guided_choice": ["yes", "no"]});
    let (status, resp) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 200, "structured outputs are served: {resp}");
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_its_headers_too_slowly_is_dropped() -> Result<()> {
    let options = ServeOptions::default().header_read_timeout(Duration::from_millis(300));
    let server = Server::start_with(builder(), ServerConfig::default(), options).await?;
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut slow = tokio::net::TcpStream::connect(&addr).await?;
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await?; // never finishes its head
    let started = Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the connection is still open after 5 s");
    assert!(started.elapsed() >= Duration::from_millis(250), "closed before the timeout");
    assert!(!String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf));
    // Everyone else is served.
    assert_eq!(server.get("/health").await?.0, 200);
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_require_the_api_key() -> Result<()> {
    let config = ServerConfig::default().api_key("sekrit").metrics_need_key(true);
    let server = Server::start(builder(), config).await?;
    assert_eq!(server.get("/metrics").await?.0, 401);
    let resp = server.client.get(format!("{}/metrics", server.url)).bearer_auth("sekrit").send().await?;
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await?.contains("multilora_engine_up"));
    assert_eq!(server.get("/health").await?.0, 200, "health stays open");
    server.stop().await
}
