//! `GET /metrics`: the engine's [`MetricsSnapshot`] in the OpenMetrics text format (which
//! Prometheus scrapes), encoded by `prometheus-client`. Names follow vLLM's where one exists, with
//! its `model_name` label, so dashboards and LoRA-affinity routers that read
//! `vllm:lora_requests_info` work unchanged; this engine's own metrics are `multilora_*`.

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use multilora::{Histogram, MetricsSnapshot, ModelInfo};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::admin::{blocking, tier_name};
use crate::error::{Error, Result};
use crate::state::AppState;

/// OpenMetrics' content type.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub(crate) async fn metrics(State(state): State<AppState>) -> Result<Response> {
    let engine = state.engine.clone();
    let models = blocking(move || Ok(engine.models())).await?;
    let health = state.engine.health();
    let up = health.is_healthy(state.config.health_stall_timeout);
    let metrics = state.engine.published_metrics();
    let cfg = state.engine.config();
    let model_name = cfg.served_model_name.clone();
    let heartbeat_age = health.since_heartbeat.as_secs_f64();
    let cache = CacheConfig {
        block_size: cfg.block_size,
        num_gpu_blocks: cfg.num_kv_blocks,
        cache_dtype: cfg.dtype.torch_name(),
        enable_prefix_caching: cfg.enable_prefix_caching,
    };
    let endpoints = crate::state::ENDPOINTS
        .iter()
        .zip(state.endpoint_requests.iter())
        .map(|(e, n)| (e.to_string(), n.load(std::sync::atomic::Ordering::Relaxed)))
        .collect();
    let snapshot = Snapshot { metrics, models, model_name, up, heartbeat_age, cache, endpoints };
    let text = render(snapshot).map_err(Error::Metrics)?;
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response())
}

/// Encodes one snapshot.
fn render(snapshot: Snapshot) -> std::result::Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

#[derive(Debug)]
struct Snapshot {
    metrics: Arc<MetricsSnapshot>,
    models: Vec<ModelInfo>,
    model_name: String,
    /// The engine loop runs and is alive.
    up: bool,
    /// Seconds since its last sign of life.
    heartbeat_age: f64,
    /// What `vllm:cache_config_info` carries.
    cache: CacheConfig,
    /// HTTP requests per endpoint.
    endpoints: Vec<(String, u64)>,
}

/// The KV cache's configuration, in vLLM's `CacheConfig` terms.
#[derive(Debug)]
struct CacheConfig {
    block_size: usize,
    /// The KV pool's blocks, on whatever device the engine runs on (vLLM's name says GPU).
    num_gpu_blocks: usize,
    cache_dtype: &'static str,
    enable_prefix_caching: bool,
}

type Labels = Vec<(String, String)>;

/// `labels` plus `k="v"`.
fn with_label(labels: &Labels, k: &str, v: &str) -> Labels {
    let mut l = labels.clone();
    l.push((k.to_string(), esc(v)));
    l
}

/// A label value with `\`, `"` and newlines escaped, as the text format wants.
fn esc(s: &str) -> String {
    s.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

/// A gauge family; nothing at all when it has no samples (a labelled family with no children).
fn gauge<V: EncodeGaugeValue>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(Labels, V)],
) -> fmt::Result {
    if samples.is_empty() {
        return Ok(());
    }
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in samples {
        if labels.is_empty() {
            m.encode_gauge(v)?;
        } else {
            m.encode_family(labels)?.encode_gauge(v)?;
        }
    }
    Ok(())
}

