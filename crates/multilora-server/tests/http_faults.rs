//! Every error status the server answers (404 model_not_found, 400 with the field named, 400
//! prompt too long, 401, 429, the adapter endpoints' 404 when updating is off), runtime adapter
//! load / reload / unload while other streams run (an accepted stream finishes on the adapter it
//! was accepted with; a load into a pinned CPU tier succeeds and serves once room frees), a
//! client disconnect that frees its request, `/health` (503) and requests (503 `shutdown`) once
//! the engine has stopped, and refusals that come before any stream byte while a valid stream's
//! headers go out at once.

mod common;

use std::path::Path;

use anyhow::Result;
use common::{BASE, Server, builder, copy_dir, hold, path, sse_events, value};
use multilora_adapter::{ModelShapes, SyntheticAdapter};
use multilora_server::ServerConfig;
use multilora_types::ModuleKind;
use serde_json::{Value, json};

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_status_in_openai_shape() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    let (status, body) = server.post("/v1/completions", &json!({"model": "nope", "prompt": "hi"})).await?;
    assert_eq!((status, code(&body)), (404, "model_not_found"), "{body}");
    assert_eq!(body["error"]["type"], "not_found_error");
    assert!(body["error"]["message"].as_str().unwrap().contains("nope"));

    let (status, body) =
        server.post("/v1/completions", &json!({"model": BASE, "prompt": "hi", "temperature": "hot"})).await?;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("temperature")), "{body}");
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "hi"})).await?;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("model"), "{body}");
    let (status, body) = server.post("/v1/completions", &json!({"model": BASE, "prompt": "hi", "top_p": 0})).await?;
    assert_eq!((status, code(&body)), (400, "invalid_request"), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("top_p"), "{body}");
    let resp = server.client.post(format!("{}/v1/completions", server.url)).body("{not json").send().await?;
    assert_eq!(resp.status(), 400);

    let long: Vec<u32> = (0..600).map(|i| 3 + i % 400).collect();
    let (status, body) = server.post("/v1/completions", &json!({"model": BASE, "prompt": long})).await?;
    assert_eq!((status, code(&body)), (400, "prompt_too_long"), "{body}");

    // The fixture model has no chat template and none was given.
    let chat = json!({"model": BASE, "messages": [{"role": "user", "content": "hi"}]});
    let (status, body) = server.post("/v1/chat/completions", &chat).await?;
    assert_eq!((status, code(&body)), (400, "no_chat_template"), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("--chat-template"));

    // Runtime updating is off: the adapter endpoints do not exist, as in vLLM.
    let (status, _) = server.post("/v1/load_lora_adapter", &json!({"lora_name": "x", "lora_path": "/tmp"})).await?;
    assert_eq!(status, 404);
    let (status, _) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "qv_r8"})).await?;
    assert_eq!(status, 404);

    // Every failure above affected only itself.
    let (status, body) =
        server.post("/v1/completions", &json!({"model": "qv_r8", "prompt": "hi", "max_tokens": 3})).await?;
    assert_eq!(status, 200, "{body}");
    server.wait_idle().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_and_overload() -> Result<()> {
    let config = ServerConfig::default().api_key("sekrit").max_waiting_requests(0);
    let server = Server::start(builder().max_num_seqs(1), config).await?;
    let url = format!("{}/v1/completions", server.url);
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2});
    for auth in [None, Some("Bearer wrong"), Some("sekrit")] {
        let mut req = server.client.post(&url).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await?;
        assert_eq!(resp.status(), 401, "{auth:?}");
        let err: Value = resp.json().await?;
        assert_eq!(code(&err), "invalid_api_key");
    }
    assert_eq!(server.get("/health").await?.0, 200, "health needs no key");
    assert_eq!(server.get("/metrics").await?.0, 200, "metrics need no key");

    // One request may be in flight (max_num_seqs 1, no waiting): a second one gets 429.
    let long = json!({"model": BASE, "prompt": "hi", "max_tokens": 300, "ignore_eos": true, "stream": true});
    let held = server.client.post(&url).bearer_auth("sekrit").json(&long).send().await?;
    assert_eq!(held.status(), 200);
    let resp = server.client.post(&url).bearer_auth("sekrit").json(&body).send().await?;
    assert_eq!(resp.status(), 429);
    let err: Value = resp.json().await?;
    assert_eq!(code(&err), "rate_limit_exceeded");
    drop(held);
    server.wait_idle().await?;
    let resp = server.client.post(&url).bearer_auth("sekrit").json(&body).send().await?;
    assert_eq!(resp.status(), 200, "admitted again once the first left");
    server.stop().await
}

