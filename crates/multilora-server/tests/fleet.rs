//! What a server needs to run as one replica of many behind a router: adapters resolved by name
//! from a shared directory on first use (once, however many ask; names that would escape the
//! directory refused; a broken adapter failing alone, and served once fixed), the resolvable
//! adapters listed in `/v1/models` before anyone asked for them, the metrics an endpoint picker
//! reads, parsed the way the Gateway API Inference Extension's model-server protocol parses
//! them, the hub resolver's allow-list, and the drain that lets a router move away.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use common::{BASE, Server, copy_dir, path, sse_events, value};
use futures_util::future::join_all;
use multilora::{DirectoryResolver, Engine, EngineBuilder, HubResolver};
use multilora_server::{Drain, ServerConfig};
use serde_json::{Value, json};

/// The fixture base with no adapter at start, resolving names under `root`.
fn resolving(root: &Path) -> EngineBuilder {
    Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(2)
        .max_lora_rank(32)
        .kv_cache_bytes(16 << 20)
        .allow_runtime_lora_updating(true)
        .allowed_lora_root(root)
        .lora_resolver(DirectoryResolver::new(root))
}

fn completion(model: &str) -> Value {
    json!({"model": model, "prompt": [1, 294, 488], "max_tokens": 3, "temperature": 0, "ignore_eos": true})
}

/// The `/v1/models` entry of `id`.
async fn model_card(server: &Server, id: &str) -> Result<Option<Value>> {
    let (status, body) = server.get("/v1/models").await?;
    assert_eq!(status, 200, "{body}");
    let body: Value = serde_json::from_str(&body)?;
    Ok(body["data"].as_array().context("data")?.iter().find(|m| m["id"] == id).cloned())
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_directory_resolver_loads_on_first_use_once_and_refuses_escapes() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("loras");
    copy_dir(&path("adapters/qv_r8"), &root.join("sql"))?;
    copy_dir(&path("invalid_adapters/truncated"), &root.join("broken"))?;
    // A link out of the directory, to an adapter that would load.
    copy_dir(&path("adapters/all_r16"), &tmp.path().join("outside"))?;
    std::os::unix::fs::symlink(tmp.path().join("outside"), root.join("evil"))?;
    let server = Server::start(resolving(&root), ServerConfig::default()).await?;

    // Listed before any request, as discovered and on disk; the link out is not listed.
    let card = model_card(&server, "sql").await?.context("sql listed")?;
    assert_eq!((&card["parent"], &card["multilora"]["tier"]), (&json!(BASE), &json!("disk")), "{card}");
    assert_eq!(card["multilora"]["discovered"], true, "{card}");
    assert!(model_card(&server, "evil").await?.is_none(), "a link out of the root is not offered");

    // A burst of first requests for the same name starts one load; every one is served.
    let first = completion("sql");
    let burst = join_all((0..8).map(|_| server.post("/v1/completions", &first))).await;
    for r in burst {
        let (status, body) = r?;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 3);
    }
    let loads = |s: &common::Scrape| value(s, "multilora_adapter_loads", &[]);
    // The page is the loop's last publication (at most 20 ms old while it steps): on a loaded
    // machine it can predate the burst, so it is read until it shows the load.
    let s = server.scrape_until(|s| loads(s) >= 1.0).await?;
    assert_eq!(loads(&s), 1.0, "one load for the burst");
    // A second request reuses it; the list shows it registered now.
    let (status, body) = server.post("/v1/completions", &completion("sql")).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(loads(&server.scrape().await?), 1.0, "no second load");
    let card = model_card(&server, "sql").await?.context("sql listed")?;
    assert!(card["multilora"].get("discovered").is_none() && card["multilora"]["rank"] == 8, "{card}");

    // Names that would reach outside the directory: refused, naming the name and the reason.
    for (name, reason) in [
        ("../sql", "path separator"),
        ("/etc/passwd", "path separator"),
        ("..", "relative directory name"),
        ("sq\u{0}l", "control character"),
    ] {
        let (status, body) = server.post("/v1/completions", &completion(name)).await?;
        assert_eq!(status, 400, "{name:?}: {body}");
        assert_eq!(body["error"]["code"], "invalid_request", "{name:?}: {body}");
        assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains(reason)), "{name:?}: {body}");
    }
    let (status, body) = server.post("/v1/completions", &completion("evil")).await?;
    assert_eq!((status, &body["error"]["code"]), (400, &json!("invalid_request")), "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("outside the allowed roots"), "{body}");
    assert!(!message.contains("outside\""), "where the link leads is not named: {body}");
    let (status, body) = server.post("/v1/completions", &completion("absent")).await?;
    assert_eq!((status, &body["error"]["code"]), (404, &json!("model_not_found")), "{body}");

    // A broken adapter fails alone, and is answered from memory within its back-off (1 s).
    let (status, body) = server.post("/v1/completions", &completion("broken")).await?;
    assert_eq!((status, &body["error"]["code"]), (400, &json!("adapter_error")), "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("broken")), "{body}");
    let (status, _) = server.post("/v1/completions", &completion("sql")).await?;
    assert_eq!(status, 200, "every other adapter is still served");
    let (status, again) = server.post("/v1/completions", &completion("broken")).await?;
    assert_eq!((status, &again["error"]["message"]), (400, &body["error"]["message"]));
    // Fixed in the directory: served once the back-off is over. The name was not poisoned.
    std::fs::remove_dir_all(root.join("broken"))?;
    copy_dir(&path("adapters/all_r16"), &root.join("broken"))?;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, body) = server.post("/v1/completions", &completion("broken")).await?;
    assert_eq!(status, 200, "{body}");
    server.wait_idle().await?;
    server.stop().await
}