/// A counter family; nothing at all when it has no samples.
fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, samples: &[(Labels, u64)]) -> fmt::Result {
    if samples.is_empty() {
        return Ok(());
    }
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in samples {
        if labels.is_empty() {
            m.encode_counter::<NoLabelSet, _, u64>(v, None)?;
        } else {
            m.encode_family(labels)?.encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
    }
    Ok(())
}

fn histogram(e: &mut DescriptorEncoder, name: &str, help: &str, labels: &Labels, h: &Histogram) -> fmt::Result {
    let mut buckets: Vec<(f64, u64)> = h.bounds.iter().copied().zip(h.counts.iter().copied()).collect();
    buckets.push((f64::MAX, h.counts.last().copied().unwrap_or(0)));
    let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
    if labels.is_empty() {
        return m.encode_histogram::<NoLabelSet>(h.sum, h.count, &buckets, None);
    }
    m.encode_family(labels)?.encode_histogram::<NoLabelSet>(h.sum, h.count, &buckets, None)
}

impl Collector for Snapshot {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let m = &self.metrics;
        let model: Labels = vec![("model_name".into(), esc(&self.model_name))];
        gauge(
            &mut e,
            "multilora_engine_up",
            "1 while the engine loop runs and is alive; 0 once it failed, stopped or stalled.",
            &[(model.clone(), u64::from(self.up))],
        )?;
        gauge(
            &mut e,
            "multilora_engine_heartbeat_age_seconds",
            "Seconds since the engine loop last showed a sign of life.",
            &[(model.clone(), self.heartbeat_age)],
        )?;
        // vLLM's info gauge (value 1) of its cache config, whose `block_size` and
        // `num_gpu_blocks` labels the llm-d / GIE endpoint picker reads; Python spells booleans.
        let c = &self.cache;
        let cache_info: Labels = vec![
            ("block_size".into(), c.block_size.to_string()),
            ("cache_dtype".into(), c.cache_dtype.to_string()),
            ("enable_prefix_caching".into(), if c.enable_prefix_caching { "True" } else { "False" }.to_string()),
            ("num_gpu_blocks".into(), c.num_gpu_blocks.to_string()),
        ];
        gauge(&mut e, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", &[(cache_info, 1u64)])?;
        let endpoints: Vec<(Labels, u64)> =
            self.endpoints.iter().map(|(path, n)| (vec![("endpoint".to_string(), esc(path))], *n)).collect();
        counter(
            &mut e,
            "multilora_http_requests",
            "HTTP requests by endpoint (every API, answered or refused).",
            &endpoints,
        )?;
        if !self.up {
            // Only what stays true of a dead loop: the cumulative counts.
            let finished: Vec<(Labels, u64)> = m
                .requests_finished
                .iter()
                .map(|(reason, n)| (with_label(&model, "finished_reason", reason), *n))
                .collect();
            counter(&mut e, "vllm:request_success", "Count of finished requests by finish reason.", &finished)?;
            let errors: Vec<(Labels, u64)> =
                m.request_errors.iter().map(|(k, n)| (vec![("kind".to_string(), esc(k))], *n)).collect();
            return counter(&mut e, "multilora_request_errors", "Failed requests by error kind.", &errors);
        }
        let with = |k: &str, v: &str| with_label(&model, k, v);
        // vLLM sets this gauge to the current time whenever it records the lists, and an endpoint
        // picker takes the series with the latest value: here, when the loop last published them.
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let updated = now - self.heartbeat_age;
        let info = vec![
            ("max_lora".to_string(), m.max_lora.to_string()),
            ("running_lora_adapters".to_string(), esc(&m.running_adapters.join(","))),
            ("waiting_lora_adapters".to_string(), esc(&m.waiting_adapters.join(","))),
        ];
        gauge(&mut e, "vllm:lora_requests_info", "Running stats on lora requests.", &[(info, updated)])?;
        gauge(
            &mut e,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &[(model.clone(), m.running as u64)],
        )?;
        gauge(
            &mut e,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &[(model.clone(), m.waiting as u64)],
        )?;
        gauge(
            &mut e,
            "vllm:num_requests_waiting_by_reason",
            "Requests waiting, by reason (deferred: held back by the adapter limit or waiting for their adapter to load).",
            &[(with("reason", "deferred"), m.deferred as u64)],
        )?;
        gauge(
            &mut e,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &[(model.clone(), m.kv_usage)],
        )?;
        counter(
            &mut e,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            &[(model.clone(), m.prompt_tokens)],
        )?;
        counter(
            &mut e,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            &[(model.clone(), m.generation_tokens)],
        )?;
        let finished: Vec<(Labels, u64)> =
            m.requests_finished.iter().map(|(reason, n)| (with("finished_reason", reason), *n)).collect();
        counter(&mut e, "vllm:request_success", "Count of finished requests by finish reason.", &finished)?;
        counter(
            &mut e,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            &[(model.clone(), m.preemptions)],
        )?;
        counter(
            &mut e,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens.",
            &[(model.clone(), m.prefix_cache_query_tokens)],
        )?;
        counter(
            &mut e,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in tokens.",
            &[(model.clone(), m.prefix_cache_hit_tokens)],
        )?;
        histogram(
            &mut e,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &model,
            &m.ttft,
        )?;
        histogram(
            &mut e,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &model,
            &m.inter_token_latency,
        )?;
        histogram(
            &mut e,
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            &model,
            &m.e2e_latency,
        )?;
        histogram(
            &mut e,
            "vllm:iteration_tokens_total",
            "Histogram of the number of tokens per engine step.",
            &model,
            &m.iteration_tokens,
        )?;
        self.encode_own(&mut e)
    }
}

impl Snapshot {
    /// This engine's own metrics: adapter tiers, loads and per-tenant usage.
    fn encode_own(&self, e: &mut DescriptorEncoder) -> fmt::Result {
        let m = &self.metrics;
        let one = |k: &str, v: &str| -> Labels { vec![(k.to_string(), esc(v))] };
        let tiers: Vec<(Labels, u64)> = self
            .models
            .iter()
            .filter(|i| i.parent.is_some())
            .map(|i| (vec![("adapter".into(), esc(&i.id)), ("tier".into(), tier_name(i.tier).into())], 1))
            .collect();
        gauge(
            e,
            "multilora_adapter_tier",
            "1 for each adapter, labelled with the tier it is in now (device, cpu, disk).",
            &tiers,
        )?;
        let occupancy = [(one("tier", "device"), m.device_tier), (one("tier", "cpu"), m.cpu_tier)];
        let entries: Vec<(Labels, u64)> = occupancy.iter().map(|(l, t)| (l.clone(), t.entries as u64)).collect();
        let capacity: Vec<(Labels, u64)> = occupancy.iter().map(|(l, t)| (l.clone(), t.capacity as u64)).collect();
        gauge(e, "multilora_adapter_tier_entries", "Adapters held in each tier.", &entries)?;
        gauge(e, "multilora_adapter_tier_capacity", "Capacity of each tier (max_loras, max_cpu_loras).", &capacity)?;
        gauge(
            e,
            "multilora_pinned_slots",
            "Device slots pinned by running requests.",
            &[(vec![], m.pinned_slots as u64)],
        )?;
        gauge(e, "multilora_kv_blocks", "KV-cache blocks in the pool.", &[(vec![], m.kv_blocks as u64)])?;
        gauge(
            e,
            "multilora_num_requests_deferred_max",
            "Most requests ever deferred at once.",
            &[(vec![], m.deferred_max as u64)],
        )?;
        counter(e, "multilora_adapter_loads", "Adapter loads into the CPU tier.", &[(vec![], m.adapter_loads)])?;
        gauge(
            e,
            "multilora_adapter_loads_waiting",
            "Adapter loads waiting for a CPU-tier entry to be unpinned (their requests wait).",
            &[(vec![], m.adapter_loads_waiting as u64)],
        )?;
        counter(
            e,
            "multilora_adapter_capacity_waits",
            "Adapter loads that had to wait for a CPU-tier entry.",
            &[(vec![], m.adapter_capacity_waits)],
        )?;
        counter(
            e,
            "multilora_adapter_evictions",
            "Adapter evictions from the CPU tier and device slots.",
            &[(vec![], m.adapter_evictions)],
        )?;
        histogram(e, "multilora_adapter_load_seconds", "Adapter load time in seconds.", &vec![], &m.adapter_load_time)?;
        counter(e, "multilora_steps", "Engine steps run.", &[(vec![], m.steps)])?;
        histogram(
            e,
            "multilora_step_duration_seconds",
            "Duration of each engine step (schedule, forward, sampling) in seconds.",
            &vec![],
            &m.step_duration,
        )?;
        histogram(
            e,
            "multilora_prefill_tokens_per_step",
            "Prompt tokens prefilled per step, in steps that prefill any (the step-time budget bounds it while streams decode).",
            &vec![],
            &m.prefill_tokens_per_step,
        )?;
        histogram(e, "multilora_step_rows", "Sequences per engine step (the batch size).", &vec![], &m.step_rows)?;
        histogram(
            e,
            "multilora_step_adapters",
            "Distinct adapters per engine step (base-model rows count none).",
            &vec![],
            &m.step_adapters,
        )?;
        histogram(
            e,
            "multilora_grammar_mask_seconds",
            "Time to compute one constrained row's allowed-token mask (structured outputs), in seconds.",
            &vec![],
            &m.grammar_mask_duration,
        )?;
        counter(
            e,
            "multilora_grammar_forced_tokens",
            "Tokens appended because a request's grammar forced them (not sampled).",
            &[(vec![], m.grammar_forced_tokens)],
        )?;
        let per = |f: fn(&multilora::AdapterUsage) -> u64| -> Vec<(Labels, u64)> {
            m.per_adapter.iter().map(|(name, u)| (one("adapter", name), f(u))).collect()
        };
        counter(
            e,
            "multilora_adapter_requests",
            "Requests admitted, per adapter (the base model under its name).",
            &per(|u| u.requests),
        )?;
        counter(
            e,
            "multilora_adapter_prompt_tokens",
            "Prompt tokens of admitted requests, per adapter.",
            &per(|u| u.prompt_tokens),
        )?;
        counter(
            e,
            "multilora_adapter_generation_tokens",
            "Tokens generated, per adapter.",
            &per(|u| u.generation_tokens),
        )?;
        let errors: Vec<(Labels, u64)> = m.request_errors.iter().map(|(k, n)| (one("kind", k), *n)).collect();
        counter(e, "multilora_request_errors", "Failed requests by error kind.", &errors)
    }
}
