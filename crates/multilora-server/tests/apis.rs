//! The APIs agent clients speak, beside chat completions, on the PEFT fixtures: Anthropic's
//! Messages (`/v1/messages`, `count_tokens`), OpenAI's Responses (`/v1/responses`, with and
//! without the response store), and vLLM's `/tokenize` / `/detokenize`. Each answers with what
//! chat completions generates for the same conversation (one generation path), streams its own
//! typed events in order, and refuses bad bodies in its own error shape.

mod common;

use anyhow::Result;
use common::{Server, builder, typed_events, value};
use multilora_server::{ChatTemplate, ServerConfig};
use serde_json::{Value, json};

fn config() -> Result<ServerConfig> {
    let template = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
        "<s>",
        "</s>",
    )?;
    Ok(ServerConfig::default().chat_template(template).api_key("sk-test").responses_store(2))
}

/// POSTs `body` with the key as Anthropic's clients send it.
async fn post_x(server: &Server, route: &str, body: &Value) -> Result<(u16, Value)> {
    let resp =
        server.client.post(format!("{}{route}", server.url)).header("x-api-key", "sk-test").json(body).send().await?;
    Ok((resp.status().as_u16(), resp.json().await?))
}

/// POSTs `body` with a bearer key, as OpenAI's clients send it.
async fn post_b(server: &Server, route: &str, body: &Value) -> Result<(u16, Value)> {
    let resp = server.client.post(format!("{}{route}", server.url)).bearer_auth("sk-test").json(body).send().await?;
    Ok((resp.status().as_u16(), resp.json().await?))
}

/// The streamed events of `body` at `route`.
async fn stream(server: &Server, route: &str, body: &Value) -> Result<Vec<(String, Value)>> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let resp = server.client.post(format!("{}{route}", server.url)).bearer_auth("sk-test").json(&body).send().await?;
    assert_eq!(resp.status().as_u16(), 200);
    typed_events(resp).await
}

