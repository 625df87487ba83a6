//! The server over HTTP on the PEFT fixtures: the model list, concurrent mixed-adapter greedy
//! completions equal to the PEFT reference and to the engine's own outputs, streaming (with `n`,
//! usage and chat), and the metrics text with vLLM's names and labels.

mod common;

use anyhow::Result;
use common::{BASE, Server, builder, cases, ids, logprob_ids, samples, sse_events, value};
use futures_util::future::join_all;
use multilora::{Engine, GenerateRequest, SamplingParams};
use multilora_server::{ChatTemplate, ServerConfig};
use openmetrics_parser::OpenMetricsValue;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_the_base_and_every_adapter() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    let (status, body) = server.get("/v1/models").await?;
    assert_eq!(status, 200);
    let body: Value = serde_json::from_str(&body)?;
    assert_eq!(body["object"], "list");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 1 + common::ADAPTERS.len());
    assert_eq!((data[0]["id"].as_str(), &data[0]["parent"]), (Some(BASE), &Value::Null));
    assert_eq!(data[0]["multilora"]["dtype"], "float32", "the dtype the base is served in");
    for &(name, rel) in common::ADAPTERS {
        let m = data.iter().find(|m| m["id"] == name).unwrap_or_else(|| panic!("{name} not listed"));
        assert_eq!(m["object"], "model");
        assert_eq!(m["parent"], BASE);
        assert_eq!(m["root"], common::path(rel));
        assert_eq!(m["owned_by"], "multilora");
        assert_eq!((&m["multilora"]["dtype"], &m["multilora"]["lora_dtype"]), (&json!("float32"), &json!("float32")));
    }
    server.stop().await
}

/// The checkpoint's `generation_config.json` fills what a request leaves unset (vLLM's
/// `--generation-config auto`): here greedy and 3 tokens, so a completion naming neither is
/// the greedy 3-token one; its EOS ids join `config.json`'s; off, vLLM's defaults hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoints_generation_config_fills_unset_fields() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let base = tmp.path().join("base");
    common::copy_dir(&common::path("base"), &base)?;
    let generation = json!({"temperature": 0.0, "max_new_tokens": 3, "eos_token_id": [2, 9], "do_sample": true});
    std::fs::write(base.join("generation_config.json"), generation.to_string())?;
    let b = Engine::builder(base.display().to_string()).served_model_name(BASE).kv_cache_bytes(16 << 20);
    let server = Server::start(b, ServerConfig::default()).await?;
    assert_eq!(server.engine().config().eos_token_ids, vec![2, 9]);
    let prompt = json!({"model": BASE, "prompt": [1, 294, 488, 497]});
    let (status, unset) = server.post("/v1/completions", &prompt).await?;
    assert_eq!(status, 200, "{unset}");
    assert_eq!(unset["usage"]["completion_tokens"], 3, "max_new_tokens is the default max_tokens: {unset}");
    let mut greedy = prompt.clone();
    (greedy["temperature"], greedy["max_tokens"]) = (json!(0.0), json!(3));
    let (_, want) = server.post("/v1/completions", &greedy).await?;
    assert_eq!(unset["choices"][0]["text"], want["choices"][0]["text"], "temperature 0 from the file");
    // The request's own fields win.
    let mut own = prompt.clone();
    own["max_tokens"] = json!(5);
    let (_, five) = server.post("/v1/completions", &own).await?;
    assert_eq!(five["usage"]["completion_tokens"], 5);
    server.stop().await?;
    let off = Engine::builder(base.display().to_string()).generation_config(false).kv_cache_bytes(16 << 20).build()?;
    let p = off.config().default_params();
    assert_eq!((p.temperature, p.max_tokens, off.config().eos_token_ids.clone()), (1.0, None, vec![2]));
    Ok(())
}

