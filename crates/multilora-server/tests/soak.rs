//! A bounded soak over HTTP on the PEFT fixtures: three profiles run one after the other, in each
//! 32 concurrent clients keep sending streamed, collected and dropped-midway (after the first
//! chunk) completions with `n` 1 or 2 and some stop strings for `MULTILORA_SOAK_SECS` seconds
//! (default 3; CI: 12), then wait for the answers still on their way:
//!
//! - **churn**: the base model and several adapters while another task loads, reloads in place
//!   and unloads runtime adapters under the requests' feet;
//! - **preemption**: a KV pool of ~600 tokens and 80-token outputs (`ignore_eos`), so requests
//!   outgrow it and are preempted (`vllm:num_preemptions` must end above 0);
//! - **tight tier**: `max_cpu_loras` equal to `max_loras` (2) and clients over 5 adapters, so
//!   loads wait for a CPU entry to unpin, while the same adapter churn as above loads, reloads
//!   and unloads runtime adapters into that full tier.
//!
//! Every request ends as one of: finished (each choice with `stop` or `length`), aborted by its
//! client on purpose, 404 `model_not_found` before any stream byte for a runtime adapter that is
//! not loaded at that moment, 429 (none expected: 32 clients stay far below the waiting limit),
//! or a failure (any other status, an error event, a stream without `[DONE]` or without a finish
//! for every choice, a text that holds one of its stop strings, no answer within 60 s). An
//! accepted request (a 200) never fails because its adapter was unloaded or reloaded after it
//! was accepted: it finishes on the adapter it was accepted with. No failure is allowed, no
//! engine-side request error, and no failed adapter call (a load into a full tier waits for
//! room, it is not refused); after each profile the engine must come back to idle (nothing
//! running, waiting, in the KV cache or pinned). A summary per profile is printed (run with
//! `--nocapture` to see it); nothing is asserted about timings.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::{BASE, Server, builder, copy_dir, path, sse_events, value};
use multilora_server::ServerConfig;
use multilora_types::SplitMix64;
use openmetrics_parser::OpenMetricsValue;
use serde_json::{Value, json};

/// Concurrent clients per profile.
const CLIENTS: usize = 32;
/// The longest any one request may take, on a slow CI machine included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The fixture adapters the churn profile sends requests to besides the runtime ones.
const CHURN_FIXTURES: &[&str] = &["qv_r8", "all_r16", "rslora_r4", "pattern_r8", "rank32"];
/// The preemption profile's output length. Each request outgrows its share of the ~600-token KV
/// pool many times over, while the whole backlog (32 clients × ~1.25 choices × ~85 tokens) stays
/// within a few hundred engine steps: a debug build on 2 cores makes ~170 tokens/s here, so 200
/// tokens would queue a request for about a minute.
const PREEMPTION_MAX_TOKENS: usize = 80;
/// Adapters loaded, reloaded and unloaded at run time in the churn profile.
const RUNTIME: &[&str] = &["rt_a", "rt_b"];
/// The adapters of the tight-tier profile: more than its two CPU entries.
const TIGHT: &[&str] = &["qv_r8", "all_r16", "rslora_r4", "pattern_r8", "rank32"];
const PROMPTS: &[&str] = &["Once upon a time", "The capital of France", "hello", "1, 2, 3, 4,", "The quick brown fox"];
/// Stop lists: frequent single characters (often cut the text), a pair, and one that never matches.
const STOPS: &[&[&str]] = &[&["e"], &[" t", "o"], &["zzqzz"]];

/// Seconds each profile runs: `MULTILORA_SOAK_SECS`, default 3 (a quick soak in every `cargo
/// test`; CI runs it again with 13, about a minute in all, and prints the summaries).
fn soak_duration() -> Duration {
    let secs = std::env::var("MULTILORA_SOAK_SECS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(3.0);
    Duration::from_secs_f64(secs.max(0.1))
}

/// Each client's seeded choices over the workspace's one generator, so a run can be replayed.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.below(n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }

    /// True with probability `pct` percent.
    fn chance(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Stream,
    Collect,
    /// Streamed, and the response dropped after its first chunk.
    Drop,
}

/// One request a client sends.
#[derive(Debug)]
struct Spec {
    model: String,
    mode: Mode,
    n: usize,
    max_tokens: usize,
    ignore_eos: bool,
    temperature: f64,
    stop: &'static [&'static str],
    prompt: &'static str,
    /// A runtime adapter, which may legitimately be absent (404 `model_not_found`).
    may_be_absent: bool,
}