/// Greedy text of `model` for the test prompt.
async fn greedy(server: &Server, model: &str) -> Result<(u16, Value)> {
    let body = json!({"model": model, "prompt": "The capital of France", "max_tokens": 8, "temperature": 0,
                      "ignore_eos": true});
    server.post("/v1/completions", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reload_unload_while_streams_run() -> Result<()> {
    let roots = tempfile::tempdir()?;
    let root = roots.path();
    copy_dir(&path("adapters/qv_r8"), &root.join("v1"))?;
    copy_dir(&path("adapters/all_r16"), &root.join("v2"))?;
    copy_dir(&path("adapters/qv_r8"), &root.join("truncated"))?;
    let st = root.join("truncated/adapter_model.safetensors");
    let bytes = std::fs::read(&st)?;
    std::fs::write(&st, &bytes[..bytes.len() / 2])?;
    copy_dir(&path("invalid_adapters/dora"), &root.join("dora"))?;
    let shapes = ModelShapes::llama(4, 128, 352, 512, 4, 2);
    SyntheticAdapter::new(64, &[ModuleKind::QProj], 7).write(&root.join("rank64"), &shapes)?;

    let engine = builder().allow_runtime_lora_updating(true).allowed_lora_root(root);
    let server = Server::start(engine, ServerConfig::default()).await?;
    let url = format!("{}/v1/completions", server.url);

    // Streams that run through everything below.
    let mut running = Vec::new();
    for model in ["all_r16", "rank32", BASE] {
        let body = json!({"model": model, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": true,
                          "temperature": 0, "stream": true});
        let resp = server.client.post(&url).json(&body).send().await?;
        assert_eq!(resp.status(), 200);
        running.push(tokio::spawn(sse_events(resp)));
    }

    let load = |name: &str, dir: &Path, inplace: bool| json!({"lora_name": name, "lora_path": dir.display().to_string(), "load_inplace": inplace});
    let (status, body) = server.post("/v1/load_lora_adapter", &load("fresh", &root.join("v1"), false)).await?;
    assert_eq!(status, 200, "{body}");
    let (status, first) = greedy(&server, "fresh").await?;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["choices"][0]["text"], greedy(&server, "qv_r8").await?.1["choices"][0]["text"]);
    let listed = server.get("/v1/models").await?.1;
    assert!(listed.contains("\"fresh\""), "{listed}");

    let (status, body) = server.post("/v1/load_lora_adapter", &load("fresh", &root.join("v2"), false)).await?;
    assert_eq!((status, code(&body)), (400, "invalid_request"), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("load_inplace"), "{body}");
    let (status, body) = server.post("/v1/load_lora_adapter", &load("fresh", &root.join("v2"), true)).await?;
    assert_eq!(status, 200, "{body}");
    let (_, second) = greedy(&server, "fresh").await?;
    assert_ne!(second["choices"][0]["text"], first["choices"][0]["text"], "new weights, new output");
    assert_eq!(second["choices"][0]["text"], greedy(&server, "all_r16").await?.1["choices"][0]["text"]);

    for (name, dir, needle) in [
        ("bad1", root.join("truncated"), "is truncated"),
        ("bad2", root.join("dora"), "dora is not supported"),
        ("bad3", root.join("rank64"), "exceeds max_lora_rank 32"),
        ("bad4", root.join("missing"), "neither an existing local directory"),
        ("bad5", std::path::PathBuf::from("/etc"), "outside the allowed roots"),
    ] {
        let (status, body) = server.post("/v1/load_lora_adapter", &load(name, &dir, false)).await?;
        assert_eq!(status, 400, "{name}: {body}");
        let msg = body["error"]["message"].as_str().unwrap().to_lowercase();
        assert!(msg.contains(needle), "{name}: {msg}");
        assert_eq!(greedy(&server, name).await?.0, 404, "{name} is not served after a failed load");
    }

    // A failed in-place reload is rolled back: the version before it keeps serving.
    for bad in ["truncated", "dora", "rank64"] {
        let (status, body) = server.post("/v1/load_lora_adapter", &load("fresh", &root.join(bad), true)).await?;
        assert_eq!(status, 400, "{bad}: {body}");
        let (status, now) = greedy(&server, "fresh").await?;
        assert_eq!(status, 200, "{bad}: {now}");
        assert_eq!(now["choices"][0]["text"], second["choices"][0]["text"], "after the failed {bad} reload");
    }

    let (status, body) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "fresh"})).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(greedy(&server, "fresh").await?.0, 404);
    let (status, body) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "fresh"})).await?;
    assert_eq!((status, code(&body)), (404, "model_not_found"), "{body}");

    for r in running {
        let events = r.await??;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let finish = events
            .iter()
            .rev()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(String::from));
        assert_eq!(finish.as_deref(), Some("length"), "the other streams ran to the end");
    }
    server.wait_idle().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_cancels_the_request_and_frees_everything() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    for model in ["pattern_r8", BASE] {
        let body = json!({"model": model, "prompt": "hello", "max_tokens": 400, "ignore_eos": true, "stream": true});
        let mut resp = server.client.post(format!("{}/v1/completions", server.url)).json(&body).send().await?;
        assert_eq!(resp.status(), 200);
        let first = resp.chunk().await?;
        assert!(first.is_some_and(|c| c.starts_with(b"data: ")));
        let s = server.scrape_until(|s| value(s, "vllm:num_requests_running", &[]) == 1.0).await?;
        assert_eq!(value(&s, "vllm:num_requests_running", &[]), 1.0);
        drop(resp);
        let s = server.wait_idle().await?;
        assert!(value(&s, "vllm:generation_tokens", &[]) < 400.0, "cancelled before the end");
    }
    // A non-streamed request whose client goes away is cancelled too (the handler is dropped).
    let body = json!({"model": "qv_r8", "prompt": "hello", "max_tokens": 480, "ignore_eos": true}).to_string();
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr).await?;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, format!("{head}{body}").as_bytes()).await?;
    let start = std::time::Instant::now();
    while value(&server.scrape().await?, "vllm:num_requests_running", &[]) == 0.0 {
        assert!(start.elapsed().as_secs() < 10, "the request never started");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    drop(conn);
    let s = server.wait_idle().await?;
    assert_eq!(value(&s, "vllm:request_success", &[("finished_reason", "abort")]), 3.0);
    assert_eq!(value(&s, "vllm:request_success", &[("finished_reason", "length")]), 0.0);
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_requests_once_the_engine_stops() -> Result<()> {
    let mut server = Server::start(builder(), ServerConfig::default()).await?;
    assert_eq!(server.get("/health").await?.0, 200);
    let engine = server.engine.take().expect("engine");
    tokio::task::spawn_blocking(move || engine.shutdown()).await?;
    assert_eq!(server.get("/health").await?.0, 503);
    let (status, body) = server.post("/v1/completions", &json!({"model": BASE, "prompt": "hi"})).await?;
    assert_eq!((status, code(&body)), (503, "shutdown"), "{body}");
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_come_before_any_stream_byte_and_streams_start_at_once() -> Result<()> {
    let server = Server::start(builder().max_num_seqs(1), ServerConfig::default()).await?;
    let url = format!("{}/v1/completions", server.url);
    let too_long: Vec<u32> = (0..600).map(|i| 3 + i % 400).collect();
    for stream in [false, true] {
        for (body, status, want) in [
            (json!({"model": "nope", "prompt": "hi", "stream": stream}), 404, "model_not_found"),
            (json!({"model": BASE, "prompt": too_long, "stream": stream}), 400, "prompt_too_long"),
        ] {
            let resp = server.client.post(&url).json(&body).send().await?;
            assert_eq!(resp.status(), status, "stream {stream}: {body}");
            let kind = resp.headers()["content-type"].to_str()?.to_string();
            assert!(kind.starts_with("application/json"), "an error body, not a stream: {kind}");
            let err: Value = resp.json().await?;
            assert_eq!(code(&err), want, "{err}");
        }
    }

    // One sequence at a time and the engine busy with a long request: a valid stream with a long
    // prompt waits behind it, and its headers arrive while it still waits, before its first token.
    let blockers = hold(server.engine(), BASE, 8)?;
    let long: Vec<u32> = (0..300).map(|i| 3 + (i * 7) % 400).collect();
    let body = json!({"model": "qv_r8", "prompt": long, "max_tokens": 2, "stream": true});
    let resp = server.client.post(&url).json(&body).send().await?;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str()?.starts_with("text/event-stream"));
    let both = |s: &common::Scrape| {
        value(s, "vllm:num_requests_running", &[]) + value(s, "vllm:num_requests_waiting", &[]) == 8.0 + 1.0
    };
    let s = server.scrape_until(both).await?;
    let (running, waiting) = (value(&s, "vllm:num_requests_running", &[]), value(&s, "vllm:num_requests_waiting", &[]));
    // Every request is in the engine, at most one blocker runs: the stream's request still
    // waits, nothing of it computed, and its headers are here.
    assert!(
        running + waiting == 9.0 && running <= 1.0,
        "the stream's headers came while it still waited: {running} running, {waiting} waiting"
    );
    drop(blockers);
    let events = sse_events(resp).await?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let tokens: Vec<Value> = events.iter().filter_map(|e| serde_json::from_str::<Value>(e).ok()).collect();
    assert!(tokens.iter().any(|c| c["choices"][0]["finish_reason"] == "length"), "{events:?}");
    server.wait_idle().await?;
    server.stop().await
}

/// `/v1/completions` without `max_tokens` generates 16 tokens, OpenAI's and vLLM's default, not
/// the rest of the context; an explicit `max_tokens` still wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_default_to_sixteen_tokens() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    for (body, want) in [
        (json!({"model": BASE, "prompt": "hi", "ignore_eos": true}), 16),
        (json!({"model": BASE, "prompt": "hi", "ignore_eos": true, "max_tokens": 20}), 20),
    ] {
        let (status, v) = server.post("/v1/completions", &body).await?;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], want, "{body}: {v}");
    }
    server.wait_idle().await?;
    server.stop().await
}