/// Chat completions' greedy answer to `messages` from `model`: text, usage, finish reason.
async fn chat(server: &Server, model: &str, messages: Value, max_tokens: usize) -> Result<Value> {
    let body = json!({"model": model, "messages": messages, "max_completion_tokens": max_tokens, "temperature": 0});
    let (status, v) = post_b(server, "/v1/chat/completions", &body).await?;
    assert_eq!(status, 200, "{v}");
    Ok(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_answer_as_chat_does_and_stream_anthropics_events() -> Result<()> {
    let server = Server::start(builder(), config()?).await?;
    let conversation = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]);
    let want = chat(&server, "qv_r8", conversation.clone(), 8).await?;
    let body = json!({"model": "qv_r8", "max_tokens": 8, "temperature": 0, "system": "Be brief.",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]});
    let (status, got) = post_x(&server, "/v1/messages", &body).await?;
    assert_eq!(status, 200, "{got}");
    assert_eq!((got["type"].as_str(), got["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(got["content"][0]["text"], want["choices"][0]["message"]["content"], "{got} vs {want}");
    assert_eq!(got["usage"]["input_tokens"], want["usage"]["prompt_tokens"]);
    assert_eq!(got["usage"]["output_tokens"], want["usage"]["completion_tokens"]);
    let length = want["choices"][0]["finish_reason"] == "length";
    assert_eq!(got["stop_reason"], if length { "max_tokens" } else { "end_turn" });

    let (status, count) = post_x(&server, "/v1/messages/count_tokens", &body).await?;
    assert_eq!((status, &count["input_tokens"]), (200, &want["usage"]["prompt_tokens"]), "{count}");

    let events = stream(&server, "/v1/messages", &body).await?;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"], "{names:?}");
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
    assert!(events.iter().all(|(n, d)| d["type"] == n.as_str()), "each event named by its type");
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], want["usage"]["prompt_tokens"]);
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(json!(text), got["content"][0]["text"]);
    let delta = &events[events.len() - 2].1;
    assert_eq!(
        (&delta["delta"]["stop_reason"], &delta["usage"]["output_tokens"]),
        (&got["stop_reason"], &got["usage"]["output_tokens"])
    );

    // A stop sequence taken from the answer ends it there, and says which (chat says it too).
    let answer = got["content"][0]["text"].as_str().unwrap_or_default().to_string();
    println!("messages: {answer:?} ({}), {} events", got["stop_reason"], events.len());
    let stop = answer.get(2..4).filter(|s| !s.trim().is_empty());
    let stop = stop.unwrap_or_else(|| panic!("the answer {answer:?} has no stop sequence to take"));
    let mut stopped = body.clone();
    stopped["stop_sequences"] = json!(["\u{1}never", stop]);
    let (_, s) = post_x(&server, "/v1/messages", &stopped).await?;
    assert_eq!((s["stop_reason"].as_str(), s["stop_sequence"].as_str()), (Some("stop_sequence"), Some(stop)), "{s}");
    assert!(answer.starts_with(s["content"][0]["text"].as_str().unwrap_or("?")));
    let chat_stopped =
        json!({"model": "qv_r8", "messages": conversation, "max_completion_tokens": 8, "temperature": 0, "stop": stop});
    let (_, c) = post_b(&server, "/v1/chat/completions", &chat_stopped).await?;
    assert_eq!(c["choices"][0]["stop_reason"].as_str(), Some(stop), "{c}");
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_refuse_bad_bodies_in_anthropics_shape() -> Result<()> {
    let server = Server::start(builder(), config()?).await?;
    let ok = json!({"model": "qv_r8", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let cases = [
        ("max_tokens", json!({"model": "qv_r8", "messages": [{"role": "user", "content": "hi"}]}), 400),
        (
            "image",
            json!({"model": "qv_r8", "max_tokens": 4,
                         "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            400,
        ),
        ("role", json!({"model": "qv_r8", "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}), 400),
        (
            "tools",
            json!({"model": "qv_r8", "max_tokens": 4, "tools": [{"name": "f"}],
                         "messages": [{"role": "user", "content": "hi"}]}),
            400,
        ),
        ("nobody", json!({"model": "nobody", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}), 404),
        ("messages", json!({"model": "qv_r8", "max_tokens": 4, "messages": []}), 400),
        (
            "prompt",
            json!({"model": "qv_r8", "max_tokens": 4, "messages": [{"role": "user", "content": "tok ".repeat(20_000)}]}),
            400,
        ),
    ];
    for (what, body, code) in cases {
        let (status, v) = post_x(&server, "/v1/messages", &body).await?;
        assert_eq!(status, code, "{what}: {v}");
        assert_eq!(v["type"], "error", "{what}: {v}");
        let kind = if code == 404 { "not_found_error" } else { "invalid_request_error" };
        assert_eq!(v["error"]["type"], kind, "{what}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(what)), "{what}: {v}");
    }
    let resp =
        server.client.post(format!("{}/v1/messages", server.url)).header("x-api-key", "wrong").json(&ok).send().await?;
    assert_eq!(resp.status().as_u16(), 401);
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_as_chat_does_stream_in_order_and_continue_stored_ones() -> Result<()> {
    let server = Server::start(builder(), config()?).await?;
    let want = chat(
        &server,
        "base",
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me"}]),
        6,
    )
    .await?;
    let body = json!({"model": "base", "instructions": "Be brief.", "input": "Tell me", "max_output_tokens": 6,
                      "temperature": 0});
    let (status, got) = post_b(&server, "/v1/responses", &body).await?;
    assert_eq!(status, 200, "{got}");
    let text = &want["choices"][0]["message"]["content"];
    assert_eq!((&got["object"], &got["output"][0]["content"][0]["text"]), (&json!("response"), text), "{got}");
    assert_eq!(got["usage"]["input_tokens"], want["usage"]["prompt_tokens"]);
    assert_eq!(got["usage"]["output_tokens"], want["usage"]["completion_tokens"]);
    let length = want["choices"][0]["finish_reason"] == "length";
    assert_eq!(got["status"], if length { "incomplete" } else { "completed" });

    let events = stream(&server, "/v1/responses", &body).await?;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let last = if length { "response.incomplete" } else { "response.completed" };
    assert_eq!(
        names[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    assert_eq!(
        names[names.len() - 4..],
        ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    );
    for (i, (n, d)) in events.iter().enumerate() {
        assert_eq!((d["type"].as_str(), d["sequence_number"].as_u64()), (Some(n.as_str()), Some(i as u64)));
    }
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(&json!(deltas), text);
    assert_eq!(&events[events.len() - 1].1["response"]["output"][0]["content"][0]["text"], text);

    // Stored (the store keeps 2): a continuation is the conversation so far plus the new input.
    let (_, first) = post_b(&server, "/v1/responses", &body).await?;
    let id = first["id"].as_str().unwrap_or_default().to_string();
    assert_eq!(first["store"], true);
    let next = json!({"model": "base", "previous_response_id": id, "input": [{"role": "user", "content": [{"type": "input_text", "text": "More"}]}],
                      "max_output_tokens": 6, "temperature": 0});
    let (status, second) = post_b(&server, "/v1/responses", &next).await?;
    assert_eq!(status, 200, "{second}");
    let conversation = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me"},
                              {"role": "assistant", "content": text}, {"role": "user", "content": "More"}]);
    let want2 = chat(&server, "base", conversation, 6).await?;
    assert_eq!(second["output"][0]["content"][0]["text"], want2["choices"][0]["message"]["content"]);
    let (status, fetched) = server.get(&format!("/v1/responses/{id}")).await?;
    assert_eq!(status, 401, "the key guards stored responses too: {fetched}");
    let resp = server.client.get(format!("{}/v1/responses/{id}", server.url)).bearer_auth("sk-test").send().await?;
    assert_eq!(resp.json::<Value>().await?["output"], first["output"]);
    // Two more push the first out.
    post_b(&server, "/v1/responses", &body).await?;
    post_b(&server, "/v1/responses", &body).await?;
    let (status, gone) = post_b(&server, "/v1/responses", &next).await?;
    assert_eq!((status, &gone["error"]["param"]), (404, &json!("previous_response_id")), "{gone}");
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_refuse_what_they_cannot_do() -> Result<()> {
    let stateless = config()?.responses_store(0);
    let server = Server::start(builder(), stateless).await?;
    let cases = [
        ("previous_response_id", json!({"model": "base", "input": "x", "previous_response_id": "resp-1"}), 400),
        ("tools", json!({"model": "base", "input": "x", "tools": [{"type": "function", "name": "f"}]}), 400),
        ("text.format", json!({"model": "base", "input": "x", "text": {"format": {"type": "json_schema"}}}), 400),
        ("input[0].type", json!({"model": "base", "input": [{"type": "function_call_output", "output": "1"}]}), 400),
        (
            "input[0].content[0]",
            json!({"model": "base", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            400,
        ),
        ("model", json!({"model": "nobody", "input": "x"}), 404),
    ];
    for (param, body, code) in cases {
        let (status, v) = post_b(&server, "/v1/responses", &body).await?;
        assert_eq!((status, v["error"]["param"].as_str()), (code, Some(param)), "{v}");
    }
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_round_trips_and_counts_as_chat_does() -> Result<()> {
    let server = Server::start(builder(), config()?).await?;
    let text = "Hello there, tokenizer!";
    let (status, t) = post_b(&server, "/tokenize", &json!({"model": "qv_r8", "prompt": text})).await?;
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["count"].as_u64(), t["tokens"].as_array().map(|a| a.len() as u64));
    let (_, d) = post_b(&server, "/detokenize", &json!({"model": "qv_r8", "tokens": t["tokens"]})).await?;
    let special = server.engine().handle().tokenize("", true)?;
    let plain = d["prompt"].as_str().unwrap_or_default();
    assert!(plain.ends_with(text) && plain.len() - text.len() <= special.len() * 8, "{d}");
    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let (_, m) = post_b(&server, "/tokenize", &json!({"model": "qv_r8", "messages": messages})).await?;
    let want = chat(&server, "qv_r8", messages, 1).await?;
    assert_eq!(m["count"], want["usage"]["prompt_tokens"]);
    let (status, v) = post_b(&server, "/tokenize", &json!({"model": "nobody", "prompt": "x"})).await?;
    assert_eq!((status, v["error"]["param"].as_str()), (404, Some("model")));
    let (status, _) = post_b(&server, "/detokenize", &json!({"tokens": [1u64 << 31]})).await?;
    assert_eq!(status, 400);

    let scrape = server.scrape().await?;
    let count = |e: &str| value(&scrape, "multilora_http_requests", &[("endpoint", e)]);
    assert_eq!((count("/tokenize"), count("/detokenize"), count("/v1/chat/completions")), (3.0, 2.0, 1.0));
    server.stop().await
}
