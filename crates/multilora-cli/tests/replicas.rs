//! `multilora serve` as one replica of several: SIGTERM drains it (in-flight streams finish,
//! `/health` and new requests answer 503 meanwhile, exit 0), and two replicas sharing one
//! resolver directory serve behind a real router, each adapter reaching a replica that holds it,
//! an adapter added to the directory served without touching the router, and the requests lost
//! when one replica dies mid-run exactly those in flight on it. Two routers, each started by its
//! test:
//!
//! - LiteLLM's proxy (`litellm[proxy]==1.100.0`), from a model list the test writes: the base
//!   model on both replicas (spread over them, with counts), each configured adapter on its
//!   replica, a wildcard deployment on each for the directory's adapters; a replica that drains
//!   (503 `server_draining`) or dies has its requests moved to the other by the proxy's retries.
//! - The Shepherd Model Gateway (`smg==1.13.0`), which in its `external` runtime reads each
//!   worker's `/v1/models` and routes a model's requests to the workers listing it, so it finds
//!   the directory's adapters by itself; it sends the base model to one replica only (a request
//!   the router sends the dead replica before it sets it aside answers 503 at once, and is
//!   retried once, as OpenAI's clients do).
//!
//! Each router test needs its router: `litellm` (`$MULTILORA_LITELLM`, else the PATH) and `smg`
//! (`$MULTILORA_SMG`, else the PATH). `.ci/run` installs both and sets
//! `MULTILORA_REQUIRE_ROUTER=1`, so in CI a missing one fails its test; elsewhere it is skipped
//! with a message. Every step of the replicas sleeps a few milliseconds (the engine's fail point,
//! as `FAILPOINTS` configures it), so a stream of a few hundred tokens of the tiny fixture model
//! lasts long enough to be caught in flight.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Serve, Stream, body, fixtures, get, post, serve_model_on, status, try_get};

/// Each engine step sleeps this long (`FAILPOINTS=engine-step=sleep(ms)`).
const STEP_SLEEP: (&str, &str) = ("FAILPOINTS", "engine-step=sleep(5)");

/// A chat template for the fixture model, which has none.
fn chat_template(dir: &Path) -> PathBuf {
    let file = dir.join("chat.jinja");
    std::fs::write(
        &file,
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant:{% endif %}",
    )
    .expect("write the template");
    file
}

