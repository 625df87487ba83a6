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
//! - More than `max_num_seqs + max_waiting_requests` engine requests in flight get 429, counted
//!   (prompts × `n`) before any is built; more than `max_choices_per_request` in one HTTP
//!   request is a 400.
//! - Structured outputs (`response_format`, vLLM's `structured_outputs` and `guided_*`) and
//!   `tools` with every `tool_choice` are served: each row of a batch follows its own grammar.
//!   Fields that would change the output if honoured and are not implemented (beam search,
//!   logits processors, …) are refused with a 400 naming them, not ignored.
//! - Hardening: every route shares one concurrency limit (503 beyond it), a panicking handler
//!   answers 500 and the server goes on, the API key is compared in constant time, and
//!   [`serve_with`] drops clients that do not send their request head within a timeout.
//! - `/health` and `/metrics` read what the engine loop publishes, never waiting on it: a
//!   failed, stopped or stalled loop is a 503 and `multilora_engine_up 0`.
//! - Leaving a fleet: once the [`Drain`] of [`ServerConfig::drain`] is started, `/health` and new
//!   generation requests answer 503 (`server_draining`) while admitted ones finish, so a router
//!   moves away; `/v1/models` also lists the adapters the engine's resolvers offer, so a router
//!   that routes by it sends adapters nobody loaded yet.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod chat;
mod completions;
mod config;
mod conversation;
mod drain;
mod error;
#[cfg(test)]
mod fuzz_bodies;
mod generation;
mod messages;
mod metrics;
mod protocol;
mod responses;
mod serve;
mod state;
mod structured;
mod template;
mod tokenize;
mod tool_parsers;
mod tools;

use std::any::Any;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use multilora::EngineHandle;
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower_http::catch_panic::CatchPanicLayer;

pub use config::{
    DEFAULT_HEALTH_STALL_TIMEOUT, DEFAULT_MAX_CHOICES_PER_REQUEST, DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_WAITING_REQUESTS, ServerConfig,
};
pub use drain::Drain;
pub use error::{Error, Result};
pub use serve::{DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_MAX_CONNECTIONS, ServeOptions, serve, serve_with};
pub use template::{ChatTemplate, MAX_REQUEST_TEMPLATE_BYTES};
pub use tool_parsers::ToolCallParser;
pub use tools::MAX_TOOLS;

use crate::state::AppState;

/// The server's routes over a running engine. Reads the model's chat template (unless `config`
/// overrides it), so a template that does not compile fails here, at start.
pub fn router(engine: EngineHandle, config: ServerConfig) -> Result<Router> {
    let model_template = match config.chat_template {
        Some(_) => None,
        None => engine.config().chat_template.as_ref().map(ChatTemplate::from_source).transpose()?,
    };
    let runtime_updates = engine.config().allow_runtime_lora_updating;
    let state = AppState::new(engine, config, model_template);
    let mut v1 = Router::new()
        .route("/v1/models", get(admin::models))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize));
    if runtime_updates {
        v1 = v1
            .route("/v1/load_lora_adapter", post(admin::load_lora))
            .route("/v1/unload_lora_adapter", post(admin::unload_lora));
    }
    let v1 = v1
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        .route_layer(middleware::from_fn_with_state(state.clone(), count_request));
    let mut metrics_route = Router::new().route("/metrics", get(metrics::metrics));
    if state.config.metrics_need_key {
        metrics_route = metrics_route.route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    }
    let limit = state.config.max_concurrent_requests;
    let routes = Router::new().route("/health", get(admin::health)).merge(metrics_route).merge(v1).with_state(state);
    Ok(harden(routes, limit))
}

/// What [`router`] puts around its routes, for an embedder's own routes too: one concurrency
/// limit shared by every route (`limit` requests handled at once; more are answered 503
/// `server_busy` at once, not queued), and a panicking handler answered 500 while the server
/// goes on.
pub fn harden(routes: Router, limit: usize) -> Router {
    routes.layer(
        ServiceBuilder::new()
            .layer(CatchPanicLayer::custom(panic_response))
            .layer(HandleErrorLayer::new(
                move |_: tower::BoxError| async move { Error::Busy { limit }.into_response() },
            ))
            .load_shed()
            .layer(GlobalConcurrencyLimitLayer::new(limit)),
    )
}

/// A handler that panicked answers 500 in the API's error shape; the server goes on.
fn panic_response(payload: Box<dyn Any + Send + 'static>) -> Response {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string());
    Error::Panicked { message }.into_response()
}

/// `Authorization: Bearer <key>` when an API key is set (on `/v1/*`, and `/metrics` if asked).
/// Both sides are hashed and the digests compared in constant time, so neither the key's bytes
/// nor its length can be learned from timing.
/// Counts each request by its route, before the key is checked (`/metrics`).
async fn count_request(State(state): State<AppState>, req: Request, next: Next) -> Response {
    state.count_request(req.uri().path());
    next.run(req).await
}

async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        // OpenAI's clients send `Authorization: Bearer <key>`, Anthropic's `x-api-key: <key>`.
        let headers = req.headers();
        let bearer = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        let given = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok())).unwrap_or_default();
        // blake3's `Hash` compares in constant time.
        if blake3::hash(given.as_bytes()) != blake3::hash(key.as_bytes()) {
            return Error::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM. The handlers are installed when this is
/// called (inside a tokio runtime), not when the future is first polled: a signal that arrives
/// between the call and the first poll — right after a server says it is serving — is caught,
/// not left to the default action that ends the process.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (term, int) = (signal(SignalKind::terminate()).ok(), signal(SignalKind::interrupt()).ok());
        async move {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(term) => {}
                () = wait(int) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt;

    use super::*;

    async fn call(app: &Router, uri: &str) -> (StatusCode, String) {
        let resp = app.clone().oneshot(Request::get(uri).body(Body::empty()).expect("request")).await.expect("call");
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn a_panicking_handler_is_a_500_and_the_server_goes_on() {
        let routes = Router::new()
            .route(
                "/boom",
                get(|| async {
                    if std::hint::black_box(true) {
                        panic!("handler bug");
                    }
                    "unreachable"
                }),
            )
            .route("/ok", get(|| async { "fine" }));
        let app = harden(routes, 8);
        let (status, body) = call(&app, "/boom").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(body.contains("handler bug") && body.contains("\"code\":\"internal\""), "{body}");
        assert_eq!(call(&app, "/ok").await, (StatusCode::OK, "fine".to_string()));
    }

    #[tokio::test]
    async fn beyond_the_concurrency_limit_requests_get_503_at_once() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let wait = Arc::clone(&gate);
        let routes = Router::new()
            .route(
                "/slow",
                get(move || {
                    let wait = Arc::clone(&wait);
                    async move {
                        wait.notified().await;
                        "slow"
                    }
                }),
            )
            .route("/ok", get(|| async { "fine" }));
        let app = harden(routes, 1);
        let slow = tokio::spawn({
            let app = app.clone();
            async move { call(&app, "/slow").await }
        });
        // Until the slow request holds the one permit, /ok may still get through.
        let mut busy = None;
        for _ in 0..200 {
            let (status, body) = call(&app, "/ok").await;
            if status == StatusCode::SERVICE_UNAVAILABLE {
                busy = Some(body);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let body = busy.expect("a request beyond the limit got 503");
        assert!(body.contains("server_busy"), "{body}");
        gate.notify_one();
        assert_eq!(slow.await.expect("slow request").0, StatusCode::OK);
        assert_eq!(call(&app, "/ok").await.0, StatusCode::OK);
    }
}