/// The text of an SSE stream of one choice, checked to have ended well: every event parsed, no
/// error event, finished for its length, `[DONE]` last.
async fn stream_text(resp: reqwest::Response) -> Result<String> {
    let events = sse_events(resp).await?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let mut text = String::new();
    let mut finish = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e)?;
        assert!(v.get("error").is_none(), "an accepted stream failed: {v}");
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        finish = finish.or(v["choices"][0]["finish_reason"].as_str().map(String::from));
    }
    assert_eq!(finish.as_deref(), Some("length"), "{events:?}");
    Ok(text)
}

/// Streams accepted (headers sent) for two runtime adapters, one then unloaded and one reloaded
/// with other weights before their first token: both finish, with the text of the weights they
/// were accepted with, as vLLM's in-flight requests keep the adapter they were accepted with.
/// (Before, a stream accepted just before an unload failed mid-stream with `model_not_found`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_stream_finishes_on_its_generation_after_an_unload_or_a_reload() -> Result<()> {
    let roots = tempfile::tempdir()?;
    let root = roots.path();
    copy_dir(&path("adapters/qv_r8"), &root.join("v1"))?;
    copy_dir(&path("adapters/all_r16"), &root.join("v2"))?;
    let engine = builder().max_num_seqs(1).allow_runtime_lora_updating(true).allowed_lora_root(root);
    let server = Server::start(engine, ServerConfig::default()).await?;
    let v1 = root.join("v1").display().to_string();
    for name in ["x", "y"] {
        let (status, body) = server.post("/v1/load_lora_adapter", &json!({"lora_name": name, "lora_path": v1})).await?;
        assert_eq!(status, 200, "{body}");
    }
    let want = greedy(&server, "qv_r8").await?.1["choices"][0]["text"].as_str().unwrap_or_default().to_string();
    // One sequence at a time, and the engine busy: both streams are accepted and wait.
    let blockers = hold(server.engine(), BASE, 8)?;
    let url = format!("{}/v1/completions", server.url);
    let mut streams = Vec::new();
    for name in ["x", "y"] {
        let body = json!({"model": name, "prompt": "The capital of France", "max_tokens": 8, "temperature": 0,
                          "ignore_eos": true, "stream": true});
        let resp = server.client.post(&url).json(&body).send().await?;
        assert_eq!(resp.status(), 200);
        streams.push(resp);
    }
    let s = server.scrape_until(|s| value(s, "vllm:num_requests_waiting", &[]) == 7.0 + 2.0).await?;
    assert_eq!(value(&s, "vllm:num_requests_waiting", &[]), 9.0, "both wait behind the blockers");
    let (status, body) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "x"})).await?;
    assert_eq!(status, 200, "{body}");
    let reload = json!({"lora_name": "y", "lora_path": root.join("v2").display().to_string(), "load_inplace": true});
    let (status, body) = server.post("/v1/load_lora_adapter", &reload).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(greedy(&server, "x").await?.0, 404, "new requests see the unload");
    drop(blockers);
    for resp in streams {
        assert_eq!(stream_text(resp).await?, want, "finished on the weights it was accepted with");
    }
    let (_, now) = greedy(&server, "y").await?;
    assert_eq!(now["choices"][0]["text"], greedy(&server, "all_r16").await?.1["choices"][0]["text"]);
    let s = server.wait_idle().await?;
    assert_eq!(value(&s, "multilora_request_errors", &[]), 0.0, "no request failed in the engine");
    server.stop().await
}

