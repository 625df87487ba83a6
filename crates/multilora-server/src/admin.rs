//! The model list, vLLM's runtime adapter endpoints, and `/health`. Loading reads and validates
//! files, so it runs on a blocking thread and answers once the adapter is registered: in host
//! memory, or, with every entry pinned by requests, queued for the first that frees (the reply
//! says which).

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use multilora::{EngineError, EngineHandle, LoopState, Tier};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::protocol::{LoadLoraRequest, UnloadLoraRequest, parse_body};
use crate::state::AppState;

/// `GET /health`: 200 while the engine loop runs and has shown a sign of life within the stall
/// timeout, and the server is not draining; else 503 with the reason (draining, failed, shut
/// down, or not alive for how long). Read from what the loop publishes, so it answers at once
/// even when the loop is stuck.
pub(crate) async fn health(State(state): State<AppState>) -> Response {
    if state.drain.is_draining() {
        return Error::Draining.into_response();
    }
    let h = state.engine.health();
    let timeout = state.config.health_stall_timeout;
    if h.is_healthy(timeout) {
        return StatusCode::OK.into_response();
    }
    let message = match &h.state {
        LoopState::Failed { reason } => format!("the engine failed: {reason}"),
        LoopState::Running => format!(
            "the engine loop has shown no sign of life for {:.1} s (stall timeout {:.1} s)",
            h.since_heartbeat.as_secs_f64(),
            timeout.as_secs_f64()
        ),
        _ => "the engine has shut down".to_string(),
    };
    let body =
        json!({"error": {"message": message, "type": "server_error", "param": null, "code": "engine_unhealthy"}});
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// The name of a tier in API bodies and metric labels.
pub(crate) fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::Device => "device",
        Tier::Cpu => "cpu",
        Tier::Disk => "disk",
        _ => "unknown",
    }
}

/// `GET /v1/models`: the base model, then every adapter (vLLM's model cards, plus this engine's
/// rank, fingerprint, tier and the dtype it is served in under `multilora`; an adapter also
/// names its slots' dtype), then the adapters the resolvers offer that no request loaded yet
/// (tier `disk`, `"discovered": true`), which vLLM does not list: a router that routes by this
/// list can then send them here.
pub(crate) async fn models(State(state): State<AppState>) -> Result<Json<Value>> {
    let engine = state.engine.clone();
    let (mut list, discovered) = blocking(move || Ok((engine.models(), engine.discoverable_adapters()))).await?;
    let first_discovered = list.len();
    list.extend(discovered);
    let cfg = state.engine.config();
    let (max_model_len, dtype, lora_dtype) = (cfg.max_model_len, cfg.dtype.torch_name(), cfg.lora_dtype.torch_name());
    let data: Vec<Value> = list
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut card = json!({
                "id": m.id,
                "object": "model",
                "created": state.started,
                "owned_by": state.config.owned_by,
                "root": m.source,
                "parent": m.parent,
                "max_model_len": max_model_len,
                "permission": [],
                "multilora": if m.parent.is_some() {
                    json!({"rank": m.rank, "fingerprint": m.fingerprint, "tier": tier_name(m.tier),
                           "dtype": dtype, "lora_dtype": lora_dtype})
                } else {
                    json!({"rank": m.rank, "fingerprint": m.fingerprint, "tier": tier_name(m.tier), "dtype": dtype})
                },
            });
            if i >= first_discovered {
                card["multilora"]["discovered"] = Value::Bool(true);
            }
            card
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`. A load or reload that
/// finds every host-memory entry pinned by requests is not refused: the adapter is validated and
/// registered, and the reply says that it goes into host memory once an entry frees (its
/// requests wait until then), as vLLM lets its CPU cache run over rather than fail a load.
pub(crate) async fn load_lora(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req: LoadLoraRequest = parse_body(&body)?;
    if req.lora_name.is_empty() || req.lora_path.is_empty() {
        return Err(Error::bad("lora_name", "lora_name and lora_path are both required"));
    }
    let engine = state.engine.clone();
    let name = req.lora_name.clone();
    let cached = blocking(move || {
        if !req.load_inplace && engine.models().iter().any(|m| m.parent.is_some() && m.id == req.lora_name) {
            return Err(EngineError::InvalidRequest {
                reason: format!(
                    "the lora adapter {:?} has already been loaded; pass \"load_inplace\": true to replace it",
                    req.lora_name
                ),
            });
        }
        load(&engine, &req)
    })
    .await?;
    tracing::info!(adapter = %name, cached, "lora adapter loaded");
    let text = if cached {
        format!("Success: LoRA adapter '{name}' added successfully.")
    } else {
        format!(
            "Success: LoRA adapter '{name}' added successfully; every host-memory entry is in use by \
             running requests, so it is cached once one frees, and its requests wait until then."
        )
    };
    Ok((StatusCode::OK, text).into_response())
}

/// `load_inplace` replaces a served adapter's weights, or loads it if it is new (vLLM's
/// meaning). Whether the adapter is in host memory now.
fn load(engine: &EngineHandle, req: &LoadLoraRequest) -> std::result::Result<bool, EngineError> {
    if req.load_inplace {
        match engine.reload_adapter(&req.lora_name, &req.lora_path) {
            Err(EngineError::ModelNotFound { .. }) => {}
            other => return other,
        }
    }
    engine.load_adapter(&req.lora_name, &req.lora_path)
}

/// `POST /v1/unload_lora_adapter {lora_name}`.
pub(crate) async fn unload_lora(State(state): State<AppState>, body: Bytes) -> Result<Response> {
    let req: UnloadLoraRequest = parse_body(&body)?;
    let engine = state.engine.clone();
    let name = req.lora_name.clone();
    blocking(move || engine.unload_adapter(&req.lora_name)).await?;
    tracing::info!(adapter = %name, "lora adapter unloaded");
    Ok((StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")).into_response())
}

/// Runs an engine call that blocks (file reads, a round trip to the engine loop) off the async
/// worker threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::result::Result<T, EngineError> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(Error::Engine),
        Err(e) => Err(Error::Blocking(e)),
    }
}