impl Spec {
    fn body(&self) -> Value {
        let mut body = json!({
            "model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "n": self.n,
            "temperature": self.temperature, "ignore_eos": self.ignore_eos, "stream": self.mode != Mode::Collect,
        });
        if !self.stop.is_empty() {
            body["stop"] = json!(self.stop);
        }
        body
    }

    fn mode(rng: &mut Rng, stream: usize, collect: usize) -> Mode {
        match rng.below(100) {
            x if x < stream => Mode::Stream,
            x if x < stream + collect => Mode::Collect,
            _ => Mode::Drop,
        }
    }

    fn new(model: &str, mode: Mode, rng: &mut Rng) -> Spec {
        Spec {
            model: model.to_string(),
            mode,
            n: 1 + rng.below(2),
            max_tokens: 4 + rng.below(40),
            ignore_eos: rng.chance(50),
            temperature: if rng.chance(50) { 0.0 } else { 0.8 },
            stop: if rng.chance(35) { rng.pick(STOPS) } else { &[] },
            prompt: rng.pick(PROMPTS),
            may_be_absent: false,
        }
    }
}

/// The churn profile's requests: base, fixture and runtime adapters, every mode.
fn churn_spec(rng: &mut Rng) -> Spec {
    let runtime = rng.chance(30);
    let model = if runtime {
        rng.pick(RUNTIME).to_string()
    } else if rng.chance(20) {
        BASE.to_string()
    } else {
        rng.pick(CHURN_FIXTURES).to_string()
    };
    let mode = Spec::mode(rng, 45, 35);
    let mut spec = Spec::new(&model, mode, rng);
    spec.may_be_absent = runtime;
    if mode == Mode::Drop {
        spec.max_tokens = 200;
        spec.ignore_eos = true;
    }
    spec
}

/// The preemption profile's requests: long outputs that outgrow the small KV pool.
fn preemption_spec(rng: &mut Rng) -> Spec {
    let model = if rng.chance(25) { BASE.to_string() } else { rng.pick(CHURN_FIXTURES).to_string() };
    let mode = Spec::mode(rng, 50, 40);
    let mut spec = Spec::new(&model, mode, rng);
    spec.max_tokens = PREEMPTION_MAX_TOKENS;
    spec.n = if rng.chance(25) { 2 } else { 1 };
    spec.ignore_eos = true;
    spec.stop = if rng.chance(15) { &["zzqzz"] } else { &[] };
    spec
}

/// The tight tier's requests: five adapters and the runtime ones for two CPU entries, short
/// outputs so adapters swap often.
fn tight_spec(rng: &mut Rng) -> Spec {
    let runtime = rng.chance(25);
    let model = if runtime { rng.pick(RUNTIME) } else { rng.pick(TIGHT) }.to_string();
    let mode = Spec::mode(rng, 45, 40);
    let mut spec = Spec::new(&model, mode, rng);
    spec.may_be_absent = runtime;
    spec.max_tokens = 2 + rng.below(16);
    if mode == Mode::Drop {
        spec.max_tokens = 120;
        spec.ignore_eos = true;
    }
    spec
}

/// How a request ended.
#[derive(Debug)]
enum Outcome {
    /// Every choice finished; its finish reasons.
    Finished(Vec<String>),
    /// Dropped by its client after the first chunk, on purpose.
    Aborted,
    /// 404 `model_not_found`, before any stream byte, for a runtime adapter not loaded then.
    Absent,
    RateLimited,
    Failure(String),
}

/// Outcomes of a profile's requests.
#[derive(Default)]
struct Tally {
    requests: usize,
    finished: usize,
    choices_stop: usize,
    choices_length: usize,
    aborted: usize,
    absent: usize,
    rate_limited: usize,
    failures: Vec<String>,
    /// End-to-end time of the finished requests.
    latencies: Vec<Duration>,
}

