//! Load test: 64 concurrent streaming clients over 8 adapters against the server on loopback,
//! for a bounded time. Reports requests/s, tokens/s, p50/p99 time to first token and failures
//! (and exits 1 if any request failed).
//!
//! `cargo bench -p multilora-server --bench load_test -- --clients 64 --seconds 20 --max-tokens 32`
//!
//! The model is the PEFT fixture Llama (hidden 128, 4 layers) with its 7 adapters plus the
//! `bias_all` one: small enough that the figures measure the server and the engine's scheduling,
//! not matrix multiplies.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use multilora_server::ServerConfig;
use serde_json::json;

// The integration tests' harness: the fixture adapters, the engine builder and a server on a
// loopback port with graceful stop.
#[path = "../tests/common/mod.rs"]
mod common;

/// The adapters clients pick from: the seven fixture adapters and `bias_all`.
fn adapters() -> Vec<&'static str> {
    common::ADAPTERS.iter().map(|(name, _)| *name).chain(["bias_all"]).collect()
}

#[derive(Debug)]
struct Args {
    clients: usize,
    seconds: u64,
    max_tokens: usize,
}

fn args() -> Result<Args> {
    let mut a = Args { clients: 64, seconds: 20, max_tokens: 32 };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = || argv.get(i + 1).ok_or_else(|| anyhow::anyhow!("{} needs a value", argv[i]));
        match argv[i].as_str() {
            "--clients" => a.clients = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse()?,
            "--max-tokens" => a.max_tokens = value()?.parse()?,
            _ => {
                i += 1; // cargo bench passes `--bench`; other flags are not ours
                continue;
            }
        }
        i += 2;
    }
    Ok(a)
}

/// One client's results.
#[derive(Debug, Default)]
struct Tally {
    done: usize,
    failed: usize,
    tokens: usize,
    ttft: Vec<Duration>,
    errors: Vec<String>,
}

async fn client(id: usize, url: String, deadline: Instant, max_tokens: usize, adapters: Vec<&'static str>) -> Tally {
    let http = reqwest::Client::new();
    let mut t = Tally::default();
    let mut n = 0;
    while Instant::now() < deadline {
        let model = adapters[(id + n) % adapters.len()];
        let body = json!({
            "model": model, "prompt": format!("client {id} request {n}: once upon a time"),
            "max_tokens": max_tokens, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true},
        });
        n += 1;
        let start = Instant::now();
        match one(&http, &url, &body, start).await {
            Ok((ttft, tokens)) => {
                t.done += 1;
                t.tokens += tokens;
                t.ttft.push(ttft);
            }
            Err(e) => {
                t.failed += 1;
                t.errors.push(e.to_string());
            }
        }
    }
    t
}

/// One streamed request: time to the first token chunk and the tokens generated (from `usage`).
async fn one(http: &reqwest::Client, url: &str, body: &serde_json::Value, start: Instant) -> Result<(Duration, usize)> {
    let mut resp = http.post(url).json(body).send().await?;
    if !resp.status().is_success() {
        bail!("status {}: {}", resp.status(), resp.text().await?);
    }
    let (mut ttft, mut tokens, mut buf, mut done) = (None, 0, String::new(), false);
    while let Some(chunk) = resp.chunk().await? {
        buf.push_str(std::str::from_utf8(&chunk)?);
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                bail!("stream error: {data}");
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            } else if v["choices"][0]["finish_reason"].is_null() {
                ttft.get_or_insert_with(|| start.elapsed());
            }
        }
    }
    match (done, ttft) {
        (true, Some(t)) => Ok((t, tokens)),
        _ => bail!("stream ended without [DONE] or without tokens"),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() -> Result<()> {
    let a = args()?;
    let builder = common::builder()
        .lora("bias_all", common::path("invalid_adapters/bias_all"))
        .max_num_seqs(64)
        .kv_cache_bytes(64 << 20);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (tally, elapsed) = rt.block_on(async {
        let server = common::Server::start(builder, ServerConfig::default()).await?;
        let url = format!("{}/v1/completions", server.url);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(a.seconds);
        let clients: Vec<_> =
            (0..a.clients).map(|i| tokio::spawn(client(i, url.clone(), deadline, a.max_tokens, adapters()))).collect();
        let mut all = Tally::default();
        for c in clients {
            let t = c.await?;
            all.done += t.done;
            all.failed += t.failed;
            all.tokens += t.tokens;
            all.ttft.extend(t.ttft);
            all.errors.extend(t.errors);
        }
        let elapsed = start.elapsed();
        server.stop().await?;
        anyhow::Ok((all, elapsed))
    })?;
    let mut ttft = tally.ttft.clone();
    ttft.sort();
    let secs = elapsed.as_secs_f64();
    println!(
        "load test: {} clients over {} adapters, {:.1} s, max_tokens {}",
        a.clients,
        adapters().len(),
        secs,
        a.max_tokens
    );
    println!(
        "  requests {} ({:.1} req/s), tokens {} ({:.0} tok/s), failed {}",
        tally.done,
        tally.done as f64 / secs,
        tally.tokens,
        tally.tokens as f64 / secs,
        tally.failed
    );
    println!(
        "  time to first token: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        percentile(&ttft, 0.50).as_secs_f64() * 1e3,
        percentile(&ttft, 0.99).as_secs_f64() * 1e3,
        ttft.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    if tally.failed > 0 {
        for e in tally.errors.iter().take(5) {
            eprintln!("  error: {e}");
        }
        bail!("{} requests failed", tally.failed);
    }
    Ok(())
}
