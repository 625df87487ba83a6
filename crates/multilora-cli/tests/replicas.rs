//! `multilora serve` as one replica of several: SIGTERM drains it (in-flight streams finish,
//! `/health` and new requests answer 503 meanwhile, exit 0), and two replicas sharing one
//! resolver directory serve behind a real router, the Shepherd Model Gateway (`smg`, which in its
//! `external` runtime reads each worker's `/v1/models` and routes a model's requests to the
//! workers listing it): each adapter reaches a replica that holds it, an adapter added to the
//! directory is served without touching the router, and when one replica dies mid-run the
//! requests lost are exactly those in flight on it (a request the router sends the dead replica
//! before it sets it aside answers 503 at once, and is retried once, as OpenAI's clients do).
//!
//! The router test needs `smg` on the PATH (`pip install smg==1.13.0`). `.ci/run` installs it
//! and sets `MULTILORA_REQUIRE_ROUTER=1`, so in CI its absence fails the test; elsewhere it is
//! skipped with a message. Every step of the replicas sleeps a few milliseconds (the engine's
//! fail point, as `FAILPOINTS` configures it), so a stream of a few hundred tokens of the tiny
//! fixture model lasts long enough to be caught in flight.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Serve, Stream, body, fixtures, get, post, serve_model, status};

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
    serve_model(&fixtures().join("base"), &args, &[STEP_SLEEP])
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

/// `smg` when it can run here; `None` (skipped, with a message) elsewhere, a failure when CI
/// requires it.
fn smg() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join("smg")).find(|p| p.is_file()));
    if found.is_none() {
        let required = std::env::var("MULTILORA_REQUIRE_ROUTER").is_ok_and(|v| v == "1");
        assert!(!required, "MULTILORA_REQUIRE_ROUTER=1 but no `smg` on the PATH (pip install smg==1.13.0)");
        eprintln!("SKIPPED the router test: `pip install smg==1.13.0` to run it (CI does)");
    }
    found
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
    let Some(smg) = smg() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (root, template) = (tmp.path().join("loras"), chat_template(tmp.path()));
    copy_adapter("qv_r8", &root.join("shared-sql"));
    let only = |name: &str, fixture: &str| {
        vec!["--lora-modules".to_string(), format!("{name}={}", fixtures().join("adapters").join(fixture).display())]
    };
    let a = replica(&root, &template, &only("only-a", "rslora_r4"));
    let mut b = replica(&root, &template, &only("only-b", "pattern_r8"));
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
    // smg 1.13's external runtime sends a model listed by several workers to the least loaded
    // by its own count, which it keeps for none of them: every base request goes to one replica
    // (docs/DEPLOY.md). Served either way.
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
    let mut streams: Vec<(&str, Stream, Vec<String>)> = ["only-a", "only-a", "only-a", "only-b", "only-b", "only-b"]
        .into_iter()
        .chain(["base", "base"])
        .map(|m| {
            let s = Stream::open(r, "/v1/chat/completions", &chat(m, 200, true)).expect("open a stream");
            assert_eq!(s.status, 200, "{m}");
            (m, s, Vec::new())
        })
        .collect();
    for (m, s, got) in &mut streams {
        got.push(s.next_data().unwrap_or_else(|| panic!("a first chunk of {m}")));
        assert!(!got[0].contains("[DONE]") && !got[0].contains("error"), "{m}: {}", got[0]);
    }
    b.signal("KILL");
    b.wait_exit(Duration::from_secs(10));
    // Traffic after the death: every request of the base and of the shared adapter is served.
    let ((base_after, base_retried), (sql_after, sql_retried)) = (burst(r, "base", 4), burst(r, "shared-sql", 4));
    assert!(base_after.iter().chain(&sql_after).all(|&s| s == 200), "after b died: {base_after:?} {sql_after:?}");
    eprintln!("after replica b died: {} of 8 requests answered 503 first and were retried", base_retried + sql_retried);
    let lost: Vec<&str> = std::thread::scope(|s| {
        let handles: Vec<_> = streams
            .iter_mut()
            .map(|(m, stream, got)| {
                s.spawn(move || {
                    got.extend(stream.rest());
                    completed(got).is_none().then_some(*m)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().expect("stream thread")).collect()
    });
    let base_streams_on_a = (admitted(&a.url, "base") - base_on_a - 4) as usize;
    eprintln!("streams lost when replica b died: {lost:?} ({base_streams_on_a} of the 2 base streams were on a)");
    let mut expected = vec!["only-b"; 3];
    expected.extend(vec!["base"; 2 - base_streams_on_a]);
    let mut lost_sorted = lost.clone();
    lost_sorted.sort_unstable();
    expected.sort_unstable();
    assert_eq!(lost_sorted, expected, "lost exactly the streams in flight on replica b");

    // Everything back to idle on the survivor, which still drains and exits 0.
    wait_idle(&a.url);
    drop(router);
    assert_eq!(a.terminate().code(), Some(0));
}
