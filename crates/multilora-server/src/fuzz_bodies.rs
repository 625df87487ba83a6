//! Fuzz target (bolero) for the request bodies of every endpoint: valid bodies mutated with the
//! fuzzer's input, parsed and translated as the handlers do (prompts, `n`, sampling parameters,
//! structured outputs' fields, tools and tool choices, chat messages, logprobs, Messages' system and content blocks, Responses' input items,
//! `/tokenize` and `/detokenize`, the adapter endpoints' bodies). Each must give a 400 with a message
//! or a value, never a panic. Under `cargo test` bolero's random engine runs it for 1 s;
//! `BOLERO_RANDOM_TEST_TIME_MS=30000 cargo test -p multilora-server --lib fuzz -- --nocapture`
//! runs it for 30 s (CI) and prints how many inputs it ran.

#[path = "../../../tests/support/mutate.rs"]
mod mutate;

use std::sync::atomic::{AtomicUsize, Ordering};

use multilora::SamplingParams;

use crate::error::Error;
use crate::messages::MessagesRequest;
use crate::protocol::{ChatRequest, CompletionRequest, LoadLoraRequest, UnloadLoraRequest, fan_out, parse_body};
use crate::responses::ResponsesRequest;
use crate::tokenize::{DetokenizeRequest, TokenizeRequest};

const SEEDS: &[&str] = &[
    r#"{"model": "sql", "prompt": ["SELECT", "the"], "n": 2, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
        "top_k": 40, "min_p": 0.05, "stop": ["\n", "END"], "stop_token_ids": [2], "seed": 7, "logprobs": 3,
        "logit_bias": {"5": -100}, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
        "stream": true, "stream_options": {"include_usage": true}, "min_tokens": 1, "ignore_eos": false}"#,
    r#"{"model": "base", "prompt": [[1, 2, 3], [4, 5]], "best_of": 1, "echo": false, "suffix": ""}"#,
    r#"{"model": "chat", "messages": [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "logprobs": true, "top_logprobs": 2,
        "max_completion_tokens": 8, "chat_template_kwargs": {"x": 1}, "response_format": {"type": "text"}}"#,
    r#"{"lora_name": "r4", "lora_path": "/adapters/r4", "load_inplace": true}"#,
    r#"{"model": "sql", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}], "stop_sequences": ["
"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "ok"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stream": true, "metadata": {"user_id": "u"}}"#,
    r#"{"model": "sql", "instructions": "be brief", "max_output_tokens": 8, "previous_response_id": "resp-1",
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "hi"}]},
                  {"role": "assistant", "content": "ok"}], "store": true, "text": {"format": {"type": "text"}}}"#,
    r#"{"model": "sql", "prompt": "hi", "add_special_tokens": true, "tokens": [1, 2, 3],
        "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}"#,
    r#"{"model": "chat", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "2"}], "tools": [{"type": "function", "function":
        {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": false}"#,
    r#"{"model": "sql", "prompt": "x", "echo": true, "logprobs": 2, "prompt_logprobs": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
        "guided_regex": "[a-z]+", "guided_choice": ["a", "b"], "structured_outputs": {"json_object": true}}"#,
];

/// Everything a handler does with a body before it reaches the engine.
fn translate(body: &[u8]) -> Result<(), Error> {
    if let Ok(req) = CompletionRequest::parse(body) {
        let prompts = req.prompts()?;
        let n = req.sampling.n()?;
        let params =
            req.sampling.params(SamplingParams::default(), req.sampling.max_tokens.or(Some(16)), req.logprobs)?;
        req.constraints.constraint()?;
        // The fan-out is bounded by admission before it is built; here, by the cap.
        if prompts.len().saturating_mul(n) <= 256 {
            let _ = fan_out(&req.model, prompts, &params, n);
        }
    }
    if let Ok(req) = ChatRequest::parse(body) {
        for (i, m) in req.messages.iter().enumerate() {
            m.text(i)?;
        }
        req.sampling.n()?;
        let logprobs = req.logprobs()?;
        req.sampling.params(SamplingParams::default(), req.max_completion_tokens, logprobs)?;
        req.constraints.constraint()?;
        req.tools.read(Some(crate::ToolCallParser::Hermes))?;
    }
    if let Ok(req) = MessagesRequest::parse(body) {
        let turns = req.turns()?;
        assert!(!turns.is_empty());
    }
    if let Ok(req) = ResponsesRequest::parse(body) {
        req.input_turns()?;
    }
    let _ = parse_body::<TokenizeRequest>(body);
    let _ = parse_body::<DetokenizeRequest>(body);
    let _ = parse_body::<LoadLoraRequest>(body);
    let _ = parse_body::<UnloadLoraRequest>(body);
    Ok(())
}

#[test]
fn fuzz_request_bodies() {
    let runs = AtomicUsize::new(0);
    bolero::check!().with_max_len(256).for_each(|input: &[u8]| {
        runs.fetch_add(1, Ordering::Relaxed);
        let Some((&pick, ops)) = input.split_first() else { return };
        let body = mutate::mutate(SEEDS[usize::from(pick) % SEEDS.len()].as_bytes(), ops);
        if let Err(e) = translate(&body) {
            assert!(e.status().is_client_error(), "a body is refused as the client's fault: {e}");
            assert!(!e.to_string().is_empty());
        }
    });
    println!("fuzz request bodies: {} inputs, no panic", runs.load(Ordering::Relaxed));
}