/// With every host-memory entry pinned by running requests (`--max-loras 2 --max-cpu-loras 2`),
/// `/v1/load_lora_adapter` and an in-place reload answer 200, saying the adapter is cached once
/// an entry frees; a request for it waits, and is served on the reloaded weights once room
/// frees. (Before, both answered 400 "all 2 entries of the cpu tier are pinned".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_into_a_pinned_cpu_tier_succeed_and_serve_once_room_frees() -> Result<()> {
    let roots = tempfile::tempdir()?;
    let root = roots.path();
    copy_dir(&path("adapters/rslora_r4"), &root.join("v1"))?;
    copy_dir(&path("adapters/all_r16"), &root.join("v2"))?;
    let engine = builder().max_loras(2).max_cpu_loras(2).allow_runtime_lora_updating(true).allowed_lora_root(root);
    let server = Server::start(engine, ServerConfig::default()).await?;
    let url = format!("{}/v1/completions", server.url);
    let mut running = Vec::new();
    for model in ["qv_r8", "pattern_r8"] {
        let body = json!({"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true,
                          "stream": true});
        let mut resp = server.client.post(&url).json(&body).send().await?;
        assert_eq!(resp.status(), 200);
        assert!(resp.chunk().await?.is_some(), "{model} runs");
        running.push(resp);
    }
    let pinned = |s: &common::Scrape| value(s, "multilora_pinned_slots", &[]) == 2.0;
    assert!(pinned(&server.scrape_until(pinned).await?), "both entries pinned by running requests");
    let load = |inplace: bool, dir: &str| json!({"lora_name": "fresh", "lora_path": root.join(dir).display().to_string(), "load_inplace": inplace});
    for body in [load(false, "v1"), load(true, "v2")] {
        let (status, reply) = server.post("/v1/load_lora_adapter", &body).await?;
        assert_eq!(status, 200, "{body}: {reply}");
        assert!(reply.as_str().is_some_and(|r| r.contains("cached once one frees")), "{reply}");
    }
    let listed = server.get("/v1/models").await?.1;
    assert!(listed.contains("\"fresh\""), "{listed}");
    let waiting = tokio::spawn({
        let (client, url) = (server.client.clone(), url.clone());
        let body = json!({"model": "fresh", "prompt": "The capital of France", "max_tokens": 8, "temperature": 0,
                          "ignore_eos": true});
        async move { client.post(url).json(&body).send().await?.json::<Value>().await }
    });
    let s = server.scrape_until(|s| value(s, "vllm:num_requests_waiting", &[]) == 1.0).await?;
    assert_eq!(value(&s, "multilora_adapter_loads_waiting", &[]), 1.0, "the reloaded version waits for room");
    drop(running);
    let answer = waiting.await??;
    let want = greedy(&server, "all_r16").await?.1["choices"][0]["text"].clone();
    assert_eq!(answer["choices"][0]["text"], want, "served on the reloaded weights: {answer}");
    let s = server.wait_idle().await?;
    assert_eq!(value(&s, "multilora_adapter_loads_waiting", &[]), 0.0);
    assert_eq!(value(&s, "multilora_request_errors", &[]), 0.0, "no request failed in the engine");
    server.stop().await
}
