//! Structured outputs and tools over HTTP on the tiny fixture model (random weights: whatever
//! parses was made to): `response_format`, `guided_*` and `structured_outputs` hold on both
//! endpoints; `tool_choice` `required` and a named function always give calls whose arguments
//! fit; with `auto`, a reply written in the Hermes syntax that Qwen3's chat template renders for
//! a call (`tests/fixtures/templates`) is parsed into that call, and streamed as the same call; bad constraints are 400s
//! naming their field, and the server goes on; `echo` and `prompt_logprobs` on completions.

mod common;

use anyhow::Result;
use common::{Server, builder, samples, sse_events, value};
use multilora_server::{ChatTemplate, ServerConfig, ToolCallParser};
use openmetrics_parser::OpenMetricsValue;
use serde_json::{Value, json};

const QWEN3: &str = include_str!("../../../tests/fixtures/templates/qwen3.jinja");

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": false}}})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"], "additionalProperties": false}}})
}

/// Whether `args` (a JSON string) fit the tool `name`'s parameters above.
fn fits(name: &str, args: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(args) else { return false };
    let o = v.as_object().unwrap();
    match name {
        "get_weather" => {
            o.len() == 2
                && o["city"].as_str().is_some_and(|c| c.chars().count() <= 10)
                && ["c", "f"].contains(&o["unit"].as_str().unwrap_or(""))
        }
        "get_time" => o.len() == 1 && o["zone"].as_i64().is_some_and(|z| (-12..=14).contains(&z)),
        _ => false,
    }
}

/// A short ChatML template that lists the tools by name (the fixture model's context is 512
/// tokens of a 512-token vocabulary: Qwen3's own tool preamble would not fit).
const SHORT: &str = "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}\
{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

async fn qwen_server(auto: bool) -> Result<Server> {
    let template = ChatTemplate::new(SHORT, "", "<|im_end|>")?;
    let mut config = ServerConfig::default().chat_template(template);
    if auto {
        config = config.auto_tool_choice(ToolCallParser::Hermes);
    }
    Server::start(builder(), config).await
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// What a reply's text must satisfy.
type Check = Box<dyn Fn(&str) -> bool>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_spelling_of_a_constraint_holds_on_both_endpoints() -> Result<()> {
    let server = qwen_server(false).await?;
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
        "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": false});
    let checks: Vec<(Value, Check)> = vec![
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            Box::new(|t: &str| {
                serde_json::from_str::<Value>(t)
                    .is_ok_and(|v| v["n"].as_i64().is_some_and(|n| (1..=9).contains(&n)) && v["ok"].is_boolean())
            }),
        ),
        (json!({"guided_choice": ["red", "green", "blue"]}), Box::new(|t: &str| ["red", "green", "blue"].contains(&t))),
        (json!({"guided_regex": "[0-9]{3}-[a-z]{2}"}), Box::new(|t: &str| t.len() == 6 && t.as_bytes()[3] == b'-')),
        (json!({"structured_outputs": {"choice": ["yes", "no"]}}), Box::new(|t: &str| t == "yes" || t == "no")),
        (
            json!({"guided_grammar": "start: \"(\" num (\"+\" num)* \")\"\nnum: /[1-9]/"}),
            Box::new(|t: &str| t.starts_with('(') && t.ends_with(')')),
        ),
    ];
    for (i, (field, ok)) in checks.iter().enumerate() {
        for (route, model) in [("/v1/chat/completions", "qv_r8"), ("/v1/completions", "all_r16")] {
            let mut body = json!({"model": model, "max_tokens": 60, "temperature": 1.0, "seed": i});
            if route.contains("chat") {
                body["messages"] = user("answer");
            } else {
                body["prompt"] = json!("answer:");
            }
            for (k, v) in field.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (status, resp) = server.post(route, &body).await?;
            assert_eq!(status, 200, "{route} {field}: {resp}");
            let choice = &resp["choices"][0];
            let text = choice["message"]["content"].as_str().or(choice["text"].as_str()).unwrap();
            assert!(ok(text), "{route} {field}: {text:?}");
            // `length`: random weights wrote blanks until the budget closed the JSON.
            let end = choice["finish_reason"].as_str().unwrap();
            assert!(end == "stop" || i == 0 && end == "length", "{route} {field}: {end} {text:?}");
        }
    }
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_tool_choices_always_call() -> Result<()> {
    let server = qwen_server(false).await?;
    let tools = json!([weather_tool(), time_tool()]);
    for seed in 0..6u64 {
        let model = ["base", "qv_r8", "all_r16"][seed as usize % 3];
        let body = json!({"model": model, "messages": user("weather?"),
            "tools": tools, "tool_choice": "required", "temperature": 1.0, "seed": seed, "max_tokens": 200});
        let (status, resp) = server.post("/v1/chat/completions", &body).await?;
        assert_eq!(status, 200, "{resp}");
        let choice = &resp["choices"][0];
        // `length`: the budget closed the list of calls (random weights write blanks).
        let end = choice["finish_reason"].as_str().unwrap();
        assert!(end == "tool_calls" || end == "length", "{resp}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty());
        for c in calls {
            assert_eq!(c["type"], "function");
            assert!(c["id"].as_str().is_some_and(|id| id.starts_with("call_")));
            let (name, args) = (c["function"]["name"].as_str().unwrap(), c["function"]["arguments"].as_str().unwrap());
            assert!(fits(name, args), "{name}: {args}");
        }
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let body = json!({"model": "all_r16", "messages": user("time?"), "tools": tools, "tool_choice": named,
            "temperature": 1.0, "seed": seed, "max_tokens": 50});
        let (status, resp) = server.post("/v1/chat/completions", &body).await?;
        assert_eq!(status, 200, "{resp}");
        let call = &resp["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "get_time");
        assert!(fits("get_time", call["function"]["arguments"].as_str().unwrap()), "{call}");
        assert!(resp["choices"][0]["message"]["content"].is_null());
        // Streamed: the same arguments, delta by delta.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let resp_s = server.client.post(format!("{}/v1/chat/completions", server.url)).json(&streamed).send().await?;
        let (name, args) = streamed_calls(sse_events(resp_s).await?)?.remove(0);
        assert_eq!((name.as_str(), args.as_str()), ("get_time", call["function"]["arguments"].as_str().unwrap()));
    }
    // The grammars' work is in the metrics: masks computed, tokens forced.
    let scrape = server.scrape().await?;
    let masks = samples(&scrape, "multilora_grammar_mask_seconds");
    assert!(matches!(&masks[0].1, OpenMetricsValue::Histogram(h) if h.count.is_some_and(|c| c > 0)), "{masks:?}");
    assert!(value(&scrape, "multilora_grammar_forced_tokens", &[]) > 0.0);
    server.stop().await
}

/// The calls of a streamed reply, its deltas joined per index: (name, arguments).
fn streamed_calls(events: Vec<String>) -> Result<Vec<(String, String)>> {
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e)?;
        for d in v["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = d["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                calls.resize(i + 1, Default::default());
            }
            if let Some(n) = d["function"]["name"].as_str() {
                calls[i].0.push_str(n);
            }
            if let Some(a) = d["function"]["arguments"].as_str() {
                calls[i].1.push_str(a);
            }
        }
    }
    Ok(calls)
}