/// The hub resolver answers its allow-list only, and lists it before any request; nothing here
/// reaches the hub (no listed name is requested).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_resolver_offers_its_allow_list_and_nothing_else() -> Result<()> {
    let hub = HubResolver::new(["acme/hub-sql", "acme/hub-chat@v2"])?;
    let mut builder = Engine::builder(path("base"))
        .served_model_name(BASE)
        .kv_cache_bytes(16 << 20)
        .allow_runtime_lora_updating(true);
    for repo in hub.repos() {
        builder = builder.allowed_lora_hub_repo(repo);
    }
    let server = Server::start(builder.lora_resolver(hub), ServerConfig::default()).await?;
    let card = model_card(&server, "hub-chat").await?.context("hub-chat listed")?;
    assert_eq!((&card["root"], &card["multilora"]["discovered"]), (&json!("acme/hub-chat@v2"), &json!(true)));
    assert!(model_card(&server, "hub-sql").await?.is_some());
    for name in ["acme", "hub", "other-lora"] {
        let (status, body) = server.post("/v1/completions", &completion(name)).await?;
        assert_eq!((status, &body["error"]["code"]), (404, &json!("model_not_found")), "{name}: {body}");
    }
    server.stop().await
}

/// One sample of the Prometheus text format: name, labels, value.
type Sample = (String, HashMap<String, String>, f64);

/// The text format read line by line as the endpoint picker's `expfmt.TextParser` reads it:
/// `#` lines are comments or metadata, each other line is `name{k="v",...} value`.
fn parse_text(text: &str) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (series, v) = line.rsplit_once(' ').context(line.to_string())?;
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.strip_suffix('}').context(line.to_string())?),
            None => (series, ""),
        };
        let mut map = HashMap::new();
        let mut rest = labels;
        while let Some((k, after)) = rest.split_once("=\"") {
            // Label values here hold no escaped quote (adapter names and numbers).
            let (v, tail) = after.split_once('"').context(line.to_string())?;
            map.insert(k.trim_start_matches(',').to_string(), v.to_string());
            rest = tail;
        }
        out.push((name.to_string(), map, v.parse::<f64>().with_context(|| line.to_string())?));
    }
    Ok(out)
}

/// What the endpoint picker keeps of one scrape (the protocol's metrics; GIE's `PodMetrics`).
#[derive(Debug)]
struct PodMetrics {
    waiting_queue_size: usize,
    running: usize,
    kv_cache_usage: f64,
    active_models: Vec<String>,
    waiting_models: Vec<String>,
    max_active_models: usize,
    lora_updated: f64,
    block_size: usize,
    num_gpu_blocks: usize,
}

