//! Shared helpers of the server's integration tests: an engine on the PEFT fixtures served on a
//! loopback port (port 0), and small HTTP helpers over `reqwest`.
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use multilora::{Engine, EngineBuilder};
use multilora_server::{ServeOptions, ServerConfig};
use openmetrics_parser::OpenMetricsValue;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The engine tests' fixture helpers, shared rather than copied: the fixture paths, `cases.json`
/// and the list of fixture adapters.
#[path = "../../../multilora/tests/common/mod.rs"]
mod engine_common;

// Each test binary uses its own part of them.
#[allow(unused_imports)]
pub use engine_common::{BASE, cases, fixtures, hold, path};

/// The fixture adapters served from the start: the seven of `adapters/` (the engine tests' list
/// also holds the two of `invalid_adapters/`).
pub const ADAPTERS: &[(&str, &str)] = engine_common::ADAPTERS.split_at(7).0;

/// The fixture base model with every fixture adapter registered at start.
pub fn builder() -> EngineBuilder {
    let mut b =
        Engine::builder(path("base")).served_model_name(BASE).max_loras(8).max_lora_rank(32).kv_cache_bytes(16 << 20);
    for &(name, rel) in ADAPTERS {
        b = b.lora(name, path(rel));
    }
    b
}

/// A running server on `127.0.0.1:<free port>` and the engine behind it.
pub struct Server {
    pub url: String,
    pub engine: Option<Engine>,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Server {
    pub async fn start(builder: EngineBuilder, config: ServerConfig) -> Result<Server> {
        Server::start_with(builder, config, ServeOptions::default().grace(Duration::from_secs(5))).await
    }

    pub async fn start_with(builder: EngineBuilder, config: ServerConfig, options: ServeOptions) -> Result<Server> {
        let engine = builder.build()?;
        let app = multilora_server::router(engine.handle(), config)?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(multilora_server::serve_with(listener, app, shutdown, options));
        Ok(Server { url, engine: Some(engine), client: reqwest::Client::new(), stop: Some(stop), task: Some(task) })
    }

    pub fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("engine running")
    }

    /// POSTs `body` as JSON; returns the status and the body as JSON (or as a string).
    pub async fn post(&self, route: &str, body: &Value) -> Result<(u16, Value)> {
        let resp = self.client.post(format!("{}{route}", self.url)).json(body).send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))
    }

    pub async fn get(&self, route: &str) -> Result<(u16, String)> {
        let resp = self.client.get(format!("{}{route}", self.url)).send().await?;
        Ok((resp.status().as_u16(), resp.text().await?))
    }

    /// `/metrics`, parsed (and validated) by an OpenMetrics parser.
    pub async fn scrape(&self) -> Result<Scrape> {
        let (status, text) = self.get("/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}: {text}");
        }
        openmetrics_parser::openmetrics::parse_openmetrics(&text)
            .map_err(|e| anyhow::anyhow!("parsing /metrics: {e:?}\n{text}"))
    }

    /// Polls `/metrics` (the snapshot the loop publishes, at most 20 ms old while it steps)
    /// until `ready` holds, for up to 5 s; returns the last scrape either way.
    pub async fn scrape_until(&self, ready: impl Fn(&Scrape) -> bool) -> Result<Scrape> {
        let start = Instant::now();
        loop {
            let s = self.scrape().await?;
            if ready(&s) || start.elapsed() > Duration::from_secs(5) {
                return Ok(s);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Polls `/metrics` until nothing runs, waits or holds KV blocks and slot pins. The page is
    /// what the loop last published, at most 20 ms old while it steps, so an idle page read just
    /// after new work arrived may predate that work: idle must hold across a publication
    /// interval (a loop that goes idle publishes at once).
    pub async fn wait_idle(&self) -> Result<Scrape> {
        let busy = |s: &Scrape| {
            [
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
                "multilora_pinned_slots",
            ]
            .iter()
            .map(|m| value(s, m, &[]))
            .sum::<f64>()
        };
        let start = Instant::now();
        loop {
            let s = self.scrape().await?;
            if busy(&s) == 0.0 {
                tokio::time::sleep(Duration::from_millis(60)).await;
                let again = self.scrape().await?;
                if busy(&again) == 0.0 {
                    return Ok(again);
                }
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!("the engine is not idle after 20 s (sum of gauges {})", busy(&s));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the server (graceful) and the engine.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await??;
        }
        if let Some(e) = self.engine.take() {
            tokio::task::spawn_blocking(move || e.shutdown()).await?;
        }
        Ok(())
    }
}

/// A parsed `/metrics` text.
pub type Scrape = openmetrics_parser::MetricsExposition<openmetrics_parser::OpenMetricsType, OpenMetricsValue>;

/// The labels of every sample of metric family `name` (counters without `_total`).
pub fn samples(s: &Scrape, name: &str) -> Vec<(std::collections::HashMap<String, String>, OpenMetricsValue)> {
    let Some(fam) = s.families.get(name) else { return Vec::new() };
    fam.iter_samples()
        .map(|x| {
            let labels =
                x.get_labelset().map(|l| l.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default();
            (labels, x.value.clone())
        })
        .collect()
}

/// The summed value of family `name`'s samples whose labels include `labels` (0 when none).
pub fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(s, name)
        .into_iter()
        .filter(|(l, _)| labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v)))
        .map(|(_, v)| match v {
            OpenMetricsValue::Gauge(n) | OpenMetricsValue::Unknown(n) => n.as_f64(),
            OpenMetricsValue::Counter(c) => c.value.as_f64(),
            _ => 0.0,
        })
        .sum()
}

/// A streaming response's SSE events, each its lines (`event: …`, `data: …`), as they came.
async fn sse_frames(mut resp: reqwest::Response) -> Result<Vec<Vec<String>>> {
    let mut out = Vec::new();
    let mut buf = String::new();
    while let Some(chunk) = resp.chunk().await? {
        buf.push_str(std::str::from_utf8(&chunk)?);
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            out.push(event.lines().map(String::from).collect());
        }
    }
    Ok(out)
}

/// Reads a streaming response's SSE `data:` payloads until `[DONE]` (included).
pub async fn sse_events(resp: reqwest::Response) -> Result<Vec<String>> {
    let frames = sse_frames(resp).await?;
    Ok(frames.iter().flatten().filter_map(|l| l.strip_prefix("data: ").map(String::from)).collect())
}

/// A stream's typed events (`event: <name>` then `data: <json>`): each name with its JSON.
pub async fn typed_events(resp: reqwest::Response) -> Result<Vec<(String, Value)>> {
    let mut out = Vec::new();
    for frame in sse_frames(resp).await? {
        let field = |key: &str| frame.iter().find_map(|l| l.strip_prefix(key));
        match (field("event: "), field("data: ")) {
            (Some(name), Some(data)) => out.push((name.to_string(), serde_json::from_str::<Value>(data)?)),
            _ if frame.iter().all(|l| l.is_empty() || l.starts_with(':')) => {}
            _ => bail!("an event without a name or data: {frame:?}"),
        }
    }
    Ok(out)
}

/// Copies the files of directory `from` (a fixture adapter) into `to`, created.
pub fn copy_dir(from: &str, to: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect()).unwrap_or_default()
}

/// Token ids from completion logprobs asked with `return_tokens_as_token_ids`.
pub fn logprob_ids(choice: &Value) -> Vec<u32> {
    choice["logprobs"]["tokens"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok()).collect())
        .unwrap_or_default()
}
