//! An OpenAI-compatible HTTP server for the multilora engine, with vLLM's adapter endpoints and
//! metrics, as a library: [`router`] gives an `axum::Router` to mount next to your own routes;
//! [`serve`] runs it with graceful shutdown. The `multilora serve` command is a thin shell over
//! these two.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = multilora::Engine::builder("path/to/model").lora("sql", "path/to/sql-lora").build()?;
//! let app = multilora_server::router(engine.handle(), multilora_server::ServerConfig::default())?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! multilora_server::serve(listener, app, multilora_server::shutdown_signal(), std::time::Duration::from_secs(30))
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
//! `stream: true`), `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only when the
//! engine allows runtime updating; 404 otherwise, as vLLM), `GET /health`, `GET /metrics`.
//!
//! Decisions worth knowing:
//! - Each adapter is a model name; `n` choices become `n` engine requests batched together
//!   (choice `i` of a seeded request uses seed + i).
//! - The engine refuses an unknown model, a too long prompt or bad parameters at submit, so they
//!   are HTTP errors before any byte of a stream, and a valid stream's headers go out at once. A
//!   choice whose adapter is still loading is awaited to its first event, so a failed load is an
//!   HTTP error too, not a stream that fails.
//! - Dropping a response (a client that disconnects) cancels its engine requests.
//! - More than `max_num_seqs + max_waiting_requests` engine requests in flight get 429.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod chat;
mod completions;
mod config;
mod error;
mod generation;
mod metrics;
mod protocol;
mod state;
mod template;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use multilora::EngineHandle;

pub use config::{DEFAULT_MAX_WAITING_REQUESTS, ServerConfig};
pub use error::{Error, Result};
pub use template::ChatTemplate;

use crate::state::AppState;

/// The server's routes over a running engine. Reads the model's chat template (unless `config`
/// overrides it), so a template that does not compile fails here, at start.
pub fn router(engine: EngineHandle, config: ServerConfig) -> Result<Router> {
    let model_template = match config.chat_template {
        Some(_) => None,
        None => ChatTemplate::from_model_dir(&engine.config().model_dir)?,
    };
    let runtime_updates = engine.config().allow_runtime_lora_updating;
    let state = AppState::new(engine, config, model_template);
    let mut v1 = Router::new()
        .route("/v1/models", get(admin::models))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions));
    if runtime_updates {
        v1 = v1
            .route("/v1/load_lora_adapter", post(admin::load_lora))
            .route("/v1/unload_lora_adapter", post(admin::unload_lora));
    }
    let v1 = v1.route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    Ok(Router::new()
        .route("/health", get(admin::health))
        .route("/metrics", get(metrics::metrics))
        .merge(v1)
        .with_state(state))
}

/// `Authorization: Bearer <key>` on `/v1/*` when an API key is set.
async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let given =
            req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return Error::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
/// responses finish for up to `grace`, and returns (responses still open are dropped, which
/// cancels their requests).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let stopping = Arc::new(tokio::sync::Notify::new());
    let notify = Arc::clone(&stopping);
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!(
            grace_s = grace.as_secs_f64(),
            "shutting down: no new connections, finishing in-flight requests"
        );
        notify.notify_one();
    });
    tokio::select! {
        r = server => r,
        () = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
            tracing::warn!("grace period over: cancelling the requests still in flight");
            Ok(())
        }
    }
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
