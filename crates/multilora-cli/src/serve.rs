//! `multilora serve`: the OpenAI-compatible server (crate `multilora-server`) over an engine built
//! from vLLM-named flags, until SIGINT or SIGTERM; then it drains (`/health` and new requests
//! answer 503 while admitted requests finish, within `--shutdown-grace-secs`) and exits 0. If
//! the engine fails (its loop panicked) the server shuts down at once (in-flight requests have
//! already failed) and exits 1, so a supervisor restarts it. Unknown adapter names are resolved,
//! with runtime updating on, from `--lora-resolver-dir` and `--lora-resolver-hub-repos`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::Args;
use multilora::{DirectoryResolver, EngineBuilder, HubResolver, LoopState};
use multilora_server::{ChatTemplate, Drain, ServeOptions, ServerConfig};

use crate::Failure;
use crate::engine_args::EngineArgs;

/// `serve`'s flags.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// Port to listen on (0 picks a free one; the address is logged).
    #[arg(long, default_value_t = 8000)]
    pub(crate) port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from VLLM_API_KEY).
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    pub(crate) api_key: Option<String>,
    /// Enable /v1/load_lora_adapter and /v1/unload_lora_adapter (also
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
    #[arg(long)]
    pub(crate) allow_runtime_lora_updating: bool,
    /// Directories runtime adapter paths must lie in (comma-separated or repeated).
    #[arg(long, value_delimiter = ',')]
    pub(crate) allowed_lora_roots: Vec<PathBuf>,
    /// A Jinja chat template file, overriding the model's.
    #[arg(long)]
    pub(crate) chat_template: Option<PathBuf>,
    /// Honour a chat request's own `chat_template` field (off: such a request is a 400).
    #[arg(long)]
    pub(crate) trust_request_chat_template: bool,
    /// Serve `tool_choice: "auto"` (the default when a request has `tools`): the model's own
    /// tool-call syntax is parsed by --tool-call-parser (off: such a request is a 400).
    #[arg(long, requires = "tool_call_parser")]
    pub(crate) enable_auto_tool_choice: bool,
    /// The model's tool-call syntax: hermes (Qwen, SmolLM3, Hermes), llama3_json (Llama 3.x),
    /// mistral.
    #[arg(long, value_parser = multilora_server::ToolCallParser::NAMES)]
    pub(crate) tool_call_parser: Option<String>,
    /// Requests waiting beyond --max-num-seqs before new ones get 429.
    #[arg(long, default_value_t = multilora_server::DEFAULT_MAX_WAITING_REQUESTS)]
    pub(crate) max_waiting_requests: usize,
    /// Keep the last N responses of /v1/responses in memory, for `previous_response_id` and
    /// `GET /v1/responses/{id}` (0: stateless, such a request is a 400).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub(crate) responses_store: usize,
    /// Resolve an unknown model name that is a subdirectory of DIR holding a PEFT adapter,
    /// loaded on first use (vLLM's filesystem resolver; also VLLM_LORA_RESOLVER_CACHE_DIR). Needs
    /// runtime lora updating; DIR becomes an allowed root.
    #[arg(long, env = "VLLM_LORA_RESOLVER_CACHE_DIR", value_name = "DIR")]
    pub(crate) lora_resolver_dir: Option<PathBuf>,
    /// Resolve adapter names from these hub repositories only, `org/name[@revision]` each
    /// (comma-separated or repeated; also VLLM_LORA_RESOLVER_HF_REPO_LIST): a request names one
    /// by the repository's name. Needs runtime lora updating.
    #[arg(long, env = "VLLM_LORA_RESOLVER_HF_REPO_LIST", value_delimiter = ',', value_name = "REPOS")]
    pub(crate) lora_resolver_hub_repos: Vec<String>,
    /// Seconds the drain after SIGINT/SIGTERM may last: `/health` and new requests answer 503
    /// while admitted requests finish; those still running then are cancelled.
    #[arg(long, default_value_t = 30)]
    pub(crate) shutdown_grace_secs: u64,
    /// Require the API key on /metrics too.
    #[arg(long)]
    pub(crate) metrics_need_api_key: bool,
    /// Most completions (prompts × n) one request may ask for (more is a 400).
    #[arg(long, default_value_t = multilora_server::DEFAULT_MAX_CHOICES_PER_REQUEST)]
    pub(crate) max_choices_per_request: usize,
    /// Most HTTP requests handled at once across all routes (more get 503).
    #[arg(long, default_value_t = multilora_server::DEFAULT_MAX_CONCURRENT_REQUESTS)]
    pub(crate) max_concurrent_requests: usize,
    /// Most open connections (more are closed as they arrive).
    #[arg(long, default_value_t = multilora_server::DEFAULT_MAX_CONNECTIONS)]
    pub(crate) max_connections: usize,
    /// Seconds a client has to send a request's headers.
    #[arg(long, default_value_t = multilora_server::DEFAULT_HEADER_READ_TIMEOUT.as_secs_f64())]
    pub(crate) header_read_timeout: f64,
    /// Seconds without a sign of life from the engine loop before /health answers 503.
    #[arg(long, default_value_t = multilora_server::DEFAULT_HEALTH_STALL_TIMEOUT.as_secs_f64())]
    pub(crate) health_stall_timeout: f64,
}