/// `s` as a regex matching only itself.
fn literal(s: &str) -> String {
    s.chars().fold(String::new(), |mut out, c| {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
        out
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_parses_the_call_the_template_renders_and_streams_it_alike() -> Result<()> {
    let server = qwen_server(true).await?;
    // What Qwen3's template writes for an assistant's call: the model's own syntax.
    let template = ChatTemplate::new(QWEN3, "", "<|im_end|>")?;
    let call = json!({"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}});
    let rendered = template.render(
        &[json!({"role": "user", "content": "q"}), json!({"role": "assistant", "content": "", "tool_calls": [call]})],
        false,
        &Default::default(),
    )?;
    let start = rendered.find("<tool_call>").unwrap();
    let reply = &rendered[start..rendered.rfind("<|im_end|>").unwrap()];
    assert!(reply.starts_with("<tool_call>\n{\"name\": \"get_weather\""), "{reply:?}");
    // The tools reach the prompt through the template.
    let body = json!({"model": "qv_r8", "messages": user("weather in Oslo?"), "tools": [weather_tool()],
        "guided_regex": literal(reply), "temperature": 0, "max_tokens": 80});
    let (status, resp) = server.post("/v1/chat/completions", &body).await?;
    assert_eq!(status, 200, "{resp}");
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{resp}");
    let got = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(got["name"], "get_weather");
    let args: Value = serde_json::from_str(got["arguments"].as_str().unwrap())?;
    assert_eq!(args, json!({"city": "Oslo", "unit": "c"}));
    let with_tools = resp["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut no_tools = body.clone();
    no_tools.as_object_mut().unwrap().remove("tools");
    let (_, resp_n) = server.post("/v1/chat/completions", &no_tools).await?;
    assert!(with_tools > resp_n["usage"]["prompt_tokens"].as_u64().unwrap(), "the tools are in the prompt");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp_s = server.client.post(format!("{}/v1/chat/completions", server.url)).json(&streamed).send().await?;
    let events = sse_events(resp_s).await?;
    let calls = streamed_calls(events.clone())?;
    assert_eq!(calls, vec![("get_weather".to_string(), got["arguments"].as_str().unwrap().to_string())]);
    let last: Value = serde_json::from_str(&events[events.len() - 2])?;
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    // Without --enable-auto-tool-choice, auto is refused as vLLM refuses it.
    let plain = qwen_server(false).await?;
    let (status, resp) = plain
        .post(
            "/v1/chat/completions",
            &json!({"model": "base", "messages": user("x"),
        "tools": [weather_tool()]}),
        )
        .await?;
    assert_eq!((status, resp["error"]["param"].as_str()), (400, Some("tool_choice")), "{resp}");
    plain.stop().await?;
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_constraints_are_400s_naming_the_field_and_the_server_goes_on() -> Result<()> {
    let server = qwen_server(false).await?;
    let huge = json!({"type": "object", "description": "x".repeat(1 << 20)});
    for (field, value) in [
        ("response_format", json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strung"}}})),
        ("guided_json", json!({"type": "string", "format": "no-such-format"})),
        ("guided_json", huge),
        ("guided_grammar", json!("start: missing_rule")),
        ("guided_regex", json!("(unclosed")),
        ("guided_regex", json!("a".repeat(300 << 10))),
        ("structured_outputs", json!({"regex": "a", "choice": ["a"]})),
        ("tool_choice", json!({"type": "function", "function": {"name": "nope"}})),
    ] {
        let mut body = json!({"model": "base", "messages": user("x"), "max_tokens": 4});
        if field == "tool_choice" {
            body["tools"] = json!([weather_tool()]);
        }
        body[field] = value;
        let (status, resp) = server.post("/v1/chat/completions", &body).await?;
        assert_eq!(status, 400, "{field}: {resp}");
        assert_eq!(resp["error"]["param"].as_str(), Some(field), "{resp}");
    }
    let (status, _) = server
        .post(
            "/v1/chat/completions",
            &json!({"model": "base", "messages": user("x"),
        "max_tokens": 3, "guided_choice": ["a", "b"]}),
        )
        .await?;
    assert_eq!(status, 200);
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo_the_prompt_and_give_prompt_logprobs() -> Result<()> {
    let server = qwen_server(false).await?;
    let prompt = "one two three";
    let body = json!({"model": "qv_r8", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true,
        "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": true});
    let (status, resp) = server.post("/v1/completions", &body).await?;
    assert_eq!(status, 200, "{resp}");
    let choice = &resp["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(text.starts_with(prompt) && text.len() > prompt.len(), "{text:?}");
    let ids = server.engine().handle().tokenize(prompt, true)?;
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len() + 4);
    assert!(lp["token_logprobs"][0].is_null());
    assert!(lp["token_logprobs"][1].as_f64().is_some_and(|l| l <= 0.0));
    let p = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(p.len(), ids.len());
    assert!(p[0].is_null());
    let entry = p[1][ids[1].to_string()].clone();
    assert_eq!(entry["logprob"], lp["token_logprobs"][1]);
    assert!(entry["rank"].as_u64().is_some_and(|r| r >= 1));
    // Streamed: the prompt first, then the tokens; the same text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp_s = server.client.post(format!("{}/v1/completions", server.url)).json(&streamed).send().await?;
    let events = sse_events(resp_s).await?;
    let joined: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(joined, text);
    server.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_text_format_constrains_the_output() -> Result<()> {
    let server = qwen_server(false).await?;
    let schema = json!({"type": "object", "properties": {"mood": {"enum": ["calm", "busy"]}}, "required": ["mood"],
        "additionalProperties": false});
    let body = json!({"model": "qv_r8", "input": "How are you?", "max_output_tokens": 60, "temperature": 1.0,
        "text": {"format": {"type": "json_schema", "name": "m", "schema": schema, "strict": true}}});
    let (status, resp) = server.post("/v1/responses", &body).await?;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["text"]["format"]["type"], "json_schema");
    let text = resp["output"][0]["content"][0]["text"].as_str().unwrap();
    let v: Value = serde_json::from_str(text)?;
    assert!(v["mood"] == "calm" || v["mood"] == "busy", "{text}");
    let mut bad = body.clone();
    bad["text"]["format"]["schema"] = json!({"type": "strung"});
    let (status, resp) = server.post("/v1/responses", &bad).await?;
    assert_eq!((status, resp["error"]["param"].as_str()), (400, Some("text.format")), "{resp}");
    server.stop().await
}