impl Tally {
    fn record(&mut self, outcome: Outcome, took: Duration) {
        self.requests += 1;
        match outcome {
            Outcome::Finished(reasons) => {
                self.finished += 1;
                self.choices_stop += reasons.iter().filter(|r| *r == "stop").count();
                self.choices_length += reasons.iter().filter(|r| *r == "length").count();
                self.latencies.push(took);
            }
            Outcome::Aborted => self.aborted += 1,
            Outcome::Absent => self.absent += 1,
            Outcome::RateLimited => self.rate_limited += 1,
            Outcome::Failure(why) => self.failures.push(why),
        }
    }

    fn merge(&mut self, other: Tally) {
        self.requests += other.requests;
        self.finished += other.finished;
        self.choices_stop += other.choices_stop;
        self.choices_length += other.choices_length;
        self.aborted += other.aborted;
        self.absent += other.absent;
        self.rate_limited += other.rate_limited;
        self.failures.extend(other.failures);
        self.latencies.extend(other.latencies);
    }
}

/// Nearest-rank percentile `q` of `sorted`, in ms (0 when empty).
fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

/// Load / reload / unload calls the churn task made (all must be answered 200, a load or reload
/// into a full CPU tier included).
#[derive(Default)]
struct AdapterOps {
    loads: usize,
    reloads: usize,
    unloads: usize,
    failures: Vec<String>,
}

/// What an error body means for `spec` (a refusal before any stream byte).
fn refused(spec: &Spec, status: u16, body: &Value) -> Outcome {
    let code = body["error"]["code"].as_str().unwrap_or("");
    match (status, code) {
        (404, "model_not_found") if spec.may_be_absent => Outcome::Absent,
        (429, _) => Outcome::RateLimited,
        _ => Outcome::Failure(format!("{} {:?}: {status} {body}", spec.model, spec.mode)),
    }
}

/// A finished choice's text must not hold one of its stop strings (they end the text, and are
/// not part of it).
fn holds_stop(spec: &Spec, text: &str) -> Option<&'static str> {
    spec.stop.iter().copied().find(|s| text.contains(s))
}

fn check_collected(spec: &Spec, body: &Value) -> Outcome {
    let Some(choices) = body["choices"].as_array() else {
        return Outcome::Failure(format!("{}: a 200 without choices: {body}", spec.model));
    };
    if choices.len() != spec.n {
        return Outcome::Failure(format!("{}: {} choices for n {}: {body}", spec.model, choices.len(), spec.n));
    }
    let mut reasons = Vec::new();
    for c in choices {
        match c["finish_reason"].as_str() {
            Some(r @ ("stop" | "length")) => reasons.push(r.to_string()),
            other => return Outcome::Failure(format!("{}: finish_reason {other:?}: {body}", spec.model)),
        }
        let text = c["text"].as_str().unwrap_or("");
        if let Some(s) = holds_stop(spec, text) {
            return Outcome::Failure(format!("{}: text {text:?} holds its stop string {s:?}", spec.model));
        }
    }
    Outcome::Finished(reasons)
}