/// Every greedy generation case of the fixtures, all at once over HTTP: the token ids are PEFT's
/// and the text is what the engine gives the same request directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_mixed_completions_match_peft_and_the_engine() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    let cases = cases()?;
    let gens = cases["generation"].as_array().unwrap().clone();
    let requests = gens.iter().map(|g| {
        let model = g["adapter"].as_str().unwrap_or(BASE).to_string();
        let body = json!({
            "model": model, "prompt": g["input_ids"], "max_tokens": g["max_new_tokens"],
            "temperature": 0, "ignore_eos": true, "logprobs": 0, "return_tokens_as_token_ids": true,
        });
        let server = &server;
        async move { server.post("/v1/completions", &body).await }
    });
    let responses = join_all(requests).await;
    let handle = server.engine().handle();
    for (g, r) in gens.iter().zip(responses) {
        let (status, body) = r?;
        assert_eq!(status, 200, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(logprob_ids(choice), ids(&g["output_ids"]), "adapter {}", g["adapter"]);
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], g["max_new_tokens"]);
        assert_eq!(body["usage"]["prompt_tokens"].as_u64(), Some(ids(&g["input_ids"]).len() as u64));

        let model = g["adapter"].as_str().unwrap_or(BASE).to_string();
        let mut params = SamplingParams::greedy(g["max_new_tokens"].as_u64().unwrap() as usize);
        params.ignore_eos = true;
        let req =
            GenerateRequest::new(model, ids(&g["input_ids"])).params(params.validate(handle.config().vocab_size)?);
        let h = handle.clone();
        let direct = tokio::task::spawn_blocking(move || h.submit(req)?.collect_blocking()).await??;
        assert_eq!(choice["text"].as_str(), Some(direct.text.as_str()));
    }
    server.wait_idle().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_gives_the_same_text_with_n_and_usage() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    let body = json!({"model": "all_r16", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true});
    let (status, whole) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 200, "{whole}");
    let expected = whole["choices"][0]["text"].as_str().unwrap().to_string();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["n"] = json!(2);
    streamed["stream_options"] = json!({"include_usage": true});
    let resp = server.client.post(format!("{}/v1/completions", server.url)).json(&streamed).send().await?;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str()?.starts_with("text/event-stream"));
    let events = sse_events(resp).await?;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut texts = [String::new(), String::new()];
    let mut finished = [None, None];
    let mut usage = Value::Null;
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e)?;
        assert_eq!(chunk["object"], "text_completion");
        if chunk["choices"].as_array().is_some_and(Vec::is_empty) {
            usage = chunk["usage"].clone();
            continue;
        }
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        texts[i].push_str(c["text"].as_str().unwrap());
        if let Some(r) = c["finish_reason"].as_str() {
            finished[i] = Some(r.to_string());
        }
    }
    assert_eq!(texts, [expected.clone(), expected], "greedy choices are the non-streamed text");
    assert_eq!(finished, [Some("length".to_string()), Some("length".to_string())]);
    assert_eq!(usage["completion_tokens"], 24);
    assert_eq!(usage["prompt_tokens"], whole["usage"]["prompt_tokens"], "the prompt is counted once");
    server.wait_idle().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_uses_the_given_template_and_streams() -> Result<()> {
    let template = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
        "<s>",
        "</s>",
    )?;
    let server = Server::start(builder(), ServerConfig::default().chat_template(template)).await?;
    let body = json!({"model": "qv_r8", "messages": [{"role": "user", "content": "Hello there"}],
                      "max_completion_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let (status, whole) = server.post("/v1/chat/completions", &body).await?;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(2));

    // The prompt is the rendered template, tokenized without special tokens.
    let rendered = "user: Hello there\nassistant:";
    let prompt_ids = server.engine().handle().tokenize(rendered, false)?;
    assert_eq!(whole["usage"]["prompt_tokens"].as_u64(), Some(prompt_ids.len() as u64));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = server.client.post(format!("{}/v1/chat/completions", server.url)).json(&streamed).send().await?;
    let events = sse_events(resp).await?;
    let first: Value = serde_json::from_str(&events[0])?;
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(String::from))
        .collect();
    assert_eq!(Some(text.as_str()), choice["message"]["content"].as_str());
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_vllm_names_and_lora_labels() -> Result<()> {
    let server = Server::start(builder(), ServerConfig::default()).await?;
    // A long request on one adapter, so the scrape sees it running.
    let long = json!({"model": "rank32", "prompt": "a b c", "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut resp = server.client.post(format!("{}/v1/completions", server.url)).json(&long).send().await?;
    assert_eq!(resp.status(), 200);
    // The headers come at once; once its first token arrives, the request is running.
    assert!(resp.chunk().await?.is_some_and(|c| c.starts_with(b"data: ")));
    // The page is the snapshot the loop publishes (at most 20 ms old while it steps).
    let s = server.scrape_until(|s| value(s, "vllm:num_requests_running", &[]) == 1.0).await?;
    let info = samples(&s, "vllm:lora_requests_info");
    assert_eq!(info.len(), 1);
    let label = |k: &str| info[0].0.get(k).cloned();
    assert_eq!(label("max_lora").as_deref(), Some("8"));
    assert_eq!(label("running_lora_adapters").as_deref(), Some("rank32"));
    assert_eq!(label("waiting_lora_adapters").as_deref(), Some(""));
    assert_eq!(value(&s, "vllm:num_requests_running", &[("model_name", BASE)]), 1.0);
    assert!(value(&s, "vllm:kv_cache_usage_perc", &[]) > 0.0);
    assert_eq!(value(&s, "multilora_adapter_tier", &[("adapter", "rank32"), ("tier", "device")]), 1.0);
    drop(resp); // the client goes away: the request is cancelled

    let s = server.wait_idle().await?;
    assert_eq!(value(&s, "vllm:request_success", &[("finished_reason", "abort")]), 1.0);
    assert_eq!(value(&s, "vllm:num_requests_waiting_by_reason", &[("reason", "deferred")]), 0.0);
    assert_eq!(value(&s, "vllm:prompt_tokens", &[]), 4.0, "BOS + 3 tokens");
    assert!(value(&s, "multilora_adapter_requests", &[("adapter", "rank32")]) == 1.0);
    let ttft = samples(&s, "vllm:time_to_first_token_seconds");
    assert!(
        matches!(&ttft[0].1, OpenMetricsValue::Histogram(h) if h.count == Some(1) && !h.buckets.is_empty()),
        "{ttft:?}"
    );
    for name in [
        "vllm:generation_tokens",
        "vllm:prefix_cache_queries",
        "multilora_adapter_loads",
        "vllm:num_preemptions",
        "multilora_step_rows",
        "multilora_step_adapters",
        "vllm:e2e_request_latency_seconds",
    ] {
        assert!(!samples(&s, name).is_empty(), "{name} missing");
    }
    // Step metrics: one step per token at least, each step's tokens counted once.
    let steps = value(&s, "multilora_steps", &[]);
    assert!(steps >= 2.0, "{steps} steps");
    let per_step = samples(&s, "vllm:iteration_tokens_total");
    assert!(matches!(&per_step[0].1, OpenMetricsValue::Histogram(h) if h.count == Some(steps as u64)), "{per_step:?}");
    let durations = samples(&s, "multilora_step_duration_seconds");
    assert!(
        matches!(&durations[0].1, OpenMetricsValue::Histogram(h) if h.count == Some(steps as u64)),
        "{durations:?}"
    );
    let prefills = samples(&s, "multilora_prefill_tokens_per_step");
    assert!(
        matches!(&prefills[0].1, OpenMetricsValue::Histogram(h) if h.sum.as_ref().map(|n| n.as_f64()) == Some(4.0)),
        "one prefill of BOS + 3 tokens: {prefills:?}"
    );
    server.stop().await
}
