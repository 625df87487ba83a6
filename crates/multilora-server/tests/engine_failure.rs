//! A stuck and a dead engine loop, seen from outside. The loop's fail point (`engine-step`, the
//! `failpoints` feature) first makes every step sleep: `/health` answers 503 at once (it does not
//! wait on the loop), `/metrics` says `multilora_engine_up 0` without stale gauges, and the
//! server's one concurrency limit answers 503 `server_busy` beyond it; then it makes a step
//! panic: the live stream ends with an error event (never a clean `[DONE]` alone), a collected
//! request gets 503 `engine_failed`, new requests, adapter loads and `/health` get 503.
//!
//! Fail points are process-wide, so this file is its own test binary with one test.

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use common::{BASE, Server, builder, sse_events, value};
use multilora_server::ServerConfig;
use serde_json::{Value, json};

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stuck_and_then_a_dead_engine_loop_are_visible() -> Result<()> {
    let config = ServerConfig::default().health_stall_timeout(Duration::from_millis(300)).max_concurrent_requests(3);
    let engine = builder().allow_runtime_lora_updating(true).allowed_lora_root(common::path("adapters"));
    let server = Server::start(engine, config).await?;
    let url = format!("{}/v1/completions", server.url);
    assert_eq!(server.get("/health").await?.0, 200);
    assert_eq!(value(&server.scrape().await?, "multilora_engine_up", &[]), 1.0);

    // Stuck: every step sleeps 1.5 s.
    fail::cfg("engine-step", "sleep(1500)").map_err(anyhow::Error::msg)?;
    let body = json!({"model": BASE, "prompt": "hi", "max_tokens": 2});
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (client, url, body) = (server.client.clone(), url.clone(), body.clone());
            tokio::spawn(async move { client.post(url).json(&body).send().await?.json::<Value>().await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let asked = Instant::now();
    let (status, text) = server.get("/health").await?;
    assert!(asked.elapsed() < Duration::from_millis(500), "/health waited on the loop");
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("no sign of life"), "{text}");
    // Two completions hold two of the three permits, so /metrics gets the last one.
    let (status, page) = server.get("/metrics").await?;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("multilora_engine_up{model_name=\"base\"} 0"), "{page}");
    assert!(!page.contains("vllm:num_requests_running"), "a stalled loop's gauges are left out:\n{page}");
    fail::remove("engine-step");
    for h in held {
        let v = h.await??;
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    }
    server.wait_idle().await?;
    assert_eq!(server.get("/health").await?.0, 200, "alive again once the steps return");

    // Dead: the next step panics.
    fail::cfg("engine-step", "panic(injected step failure)").map_err(anyhow::Error::msg)?;
    let stream = json!({"model": BASE, "prompt": "hi", "max_tokens": 8, "stream": true});
    let resp = server.client.post(&url).json(&stream).send().await?;
    assert_eq!(resp.status(), 200, "the stream's headers go out before the step");
    let events = sse_events(resp).await?;
    let errors: Vec<&String> = events.iter().filter(|e| e.contains("engine_failed")).collect();
    assert_eq!(errors.len(), 1, "{events:?}");
    assert!(errors[0].contains("injected step failure"), "{events:?}");
    assert!(!events.iter().any(|e| e.contains("\"finish_reason\":\"")), "no normal finish: {events:?}");
    fail::remove("engine-step");

    let (status, err) = server.post("/v1/completions", &body).await?;
    assert_eq!((status, code(&err)), (503, "engine_failed"), "{err}");
    let load = json!({"lora_name": "again", "lora_path": common::path("adapters/qv_r8")});
    let (status, err) = server.post("/v1/load_lora_adapter", &load).await?;
    assert_eq!((status, code(&err)), (503, "engine_failed"), "{err}");
    let (status, text) = server.get("/health").await?;
    assert_eq!(status, 503);
    assert!(text.contains("injected step failure"), "{text}");
    let scrape = server.scrape().await?;
    assert_eq!(value(&scrape, "multilora_engine_up", &[]), 0.0);
    assert!(!scrape.families.contains_key("vllm:num_requests_waiting"), "no stale idle gauges");
    assert!(value(&scrape, "multilora_request_errors", &[("kind", "engine_failed")]) >= 1.0);
    server.stop().await
}