/// The SSE payloads of a whole stream: every choice ends with `stop` or `length`, then `[DONE]`.
fn check_stream(spec: &Spec, events: &[String]) -> Outcome {
    let mut texts = vec![String::new(); spec.n];
    let mut reasons: Vec<Option<String>> = vec![None; spec.n];
    let mut errors = Vec::new();
    for (k, e) in events.iter().enumerate() {
        if e == "[DONE]" {
            if k + 1 != events.len() {
                return Outcome::Failure(format!("{}: events after [DONE]: {events:?}", spec.model));
            }
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(e) else {
            return Outcome::Failure(format!("{}: an event that is not JSON: {e:?}", spec.model));
        };
        if v.get("error").is_some() {
            errors.push(v);
            continue;
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap_or(u64::MAX) as usize;
            if i >= spec.n {
                return Outcome::Failure(format!("{}: choice index {i} for n {}: {e}", spec.model, spec.n));
            }
            texts[i].push_str(c["text"].as_str().unwrap_or(""));
            if let Some(r) = c["finish_reason"].as_str()
                && reasons[i].replace(r.to_string()).is_some()
            {
                return Outcome::Failure(format!("{}: choice {i} finished twice: {events:?}", spec.model));
            }
        }
    }
    // A stream was accepted: whatever happened to its adapter since, it must not fail.
    if !errors.is_empty() {
        return Outcome::Failure(format!("{} stream: error events {errors:?}", spec.model));
    }
    if events.last().map(String::as_str) != Some("[DONE]") {
        return Outcome::Failure(format!("{}: a stream that ended without [DONE]: {events:?}", spec.model));
    }
    let mut done = Vec::new();
    for (i, r) in reasons.into_iter().enumerate() {
        match r.as_deref() {
            Some("stop" | "length") => done.push(r.unwrap_or_default()),
            other => {
                return Outcome::Failure(format!("{}: choice {i} ended with finish {other:?}: {events:?}", spec.model));
            }
        }
        if let Some(s) = holds_stop(spec, &texts[i]) {
            return Outcome::Failure(format!("{}: text {:?} holds its stop string {s:?}", spec.model, texts[i]));
        }
    }
    Outcome::Finished(done)
}

async fn attempt(client: &reqwest::Client, url: &str, spec: &Spec) -> Result<Outcome> {
    let mut resp = client.post(url).json(&spec.body()).send().await?;
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        return Ok(refused(spec, status, &body));
    }
    Ok(match spec.mode {
        Mode::Collect => check_collected(spec, &resp.json().await?),
        Mode::Stream => check_stream(spec, &sse_events(resp).await?),
        Mode::Drop => {
            let Some(first) = resp.chunk().await? else {
                return Ok(Outcome::Failure(format!("{}: a stream without a first chunk", spec.model)));
            };
            drop(resp);
            let text = String::from_utf8_lossy(&first);
            let errors: Vec<Value> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter(|v| v.get("error").is_some())
                .collect();
            match errors.first() {
                None => Outcome::Aborted,
                Some(e) => Outcome::Failure(format!("{} dropped stream: first chunk has an error {e}", spec.model)),
            }
        }
    })
}

/// One client: requests one after the other until `deadline`.
async fn client(
    client: reqwest::Client,
    url: String,
    seed: u64,
    deadline: Instant,
    spec: fn(&mut Rng) -> Spec,
) -> Tally {
    let mut rng = Rng::new(seed);
    let mut tally = Tally::default();
    while Instant::now() < deadline {
        let s = spec(&mut rng);
        let started = Instant::now();
        let outcome = match tokio::time::timeout(REQUEST_TIMEOUT, attempt(&client, &url, &s)).await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => Outcome::Failure(format!("{} {:?}: transport error: {e:#}", s.model, s.mode)),
            Err(_) => {
                Outcome::Failure(format!("{} {:?}: no answer within {REQUEST_TIMEOUT:?}: {s:?}", s.model, s.mode))
            }
        };
        tally.record(outcome, started.elapsed());
    }
    tally
}

/// `CLIENTS` clients against `server` for the soak duration.
async fn drive(server: &Server, profile: u64, spec: fn(&mut Rng) -> Spec) -> Result<Tally> {
    let deadline = Instant::now() + soak_duration();
    let url = format!("{}/v1/completions", server.url);
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(client(server.client.clone(), url.clone(), profile * 1000 + i as u64, deadline, spec)))
        .collect();
    let mut tally = Tally::default();
    for t in tasks {
        tally.merge(t.await?);
    }
    Ok(tally)
}