/// A duration flag in seconds: finite and positive.
fn seconds(flag: &str, v: f64) -> Result<Duration, Failure> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Failure::input(anyhow!("--{flag} must be a positive number of seconds, got {v}")))
}

/// Resolves once the engine has failed (polled: the engine publishes its state).
async fn engine_failed(engine: multilora::EngineHandle) {
    loop {
        if let LoopState::Failed { .. } = engine.health().state {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// vLLM's switch: `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to `True` / `1`.
fn env_allows_updates() -> bool {
    std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
}

/// The resolvers the flags ask for, added to `b` with what they may load allowed; refused
/// without runtime updating (vLLM asks resolvers only then), so a flag never does nothing.
fn resolvers(a: &ServeArgs, updates: bool) -> Result<impl FnOnce(EngineBuilder) -> EngineBuilder, Failure> {
    let dir = a.lora_resolver_dir.clone().filter(|d| !d.as_os_str().is_empty());
    let hub = match a.lora_resolver_hub_repos.iter().filter(|r| !r.trim().is_empty()).collect::<Vec<_>>() {
        repos if repos.is_empty() => None,
        repos => Some(HubResolver::new(repos).map_err(|e| Failure::input(anyhow!("--lora-resolver-hub-repos: {e}")))?),
    };
    if (dir.is_some() || hub.is_some()) && !updates {
        return Err(Failure::input(anyhow!(
            "--lora-resolver-dir / --lora-resolver-hub-repos (or VLLM_LORA_RESOLVER_CACHE_DIR / \
             VLLM_LORA_RESOLVER_HF_REPO_LIST) need --allow-runtime-lora-updating (or \
             VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
        )));
    }
    if let Some(d) = &dir
        && !d.is_dir()
    {
        return Err(Failure::input(anyhow!("--lora-resolver-dir {}: not a directory", d.display())));
    }
    Ok(move |mut b: EngineBuilder| {
        if let Some(d) = dir {
            b = b.allowed_lora_root(d.clone()).lora_resolver(DirectoryResolver::new(d));
        }
        if let Some(h) = hub {
            for repo in h.repos() {
                b = b.allowed_lora_hub_repo(repo);
            }
            b = b.lora_resolver(h);
        }
        b
    })
}

/// Waits for `signal` (SIGINT / SIGTERM), then drains `drain` for at most `grace`; or returns at
/// once when the engine fails.
async fn stop(
    engine: multilora::EngineHandle,
    signal: impl std::future::Future<Output = ()>,
    drain: Drain,
    grace: Duration,
) {
    tokio::select! {
        () = signal => {}
        () = engine_failed(engine) => {
            tracing::error!("the engine failed: shutting the server down");
            return;
        }
    }
    drain.start();
    tracing::info!(
        in_flight = drain.in_flight(),
        grace_s = grace.as_secs_f64(),
        "draining: /health and new requests answer 503 while admitted requests finish"
    );
    if tokio::time::timeout(grace, drain.finished()).await.is_err() {
        tracing::warn!(in_flight = drain.in_flight(), "grace period over: cancelling the requests still in flight");
    }
}

/// Runs `serve`.
pub(crate) fn run(a: ServeArgs) -> Result<(), Failure> {
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            (a.host.as_str(), a.port).to_socket_addrs().ok().and_then(|mut it| it.next()).ok_or(())
        })
        .map_err(|()| Failure::input(anyhow!("--host {:?} is not an address", a.host)))?;
    let updates = a.allow_runtime_lora_updating || env_allows_updates();
    if updates && a.allowed_lora_roots.is_empty() && a.lora_resolver_dir.is_none() {
        tracing::warn!(
            "runtime lora updating is on but --allowed-lora-roots is empty: every local path will be refused"
        );
    }
    let parser = a.tool_call_parser.as_deref().and_then(multilora_server::ToolCallParser::from_name);
    let roots = a.allowed_lora_roots.clone();
    let add_resolvers = resolvers(&a, updates)?;
    let engine = a.engine.build(|mut b| {
        b = b.allow_runtime_lora_updating(updates);
        for r in roots {
            b = b.allowed_lora_root(r);
        }
        add_resolvers(b)
    })?;
    let header_read_timeout = seconds("header-read-timeout", a.header_read_timeout)?;
    let stall = seconds("health-stall-timeout", a.health_stall_timeout)?;
    let drain = Drain::new();
    let mut config = ServerConfig::default()
        .drain(drain.clone())
        .max_waiting_requests(a.max_waiting_requests)
        .max_choices_per_request(a.max_choices_per_request)
        .max_concurrent_requests(a.max_concurrent_requests)
        .health_stall_timeout(stall)
        .metrics_need_key(a.metrics_need_api_key)
        .trust_request_chat_template(a.trust_request_chat_template)
        .responses_store(a.responses_store);
    if let Some(key) = &a.api_key {
        config = config.api_key(key.clone());
    }
    if let (true, Some(parser)) = (a.enable_auto_tool_choice, parser) {
        config = config.auto_tool_choice(parser);
    }
    if let Some(path) = &a.chat_template {
        let t = ChatTemplate::from_file(path, engine.config().chat_template.as_ref())
            .map_err(|e| Failure::input(anyhow!("--chat-template {}: {e}", path.display())))?;
        config = config.chat_template(t);
    }
    let app = multilora_server::router(engine.handle(), config).map_err(|e| Failure::input(anyhow!("{e}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("multilora-http")
        .build()
        .context("starting the async runtime")?;
    // The drain takes the grace period; what is left after it is closing idle connections.
    let options = ServeOptions::default()
        .grace(Duration::from_secs(1))
        .header_read_timeout(header_read_timeout)
        .max_connections(a.max_connections);
    let handle = engine.handle();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        // Caught from before the line that says the server is up.
        let signal = multilora_server::shutdown_signal();
        tracing::info!(address = %local, "serving");
        eprintln!("multilora serving {} on http://{local}", engine.config().served_model_name);
        let stop = stop(handle.clone(), signal, drain, Duration::from_secs(a.shutdown_grace_secs));
        multilora_server::serve_with(listener, app, stop, options).await.context("serving")
    })?;
    runtime.shutdown_timeout(Duration::from_secs(1));
    let state = handle.health().state;
    engine.shutdown();
    if let LoopState::Failed { reason } = state {
        return Err(Failure::from(anyhow!("the engine failed: {reason}")));
    }
    eprintln!("multilora stopped");
    Ok(())
}
