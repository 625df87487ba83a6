//! `multilora serve`: the OpenAI-compatible server (crate `multilora-server`) over an engine built
//! from vLLM-named flags, until SIGINT or SIGTERM; exits 0 after a graceful shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::Args;
use multilora_server::{ChatTemplate, ServerConfig};

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
    /// Requests waiting beyond --max-num-seqs before new ones get 429.
    #[arg(long, default_value_t = multilora_server::DEFAULT_MAX_WAITING_REQUESTS)]
    pub(crate) max_waiting_requests: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub(crate) shutdown_grace_secs: u64,
}

/// vLLM's switch: `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to `True` / `1`.
fn env_allows_updates() -> bool {
    std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
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
    if updates && a.allowed_lora_roots.is_empty() {
        tracing::warn!(
            "runtime lora updating is on but --allowed-lora-roots is empty: every local path will be refused"
        );
    }
    let roots = a.allowed_lora_roots.clone();
    let engine = a.engine.build(|mut b| {
        b = b.allow_runtime_lora_updating(updates);
        for r in roots {
            b = b.allowed_lora_root(r);
        }
        b
    })?;
    let mut config = ServerConfig::default().max_waiting_requests(a.max_waiting_requests);
    if let Some(key) = &a.api_key {
        config = config.api_key(key.clone());
    }
    if let Some(path) = &a.chat_template {
        let t = ChatTemplate::from_file(path, &engine.config().model_dir)
            .map_err(|e| Failure::input(anyhow!("--chat-template {}: {e}", path.display())))?;
        config = config.chat_template(t);
    }
    let app = multilora_server::router(engine.handle(), config).map_err(|e| Failure::input(anyhow!("{e}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("multilora-http")
        .build()
        .context("starting the async runtime")?;
    let grace = Duration::from_secs(a.shutdown_grace_secs);
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        tracing::info!(address = %local, "serving");
        eprintln!("multilora serving {} on http://{local}", engine.config().served_model_name);
        multilora_server::serve(listener, app, multilora_server::shutdown_signal(), grace).await.context("serving")
    })?;
    runtime.shutdown_timeout(Duration::from_secs(1));
    engine.shutdown();
    eprintln!("multilora stopped");
    Ok(())
}