/// Loads, reloads in place and unloads the runtime adapters in turn until `deadline`, from the
/// copies under `root`.
async fn churn_adapters(
    client: reqwest::Client,
    url: String,
    root: std::path::PathBuf,
    deadline: Instant,
) -> AdapterOps {
    let sources = ["qv_r8", "all_r16", "rslora_r4"];
    // 0: absent, 1: loaded, 2: reloaded (then unloaded).
    let mut state = vec![0u8; RUNTIME.len()];
    let mut ops = AdapterOps::default();
    let mut step = 0usize;
    while Instant::now() < deadline {
        let k = step % RUNTIME.len();
        let name = RUNTIME[k];
        let dir = root.join(sources[(step / RUNTIME.len()) % sources.len()]).display().to_string();
        let (route, body) = match state[k] {
            0 => ("/v1/load_lora_adapter", json!({"lora_name": name, "lora_path": dir})),
            1 => ("/v1/load_lora_adapter", json!({"lora_name": name, "lora_path": dir, "load_inplace": true})),
            _ => ("/v1/unload_lora_adapter", json!({"lora_name": name})),
        };
        let answer = tokio::time::timeout(REQUEST_TIMEOUT, async {
            let resp = client.post(format!("{url}{route}")).json(&body).send().await?;
            let status = resp.status().as_u16();
            Ok::<_, reqwest::Error>((status, resp.text().await?))
        })
        .await;
        match answer {
            Ok(Ok((200, _))) => {
                match state[k] {
                    0 => ops.loads += 1,
                    1 => ops.reloads += 1,
                    _ => ops.unloads += 1,
                }
                state[k] = (state[k] + 1) % 3;
            }
            Ok(Ok((status, text))) => ops.failures.push(format!("{route} {body}: {status} {text}")),
            Ok(Err(e)) => ops.failures.push(format!("{route} {body}: {e}")),
            Err(_) => ops.failures.push(format!("{route} {body}: no answer within {REQUEST_TIMEOUT:?}")),
        }
        if !ops.failures.is_empty() {
            break; // the state is unknown now; the failure is reported
        }
        step += 1;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    ops
}

/// Prints the summary of a profile, then checks its outcomes and that the engine is idle.
async fn finish(name: &str, server: Server, tally: Tally, ops: Option<AdapterOps>, took: Duration) -> Result<f64> {
    let idle = server.wait_idle().await;
    let scrape = server.scrape().await?;
    let preemptions = value(&scrape, "vllm:num_preemptions", &[]);
    let mut sorted = tally.latencies.clone();
    sorted.sort();
    let mut out = format!(
        "soak profile {name:?}: {:.1} s, {} requests: {} finished ({} choices stop, {} length), {} aborted by \
         the client, {} absent adapter (404), {} rate limited (429), {} FAILED\n",
        took.as_secs_f64(),
        tally.requests,
        tally.finished,
        tally.choices_stop,
        tally.choices_length,
        tally.aborted,
        tally.absent,
        tally.rate_limited,
        tally.failures.len(),
    );
    out += &format!(
        "  latency of finished requests (ms): p50 {:.0}, p90 {:.0}, p99 {:.0}, max {:.0}\n",
        percentile_ms(&sorted, 0.50),
        percentile_ms(&sorted, 0.90),
        percentile_ms(&sorted, 0.99),
        percentile_ms(&sorted, 1.0),
    );
    let generated = value(&scrape, "vllm:generation_tokens", &[]);
    out += &format!(
        "  {generated} tokens generated in {} engine steps ({:.0} tokens/s)\n",
        value(&scrape, "multilora_steps", &[]),
        generated / took.as_secs_f64(),
    );
    out += &format!(
        "  preemptions {preemptions}, adapter loads into the cpu tier {}, evictions {}",
        value(&scrape, "multilora_adapter_loads", &[]),
        value(&scrape, "multilora_adapter_evictions", &[]),
    );
    if let Some(ops) = &ops {
        out += &format!(", runtime loads {}, reloads {}, unloads {}", ops.loads, ops.reloads, ops.unloads);
    }
    let error_kinds: Vec<String> = common::samples(&scrape, "multilora_request_errors")
        .into_iter()
        .filter(|(_, v)| matches!(v, OpenMetricsValue::Counter(c) if c.value.as_f64() > 0.0))
        .map(|(labels, _)| labels.get("kind").cloned().unwrap_or_default())
        .collect();
    let errors: Vec<String> = error_kinds
        .iter()
        .map(|kind| format!("{kind} {}", value(&scrape, "multilora_request_errors", &[("kind", kind)])))
        .collect();
    out +=
        &format!("\n  engine request errors: {errors:?}\n  idle check: {}", if idle.is_ok() { "ok" } else { "FAILED" });
    for f in tally.failures.iter().take(10) {
        out += &format!("\n  failure: {f}");
    }
    if let Some(ops) = &ops {
        for f in &ops.failures {
            out += &format!("\n  adapter call failure: {f}");
        }
    }
    println!("{out}");

    let capacity = tally.failures.iter().find(|f| {
        let f = f.to_lowercase();
        f.contains("pinned") || f.contains("cpu tier")
    });
    ensure!(capacity.is_none(), "{name}: a request failed for want of capacity: {capacity:?}");
    ensure!(
        tally.failures.is_empty(),
        "{name}: {} requests failed, first: {}",
        tally.failures.len(),
        tally.failures[0]
    );
    ensure!(tally.rate_limited == 0, "{name}: {} requests got 429 with 32 clients", tally.rate_limited);
    ensure!(tally.finished > 0, "{name}: no request finished");
    // No request fails inside the engine, the churn's included: a request is refused at submit
    // (a 404 before any byte) or runs to its end on the adapter it was accepted with. (A client
    // that dropped its stream would not see an error, so the engine's own count is checked.)
    ensure!(error_kinds.is_empty(), "{name}: engine-side request errors {errors:?}");
    if let Some(ops) = &ops {
        ensure!(ops.failures.is_empty(), "{name}: adapter calls failed: {:?}", ops.failures);
        ensure!(ops.loads > 0 && ops.reloads > 0 && ops.unloads > 0, "{name}: the adapter churn did not run a cycle");
    }
    let idle = idle?;
    for gauge in
        ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "multilora_pinned_slots"]
    {
        ensure!(value(&idle, gauge, &[]) == 0.0, "{name}: {gauge} is not 0 once idle");
    }
    ensure!(server.get("/health").await?.0 == 200, "{name}: unhealthy after the soak");
    server.stop().await?;
    Ok(preemptions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_churn_preemption_and_a_tight_cpu_tier() -> Result<()> {
    // 1. Churn: every mode over the base and fixture adapters, while runtime adapters come and go.
    let roots = tempfile::tempdir()?;
    for src in ["qv_r8", "all_r16", "rslora_r4"] {
        copy_dir(&path(&format!("adapters/{src}")), &roots.path().join(src))?;
    }
    let engine = builder().allow_runtime_lora_updating(true).allowed_lora_root(roots.path());
    let server = Server::start(engine, ServerConfig::default()).await?;
    let started = Instant::now();
    let churn = tokio::spawn(churn_adapters(
        server.client.clone(),
        server.url.clone(),
        roots.path().to_path_buf(),
        started + soak_duration(),
    ));
    let tally = drive(&server, 1, churn_spec).await?;
    let ops = churn.await?;
    finish("churn", server, tally, Some(ops), started.elapsed()).await?;

    // 2. Preemption: a KV pool of ~600 tokens (2 KiB each, the slots counted against the budget)
    // for 32 clients that each want ~210.
    let probe = builder().build()?;
    let slot_bytes = probe.config().lora_slot_bytes;
    tokio::task::spawn_blocking(move || probe.shutdown()).await?;
    let server = Server::start(builder().kv_cache_bytes(slot_bytes + 1_250_000), ServerConfig::default()).await?;
    let started = Instant::now();
    let tally = drive(&server, 2, preemption_spec).await?;
    let preemptions = finish("preemption", server, tally, None, started.elapsed()).await?;
    ensure!(preemptions > 0.0, "the preemption profile preempted nothing");

    // 3. A CPU tier as small as the slots, five adapters in use at once, and runtime adapters
    // loaded, reloaded and unloaded into it.
    let engine =
        builder().max_loras(2).max_cpu_loras(2).allow_runtime_lora_updating(true).allowed_lora_root(roots.path());
    let server = Server::start(engine, ServerConfig::default()).await?;
    let started = Instant::now();
    let churn = tokio::spawn(churn_adapters(
        server.client.clone(),
        server.url.clone(),
        roots.path().to_path_buf(),
        started + soak_duration(),
    ));
    let tally = drive(&server, 3, tight_spec).await?;
    let ops = churn.await?;
    finish("tight tier", server, tally, Some(ops), started.elapsed()).await?;
    Ok(())
}