/// GIE's `promToPodMetrics`: the queue and KV gauges; of `vllm:lora_requests_info`, among the
/// series with an adapter in either list, the one with the largest value (its update time), its
/// lists split on commas and `max_lora` an integer; `vllm:cache_config_info`'s block labels.
fn pod_metrics(samples: &[Sample]) -> Result<PodMetrics> {
    let one = |name: &str| -> Result<&Sample> {
        samples.iter().find(|s| s.0 == name).with_context(|| format!("{name} missing"))
    };
    let lora = samples
        .iter()
        .filter(|s| s.0 == "vllm:lora_requests_info")
        .filter(|s| !s.1["running_lora_adapters"].is_empty() || !s.1["waiting_lora_adapters"].is_empty())
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .context("no vllm:lora_requests_info series with an adapter")?;
    let list = |k: &str| -> Vec<String> { lora.1[k].split(',').filter(|s| !s.is_empty()).map(String::from).collect() };
    let cache = one("vllm:cache_config_info")?;
    Ok(PodMetrics {
        waiting_queue_size: one("vllm:num_requests_waiting")?.2 as usize,
        running: one("vllm:num_requests_running")?.2 as usize,
        kv_cache_usage: one("vllm:kv_cache_usage_perc")?.2,
        active_models: list("running_lora_adapters"),
        waiting_models: list("waiting_lora_adapters"),
        max_active_models: lora.1["max_lora"].parse()?,
        lora_updated: lora.2,
        block_size: cache.1["block_size"].parse()?,
        num_gpu_blocks: cache.1["num_gpu_blocks"].parse()?,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_follow_the_model_server_protocol() -> Result<()> {
    let builder = Engine::builder(path("base"))
        .served_model_name(BASE)
        .max_loras(1)
        .max_lora_rank(32)
        .kv_cache_bytes(16 << 20)
        .lora("sql", path("adapters/qv_r8"))
        .lora("chat", path("adapters/all_r16"));
    let server = Server::start(builder, ServerConfig::default()).await?;
    // One long stream on "sql" holds the only slot, so a request for "chat" waits.
    let long = json!({"model": "sql", "prompt": [1, 5, 9], "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut resp = server.client.post(format!("{}/v1/completions", server.url)).json(&long).send().await?;
    assert!(resp.chunk().await?.is_some_and(|c| c.starts_with(b"data: ")));
    let waiting = tokio::spawn({
        let (client, url) = (server.client.clone(), server.url.clone());
        async move { client.post(format!("{url}/v1/completions")).json(&completion("chat")).send().await }
    });
    let mut seen = None;
    for _ in 0..250 {
        let (status, text) = server.get("/metrics").await?;
        assert_eq!(status, 200);
        // A page published before the requests ran has no adapter in either list: the picker
        // reads no LoRA state from it, and neither does this loop.
        if let Ok(m) = pod_metrics(&parse_text(&text)?)
            && m.waiting_models == ["chat"]
        {
            seen = Some(m);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = seen.context("chat never showed as a waiting adapter")?;
    let cfg = server.engine().config();
    assert_eq!((m.active_models.as_slice(), m.max_active_models), (["sql".to_string()].as_slice(), 1), "{m:?}");
    assert_eq!((m.running, m.waiting_queue_size), (1, 1), "{m:?}");
    assert!(m.kv_cache_usage > 0.0 && m.kv_cache_usage <= 1.0, "{m:?}");
    assert_eq!((m.block_size, m.num_gpu_blocks), (cfg.block_size, cfg.num_kv_blocks), "{m:?}");
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
    assert!(m.lora_updated <= now && now - m.lora_updated < 5.0, "an update time, seconds since the epoch: {m:?}");
    drop(resp); // cancels the long stream; "chat" runs
    assert_eq!(waiting.await??.status(), 200);
    server.wait_idle().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_server_finishes_what_it_admitted_and_refuses_the_rest() -> Result<()> {
    let drain = Drain::new();
    let builder = Engine::builder(path("base")).served_model_name(BASE).kv_cache_bytes(16 << 20);
    let server = Server::start(builder, ServerConfig::default().drain(drain.clone())).await?;
    assert_eq!(server.get("/health").await?.0, 200);
    let long = json!({"model": BASE, "prompt": [1, 5, 9], "max_tokens": 300, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}});
    let mut resp = server.client.post(format!("{}/v1/completions", server.url)).json(&long).send().await?;
    assert!(resp.chunk().await?.is_some_and(|c| c.starts_with(b"data: ")));
    drain.start();
    let (status, body) = server.get("/health").await?;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("server_draining"), "{body}");
    let (status, body) = server.post("/v1/completions", &completion(BASE)).await?;
    assert_eq!((status, &body["error"]["code"]), (503, &json!("server_draining")), "{body}");
    assert!(drain.in_flight() >= 1);
    // The admitted stream runs to its end.
    let events = sse_events(resp).await?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage = events.iter().rev().find_map(|e| serde_json::from_str::<Value>(e).ok()?.get("usage").cloned());
    assert_eq!(usage.map(|u| u["completion_tokens"].clone()), Some(json!(300)), "every token of the stream");
    tokio::time::timeout(Duration::from_secs(10), drain.finished()).await.context("drained")?;
    assert_eq!(drain.in_flight(), 0);
    server.stop().await
}