/// Copies fixture adapter `name` into `to`.
fn copy_adapter(name: &str, to: &Path) {
    std::fs::create_dir_all(to).expect("adapter dir");
    for entry in std::fs::read_dir(fixtures().join("adapters").join(name)).expect("fixture adapter") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

/// A replica: the fixture base, runtime updating on, names resolved under `root`, `extra` flags.
fn replica(root: &Path, template: &Path, extra: &[String]) -> Serve {
    replica_on(0, root, template, extra)
}

/// [`replica`] on loopback port `port` (0: a free one).
fn replica_on(port: u16, root: &Path, template: &Path, extra: &[String]) -> Serve {
    let mut args: Vec<String> = [
        "--served-model-name",
        "base",
        "--allow-runtime-lora-updating",
        "--max-loras",
        "4",
        "--max-cpu-loras",
        "8",
        "--max-lora-rank",
        "32",
        "--kv-cache-bytes",
        "33554432",
        "--shutdown-grace-secs",
        "20",
    ]
    .map(String::from)
    .to_vec();
    args.extend(["--lora-resolver-dir".into(), root.display().to_string()]);
    args.extend(["--chat-template".into(), template.display().to_string()]);
    args.extend(extra.iter().cloned());
    serve_model_on(port, &fixtures().join("base"), &args, &[STEP_SLEEP])
}

fn chat(model: &str, max_tokens: usize, stream: bool) -> String {
    let mut body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": stream});
    if stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body.to_string()
}

/// The value of counter or gauge `name` with label `label` (or none) on `url`'s `/metrics`.
fn metric(url: &str, name: &str, label: Option<(&str, &str)>) -> f64 {
    let page = get(url, "/metrics");
    let want = label.map(|(k, v)| format!("{k}=\"{v}\""));
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| want.as_ref().is_none_or(|w| l.contains(w.as_str())))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Requests admitted on `url` for `adapter` (the base under its name).
fn admitted(url: &str, adapter: &str) -> u64 {
    metric(url, "multilora_adapter_requests_total", Some(("adapter", adapter))) as u64
}

/// Polls until nothing runs, waits or holds KV blocks or slot pins on `url` (10 s at most).
fn wait_idle(url: &str) {
    let start = Instant::now();
    loop {
        let busy: f64 = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
            .iter()
            .map(|m| metric(url, m, None))
            .sum::<f64>()
            + metric(url, "multilora_pinned_slots", None);
        if busy == 0.0 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{url} not idle after 10 s (gauges sum {busy})");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The new tokens of a stream that ended as it should, with its usage chunk and `[DONE]`; `None`
/// for one that broke off.
fn completed(payloads: &[String]) -> Option<u64> {
    let usage = payloads.iter().rev().find_map(|p| {
        let v: serde_json::Value = serde_json::from_str(p).ok()?;
        v.get("usage").filter(|u| !u.is_null()).cloned()
    });
    if payloads.last().is_some_and(|p| p == "[DONE]") { usage?["completion_tokens"].as_u64() } else { None }
}

#[test]
fn sigterm_drains_in_flight_streams_refuses_new_requests_and_exits_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let template = chat_template(tmp.path());
    let mut server = replica(tmp.path(), &template, &[]);
    let mut stream = Stream::open(&server.url, "/v1/chat/completions", &chat("base", 300, true)).unwrap();
    assert_eq!(stream.status, 200);
    let mut payloads = vec![stream.next_data().expect("a first chunk")];
    server.signal("TERM");
    // Draining: /health and new requests answer 503 while the stream goes on.
    let start = Instant::now();
    let health = loop {
        let h = get(&server.url, "/health");
        if status(&h) == 503 || start.elapsed() > Duration::from_secs(5) {
            break h;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status(&health), 503, "{health}");
    assert!(body(&health).contains("server_draining"), "{health}");
    let refused = post(&server.url, "/v1/chat/completions", &chat("base", 4, false));
    assert_eq!(status(&refused), 503, "{refused}");
    assert!(body(&refused).contains("server_draining"), "{refused}");
    payloads.extend(stream.rest());
    assert_eq!(completed(&payloads), Some(300), "the stream ran to its end: {:?}", payloads.last());
    let exit = server.wait_exit(Duration::from_secs(20));
    assert_eq!(exit.code(), Some(0), "{exit:?}");
}

/// `multilora serve` with `args` that must stop it before it loads anything: exit 2 and its one
/// `error:` line.
fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_multilora"))
        .args(["serve", "--model", fixtures().join("base").to_str().expect("utf-8"), "--port", "0"])
        .args(args)
        .envs(env.iter().copied())
        .env_remove("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .output()
        .expect("run multilora serve");
    assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn resolver_flags_are_refused_rather_than_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    // Resolvers are asked only with runtime updating on (vLLM's rule): without it, a flag or its
    // environment variable stops the start instead of doing nothing.
    let err = refused(&["--lora-resolver-dir", dir], &[]);
    assert!(err.contains("--lora-resolver-dir") && err.contains("--allow-runtime-lora-updating"), "{err}");
    let err = refused(&[], &[("VLLM_LORA_RESOLVER_CACHE_DIR", dir)]);
    assert!(err.contains("VLLM_LORA_RESOLVER_CACHE_DIR"), "{err}");
    let err = refused(&["--lora-resolver-hub-repos", "acme/sql-lora"], &[]);
    assert!(err.contains("--allow-runtime-lora-updating"), "{err}");
    // Bad values name the flag and the value.
    let missing = tmp.path().join("missing");
    let err = refused(&["--allow-runtime-lora-updating", "--lora-resolver-dir", missing.to_str().unwrap()], &[]);
    assert!(err.contains("--lora-resolver-dir") && err.contains("not a directory"), "{err}");
    for (repos, why) in [("sql-lora", "org/name"), ("a/x,b/x", "also the name of")] {
        let err = refused(&["--allow-runtime-lora-updating", "--lora-resolver-hub-repos", repos], &[]);
        assert!(err.contains("--lora-resolver-hub-repos") && err.contains(why), "{repos}: {err}");
    }
}

/// Router executable `exe`: the file `$var` names, else the first `exe` on the PATH; `None` (the
/// test is skipped, with a message) when there is none, a failure when CI requires the routers
/// (`MULTILORA_REQUIRE_ROUTER=1`).
fn router_exe(exe: &str, var: &str, install: &str) -> Option<PathBuf> {
    let named = std::env::var_os(var).map(PathBuf::from).filter(|p| p.is_file());
    let found = named.or_else(|| {
        std::env::var_os("PATH")
            .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join(exe)).find(|p| p.is_file()))
    });
    if found.is_none() {
        let required = std::env::var("MULTILORA_REQUIRE_ROUTER").is_ok_and(|v| v == "1");
        assert!(!required, "MULTILORA_REQUIRE_ROUTER=1 but no `{exe}` in ${var} or on the PATH ({install})");
        eprintln!("SKIPPED a router test: no `{exe}` in ${var} or on the PATH ({install}; CI does)");
    }
    found
}

/// New tokens of each stream caught in flight when a replica dies: at least 2.4 s of 5 ms steps.
const STREAM_TOKENS: u64 = 480;

/// Reads every stream of [`open_streams`] to its end, all at once: the models of those that did
/// not complete their `STREAM_TOKENS` tokens (the streams lost).
fn finish_streams<'m>(streams: &mut [(&'m str, Stream, Vec<String>)]) -> Vec<&'m str> {
    std::thread::scope(|s| {
        let handles: Vec<_> = streams
            .iter_mut()
            .map(|(m, stream, got)| {
                s.spawn(move || {
                    got.extend(stream.rest());
                    (completed(got) != Some(STREAM_TOKENS)).then_some(*m)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().expect("stream thread")).collect()
    })
}

/// Opens a streaming chat request through `url` for each of `models`, all at once, and reads
/// its first chunk: the streams, each with its model and what it sent so far.
fn open_streams<'m>(url: &str, models: &[&'m str]) -> Vec<(&'m str, Stream, Vec<String>)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = models
            .iter()
            .map(|&m| {
                s.spawn(move || {
                    let chat = chat(m, STREAM_TOKENS as usize, true);
                    let mut stream = Stream::open(url, "/v1/chat/completions", &chat).expect("open a stream");
                    assert_eq!(stream.status, 200, "{m}");
                    let first = stream.next_data().unwrap_or_else(|| panic!("a first chunk of {m}"));
                    assert!(!first.contains("[DONE]") && !first.contains("error"), "{m}: {first}");
                    (m, stream, vec![first])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("stream thread")).collect()
    })
}

/// Waits until at least `n` requests run on `url` (the streams about to be caught in flight;
/// the gauge follows the engine's steps a moment late), 2 s at most.
fn assert_running(url: &str, n: usize) {
    let start = Instant::now();
    loop {
        let running = metric(url, "vllm:num_requests_running", None);
        if running >= n as f64 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(2), "{running} requests running on {url}, expected {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A free loopback port (bound, then released for the router to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// The router process; killed when dropped.
struct Router {
    child: Child,
    url: String,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `smg launch` over `workers` in its `external` runtime (`--backend openai`): it lists each
/// worker's `/v1/models` (with the API key) and routes a model to the workers listing it,
/// looking again on a miss; a worker whose `/health` fails once is set aside, as is one whose
/// request failed once (its circuit breaker).
fn start_router(smg: &Path, workers: &[&str], log: &Path) -> Router {
    let (port, metrics_port) = (free_port(), free_port());
    let log = std::fs::File::create(log).expect("router log");
    let mut cmd = Command::new(smg);
    cmd.args(["launch", "--backend", "openai", "--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--worker-urls")
        .args(workers)
        .args(["--api-key", "test-key", "--prometheus-host", "127.0.0.1", "--prometheus-port"])
        .arg(metrics_port.to_string())
        .args(["--health-check-interval-secs", "1", "--health-failure-threshold", "1"])
        .args(["--cb-failure-threshold", "1", "--retry-max-retries", "2", "--retry-initial-backoff-ms", "50"])
        .args(["--log-level", "warn"])
        .stdout(Stdio::null())
        .stderr(log);
    let router = Router { child: cmd.spawn().expect("start smg"), url: format!("http://127.0.0.1:{port}") };
    let start = Instant::now();
    loop {
        let ready = std::net::TcpStream::connect(router.url.trim_start_matches("http://")).is_ok()
            && get(&router.url, "/readiness").contains(&format!("\"healthy_workers\":{}", workers.len()));
        if ready {
            return router;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "smg not ready with every worker after 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `n` chat requests for `model` through `url` at once; the final status of each, and how
/// many first answered 503 and were retried once, as OpenAI's clients do.
fn burst(url: &str, model: &str, n: usize) -> (Vec<u16>, usize) {
    let results: Vec<(u16, bool)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                s.spawn(|| match status(&post(url, "/v1/chat/completions", &chat(model, 4, false))) {
                    503 => (status(&post(url, "/v1/chat/completions", &chat(model, 4, false))), true),
                    first => (first, false),
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("request thread")).collect()
    });
    (results.iter().map(|r| r.0).collect(), results.iter().filter(|r| r.1).count())
}

#[test]
fn two_replicas_behind_smg_route_by_adapter_and_survive_one_dying() {
    let Some(smg) = router_exe("smg", "MULTILORA_SMG", "pip install smg==1.13.0") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (root, template) = (tmp.path().join("loras"), chat_template(tmp.path()));
    copy_adapter("qv_r8", &root.join("shared-sql"));
    let a = replica(&root, &template, &configured("only-a", "rslora_r4"));
    let mut b = replica(&root, &template, &configured("only-b", "pattern_r8"));
    let router = start_router(&smg, &[a.url.as_str(), b.url.as_str()], &tmp.path().join("smg.log"));
    let r = router.url.as_str();

    // Each adapter's requests reach a replica that holds it: configured on one, or found in the
    // shared directory (listed by both); the base model by both.
    let mut counts: HashMap<&str, (u64, u64)> = HashMap::new();
    for model in ["only-a", "only-b", "shared-sql", "base"] {
        let (statuses, retried) = burst(r, model, 8);
        assert!(statuses.iter().all(|&s| s == 200) && retried == 0, "{model}: {statuses:?}, {retried} retried");
        counts.insert(model, (admitted(&a.url, model), admitted(&b.url, model)));
    }
    eprintln!("requests admitted per adapter (replica a, replica b): {counts:?}");
    assert_eq!(counts["only-a"], (8, 0));
    assert_eq!(counts["only-b"], (0, 8));
    let (sa, sb) = counts["shared-sql"];
    assert_eq!(sa + sb, 8);
    // smg 1.13's external runtime picks, among the workers listing a model, the one with the
    // least load by its own counter, which its OpenAI-compatible path never counts: every
    // request for a model listed by both goes to the same replica, whatever `--policy` says
    // (docs/DEPLOY.md; LiteLLM's proxy spreads it, below). Served either way.
    let (ba, bb) = counts["base"];
    assert_eq!(ba + bb, 8);

    // An adapter added to the shared directory is served at once, the router untouched.
    copy_adapter("all_r16", &root.join("late"));
    let (statuses, retried) = burst(r, "late", 2);
    assert_eq!((statuses, retried), (vec![200, 200], 0));
    assert_eq!(admitted(&a.url, "late") + admitted(&b.url, "late"), 2);

    // Replica b dies with streams in flight on both: three on an adapter only a has, three on
    // one only b has, two of the base model wherever the router put them.
    let base_on_a = admitted(&a.url, "base");
    let mut streams = open_streams(r, &["only-a", "only-a", "only-a", "only-b", "only-b", "only-b", "base", "base"]);
    assert_running(&b.url, 3);
    b.signal("KILL");
    b.wait_exit(Duration::from_secs(10));
    // Traffic after the death: every request of the base and of the shared adapter is served.
    let ((base_after, base_retried), (sql_after, sql_retried)) = (burst(r, "base", 4), burst(r, "shared-sql", 4));
    assert!(base_after.iter().chain(&sql_after).all(|&s| s == 200), "after b died: {base_after:?} {sql_after:?}");
    eprintln!("after replica b died: {} of 8 requests answered 503 first and were retried", base_retried + sql_retried);
    let lost = finish_streams(&mut streams);
    let base_streams_on_a = (admitted(&a.url, "base") - base_on_a - 4) as usize;
    eprintln!("streams lost when replica b died: {lost:?} ({base_streams_on_a} of the 2 base streams were on a)");
    let mut expected = vec!["only-b"; 3];
    expected.extend(vec!["base"; 2 - base_streams_on_a]);
    let mut lost_sorted = lost.clone();
    lost_sorted.sort_unstable();
    expected.sort_unstable();
    let ends: Vec<_> = streams.iter().map(|(m, _, got)| (m, got.last())).collect();
    assert_eq!(lost_sorted, expected, "lost exactly the streams in flight on replica b; their ends: {ends:?}");

    // Everything back to idle on the survivor, which still drains and exits 0.
    wait_idle(&a.url);
    drop(router);
    assert_eq!(a.terminate().code(), Some(0));
}

/// `--lora-modules name=<fixture adapter>`: an adapter configured on one replica only.
fn configured(name: &str, fixture: &str) -> Vec<String> {
    vec!["--lora-modules".to_string(), format!("{name}={}", fixtures().join("adapters").join(fixture).display())]
}

/// LiteLLM's proxy over replicas `a` and `b`, from a model list written here: the base model on
/// both (a deployment each, picked at random, `simple-shuffle`), `only-a` on a and `only-b` on b
/// as they are configured, and a wildcard deployment on each for every other name (the shared
/// directory's adapters, which either replica resolves). A request that fails on one deployment
/// is retried once, then tried on the group's other deployments (`enable_weighted_failover`).
fn start_litellm(litellm: &Path, a: &str, b: &str, dir: &Path) -> Router {
    let deployment = |name: &str, url: &str| {
        // `max_retries: 0`: the OpenAI client under the proxy would retry on the same replica.
        serde_json::json!({"model_name": name, "litellm_params": {"model": format!("openai/{name}"),
            "api_base": format!("{url}/v1"), "api_key": "test-key", "max_retries": 0, "timeout": 60}})
    };
    let config = serde_json::json!({
        "model_list": [deployment("base", a), deployment("base", b), deployment("only-a", a),
            deployment("only-b", b), deployment("*", a), deployment("*", b)],
        // A deployment that failed sits out a second (`cooldown_time`), so a restarted replica
        // is back in the draw by the time it has loaded.
        "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 1, "enable_weighted_failover": true,
            "cooldown_time": 1},
    });
    // JSON is YAML.
    let file = dir.join("litellm.yaml");
    std::fs::write(&file, config.to_string()).expect("write the proxy's config");
    let port = free_port();
    let log = dir.join("litellm.log");
    let out = std::fs::File::create(&log).expect("router log");
    let err = out.try_clone().expect("router log");
    let mut cmd = Command::new(litellm);
    cmd.arg("--config")
        .arg(&file)
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--num_workers", "1"])
        // Its price list from the package, not downloaded at start.
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .stdout(out)
        .stderr(err);
    let mut router = Router { child: cmd.spawn().expect("start litellm"), url: format!("http://127.0.0.1:{port}") };
    let start = Instant::now();
    // Importing LiteLLM takes seconds (about 15 on a loaded 2-core machine).
    while !try_get(&router.url, "/health/liveliness").is_ok_and(|r| status(&r) == 200) {
        let exited = router.child.try_wait().expect("wait");
        if exited.is_some() || start.elapsed() > Duration::from_secs(120) {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("litellm not up after {:?} ({exited:?}):\n{log}", start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    router
}

/// Sends `n` chat requests for `model` through LiteLLM's proxy at `url` at once: the status of
/// each, and how many the proxy sent on to another try after a failure (its
/// `x-litellm-attempted-retries` and `x-litellm-attempted-fallbacks` headers).
fn routed(url: &str, model: &str, n: usize) -> (Vec<u16>, usize) {
    let responses: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..n).map(|_| s.spawn(|| post(url, "/v1/chat/completions", &chat(model, 4, false)))).collect();
        handles.into_iter().map(|h| h.join().expect("request thread")).collect()
    });
    let moved = |resp: &String| {
        let head = resp.split("\r\n\r\n").next().unwrap_or("");
        head.lines().filter_map(|l| l.split_once(':')).any(|(k, v)| {
            let k = k.trim().to_ascii_lowercase();
            (k == "x-litellm-attempted-retries" || k == "x-litellm-attempted-fallbacks")
                && v.trim().parse::<u64>().is_ok_and(|n| n > 0)
        })
    };
    (responses.iter().map(|r| status(r)).collect(), responses.iter().filter(|r| moved(r)).count())
}

#[test]
fn two_replicas_behind_litellm_spread_the_base_move_off_a_drain_and_survive_one_dying() {
    let Some(litellm) = router_exe("litellm", "MULTILORA_LITELLM", "pip install 'litellm[proxy]==1.100.0'") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (root, template) = (tmp.path().join("loras"), chat_template(tmp.path()));
    copy_adapter("qv_r8", &root.join("shared-sql"));
    let a = replica(&root, &template, &configured("only-a", "rslora_r4"));
    let mut b = replica(&root, &template, &configured("only-b", "pattern_r8"));
    let router = start_litellm(&litellm, &a.url, &b.url, tmp.path());
    let r = router.url.as_str();

    // Each adapter reaches a replica that holds it, and the base model both.
    let mut counts: HashMap<&str, (u64, u64)> = HashMap::new();
    for (model, n) in [("only-a", 8), ("only-b", 8), ("shared-sql", 8), ("base", 24)] {
        let (statuses, moved) = routed(r, model, n);
        assert!(statuses.iter().all(|&s| s == 200) && moved == 0, "{model}: {statuses:?}, {moved} moved");
        counts.insert(model, (admitted(&a.url, model), admitted(&b.url, model)));
    }
    eprintln!("requests admitted per model (replica a, replica b): {counts:?}");
    assert_eq!(counts["only-a"], (8, 0));
    assert_eq!(counts["only-b"], (0, 8));
    let (sa, sb) = counts["shared-sql"];
    assert_eq!(sa + sb, 8);
    // Each base request picks a replica at random: all 24 on one has odds 2^-23.
    let (ba, bb) = counts["base"];
    assert!(ba + bb == 24 && ba > 0 && bb > 0, "the base model spread over both replicas: {ba} + {bb}");

    // An adapter added to the shared directory is served at once, the router untouched.
    copy_adapter("all_r16", &root.join("late"));
    assert_eq!(routed(r, "late", 2), (vec![200, 200], 0));
    assert_eq!(admitted(&a.url, "late") + admitted(&b.url, "late"), 2);

    // A rolling restart of b. While it drains (a stream of its own still running), its new
    // requests answer 503 and the proxy moves them to a: none is lost.
    let port_b: u16 = b.url.rsplit(':').next().and_then(|p| p.parse().ok()).expect("b's port");
    let mut stream = Stream::open(r, "/v1/chat/completions", &chat("only-b", 300, true)).expect("open a stream");
    assert_eq!(stream.status, 200);
    let mut payloads = vec![stream.next_data().expect("a first chunk")];
    let on_a = |model| admitted(&a.url, model);
    let (base_before, sql_before) = (on_a("base"), on_a("shared-sql"));
    b.signal("TERM");
    let start = Instant::now();
    while try_get(&b.url, "/health").is_ok_and(|h| status(&h) != 503) {
        assert!(start.elapsed() < Duration::from_secs(5), "b not draining 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    }
    let ((base, base_moved), (sql, sql_moved)) = (routed(r, "base", 8), routed(r, "shared-sql", 8));
    assert!(base.iter().chain(&sql).all(|&s| s == 200), "while b drained: {base:?} {sql:?}");
    assert_eq!((on_a("base") - base_before, on_a("shared-sql") - sql_before), (8, 8), "all served by a");
    eprintln!("while replica b drained: {} of 16 requests met it and were moved to a", base_moved + sql_moved);
    // Each request picks b first with odds 1/2 until b is set aside: none did, 2^-16.
    assert!(base_moved + sql_moved > 0, "no request met the draining replica");
    payloads.extend(stream.rest());
    assert_eq!(completed(&payloads), Some(300), "b's stream ran to its end: {:?}", payloads.last());
    assert_eq!(b.wait_exit(Duration::from_secs(20)).code(), Some(0));
    let mut b = replica_on(port_b, &root, &template, &configured("only-b", "pattern_r8"));

    // b, back on its address, dies with streams in flight on both: three on an adapter only a
    // has, three on one only b has, four of the base model wherever the proxy put them.
    let base_on_a = on_a("base");
    let models = ["only-a", "only-a", "only-a", "only-b", "only-b", "only-b", "base", "base", "base", "base"];
    let mut streams = open_streams(r, &models);
    assert_running(&b.url, 3);
    b.signal("KILL");
    b.wait_exit(Duration::from_secs(10));
    // Traffic after the death: every request of the base and of the shared adapter is served,
    // the proxy moving those that met the dead replica.
    let ((base, base_moved), (sql, sql_moved)) = (routed(r, "base", 4), routed(r, "shared-sql", 4));
    assert!(base.iter().chain(&sql).all(|&s| s == 200), "after b died: {base:?} {sql:?}");
    eprintln!("after replica b died: {} of 8 requests met it and were moved to a", base_moved + sql_moved);
    let lost = finish_streams(&mut streams);
    let base_streams_on_a = (on_a("base") - base_on_a - 4) as usize;
    eprintln!("streams lost when replica b died: {lost:?} ({base_streams_on_a} of the 4 base streams were on a)");
    let mut expected = vec!["only-b"; 3];
    expected.extend(vec!["base"; 4 - base_streams_on_a]);
    let mut lost_sorted = lost.clone();
    lost_sorted.sort_unstable();
    expected.sort_unstable();
    let ends: Vec<_> = streams.iter().map(|(m, _, got)| (m, got.last())).collect();
    assert_eq!(lost_sorted, expected, "lost exactly the streams in flight on replica b; their ends: {ends:?}");

    // Everything back to idle on the survivor, which still drains and exits 0.
    wait_idle(&a.url);
    drop(router);
    assert_eq!(a.terminate().code(), Some(0));
}
