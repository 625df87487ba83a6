//! Structured outputs on the tiny fixture model (random weights: without a constraint its text is
//! noise, so whatever parses was made to): JSON schemas, `json_object`, regexes, choices and
//! Lark grammars hold for greedy and sampled requests of the base model and adapters in one
//! batch; the unconstrained rows beside them give the tokens they give alone; forced tokens are
//! appended together and counted; bad constraints are refused at `submit`.

mod common;

use anyhow::Result;
use common::*;
use multilora::{
    Completion, Constraint, Engine, EngineError, FinishReason, GenerateRequest, MAX_CONSTRAINT_BYTES, SamplingParams,
};
use serde_json::{Value, json};

fn params(engine: &Engine, constraint: Option<Constraint>, temperature: f32, seed: u64) -> multilora::ValidParams {
    let mut p = SamplingParams::greedy(120);
    (p.temperature, p.seed, p.constraint) = (temperature, Some(seed), constraint);
    p.validate(engine.config().vocab_size).unwrap()
}

fn run(engine: &Engine, model: &str, prompt: &str, c: Option<Constraint>, t: f32, seed: u64) -> Result<Completion> {
    let req = GenerateRequest::new(model, prompt).params(params(engine, c, t, seed));
    Ok(engine.submit(req)?.collect_blocking()?)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "kind": {"$ref": "#/$defs/kind"}
        },
        "required": ["name", "age", "tags", "kind"],
        "additionalProperties": false,
        "$defs": {"kind": {"type": "string", "pattern": "^[xy]{2,4}$"}}
    })
}

/// Checks `v` against [`schema`] by hand.
fn valid(v: &Value) -> bool {
    let o = v.as_object().unwrap();
    let name = o["name"].as_str().is_some_and(|s| s.chars().count() <= 12);
    let age = o["age"].as_i64().is_some_and(|a| (0..=150).contains(&a));
    let tags = o["tags"].as_array().is_some_and(|t| {
        (1..=3).contains(&t.len()) && t.iter().all(|x| ["a", "b", "c"].contains(&x.as_str().unwrap_or("")))
    });
    let kind =
        o["kind"].as_str().is_some_and(|k| (2..=4).contains(&k.len()) && k.chars().all(|c| c == 'x' || c == 'y'));
    o.len() == 4 && name && age && tags && kind
}

#[test]
fn constrained_rows_of_several_adapters_hold_in_one_batch() -> Result<()> {
    let engine = builder(4).build()?;
    let models = ["base", "qv_r8", "all_r16", "qv_r8"];
    let mut streams = Vec::new();
    for i in 0..16u64 {
        let model = models[i as usize % models.len()];
        let (c, t) = match i % 4 {
            0 => (Constraint::JsonSchema(schema()), 0.0),
            1 => (Constraint::JsonSchema(schema()), 1.0),
            2 => (Constraint::JsonObject, 0.8),
            _ => (Constraint::Regex(r"[a-z]{3}-[0-9]{2,4}".into()), 1.0),
        };
        let req = GenerateRequest::new(model, format!("request {i}:")).params(params(&engine, Some(c.clone()), t, i));
        streams.push((c, engine.submit(req)?));
    }
    let rx = regex_lite(r"[a-z]{3}-[0-9]{2,4}");
    for (c, s) in streams {
        let out = s.collect_blocking()?;
        // JSON: random weights may write strings and blanks until the budget closes the reply.
        let json = matches!(c, Constraint::JsonObject | Constraint::JsonSchema(_));
        if !(json && out.finish_reason == FinishReason::Length) {
            assert_eq!(out.finish_reason, FinishReason::Stop, "{c:?}: {:?}", out.text);
        }
        match c {
            Constraint::JsonSchema(_) => {
                let v: Value = serde_json::from_str(&out.text)?;
                assert!(valid(&v), "{}", out.text);
            }
            Constraint::JsonObject => assert!(serde_json::from_str::<Value>(&out.text)?.is_object(), "{}", out.text),
            _ => assert!(rx(&out.text), "{:?}", out.text),
        }
    }
    let m = engine.metrics();
    assert!(m.grammar_mask_duration.count > 0);
    Ok(())
}

/// `[a-z]{3}-[0-9]{2,4}` checked by hand (no regex crate in the tests).
fn regex_lite(_: &str) -> impl Fn(&str) -> bool {
    |s: &str| {
        let b = s.as_bytes();
        b.len() >= 6
            && b.len() <= 8
            && b[..3].iter().all(u8::is_ascii_lowercase)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit)
    }
}

#[test]
fn choices_and_grammars_hold_and_forced_tokens_come_in_one_chunk() -> Result<()> {
    let engine = builder(2).build()?;
    let choices = vec!["positive".to_string(), "negative".to_string(), "neutral".to_string()];
    for seed in 0..4 {
        let out = run(&engine, "all_r16", "label:", Some(Constraint::Choice(choices.clone())), 1.0, seed)?;
        assert!(choices.contains(&out.text), "{:?}", out.text);
        assert_eq!(out.finish_reason, FinishReason::Stop);
    }
    let lark = r#"start: "SELECT " col ("," col)* " FROM t;"
col: /[a-c]/"#;
    let out = run(&engine, "qv_r8", "sql:", Some(Constraint::Grammar(lark.into())), 1.0, 7)?;
    assert!(out.text.starts_with("SELECT ") && out.text.ends_with(" FROM t;"), "{:?}", out.text);
    // A long forced run: after the first sampled token, the rest of the text is forced, and
    // comes as tokens the step did not sample (counted as forced).
    let before = engine.metrics().grammar_forced_tokens;
    let fixed = "the quick brown fox jumps over the lazy dog";
    let out = run(&engine, "base", "x", Some(Constraint::Regex(format!("{fixed}[0-9]"))), 0.0, 1)?;
    assert!(out.text.starts_with(fixed) && out.text.len() == fixed.len() + 1, "{:?}", out.text);
    let forced = engine.metrics().grammar_forced_tokens - before;
    assert!(forced >= 5, "{forced} forced tokens of {}", out.token_ids.len());
    assert!(engine.metrics().steps > 0);
    Ok(())
}

/// A reply its budget cuts still parses: near `max_tokens` the grammar is closed (the open string,
/// then the object), and the request finishes with `length`.
#[test]
fn a_reply_cut_by_its_budget_is_closed_and_parses() -> Result<()> {
    let engine = builder(2).build()?;
    let schema = json!({"type": "object", "properties": {"story": {"type": "string"}, "more": {"type": "object",
        "properties": {"note": {"type": "string"}}, "required": ["note"]}}, "required": ["story", "more"]});
    for (seed, max) in [(1, 30), (2, 45), (3, 70)] {
        let mut p = SamplingParams::greedy(max);
        (p.temperature, p.seed, p.constraint) = (1.0, Some(seed), Some(Constraint::JsonSchema(schema.clone())));
        let p = p.validate(engine.config().vocab_size)?;
        let out = engine.submit(GenerateRequest::new("all_r16", "story:").params(p))?.collect_blocking()?;
        let v: Value = serde_json::from_str(&out.text).map_err(|e| anyhow::anyhow!("{e}: {:?}", out.text))?;
        assert!(v["story"].is_string() && v["more"]["note"].is_string(), "{}", out.text);
        assert!(out.token_ids.len() <= max, "{} tokens of {max}", out.token_ids.len());
        if out.finish_reason != FinishReason::Length {
            assert_eq!(out.finish_reason, FinishReason::Stop);
        }
    }
    // A budget shorter than the shortest way cannot be closed: cut as any reply is.
    let mut p = SamplingParams::greedy(4);
    p.constraint = Some(Constraint::Choice(vec!["alpha beta gamma".into()]));
    let out = engine.submit(GenerateRequest::new("base", "x").params(p.validate(engine.config().vocab_size)?))?;
    let out = out.collect_blocking()?;
    assert_eq!((out.finish_reason, out.token_ids.len()), (FinishReason::Length, 4));
    assert!("alpha beta gamma".starts_with(&out.text) && out.text.len() < 16, "{:?}", out.text);
    Ok(())
}

/// A greedy row tries its argmax before any mask; a row with top-k 1 (the same argmax, but a
/// filter, so it always samples under the mask) must give the same tokens.
#[test]
fn trying_a_token_first_changes_no_token() -> Result<()> {
    let engine = builder(2).build()?;
    for (i, c) in
        [Constraint::JsonSchema(schema()), Constraint::Regex("[a-z ]{5,30}\\.".into())].into_iter().enumerate()
    {
        let run = |top_k: i32, temperature: f32| -> Result<Completion> {
            let mut p = SamplingParams::greedy(60);
            (p.top_k, p.temperature, p.constraint) = (top_k, temperature, Some(c.clone()));
            let req =
                GenerateRequest::new("qv_r8", format!("case {i}")).params(p.validate(engine.config().vocab_size)?);
            Ok(engine.submit(req)?.collect_blocking()?)
        };
        let (tried, masked) = (run(0, 0.0)?, run(1, 1.0)?);
        assert_eq!(tried.token_ids, masked.token_ids, "{:?} / {:?}", tried.text, masked.text);
    }
    Ok(())
}

#[test]
fn unconstrained_rows_are_untouched_by_constrained_ones() -> Result<()> {
    let engine = builder(4).build()?;
    let plain = |i: u64| GenerateRequest::new(["base", "qv_r8"][i as usize % 2], format!("plain {i}"));
    let mut alone = Vec::new();
    for i in 0..4 {
        let p = params(&engine, None, 0.9, i);
        alone.push(engine.submit(plain(i).params(p))?.collect_blocking()?.token_ids);
    }
    let mut together = Vec::new();
    let mut constrained = Vec::new();
    for i in 0..4 {
        let c = params(&engine, Some(Constraint::JsonSchema(schema())), 1.0, 100 + i);
        constrained.push(engine.submit(GenerateRequest::new("all_r16", "json:").params(c))?);
        together.push(engine.submit(plain(i).params(params(&engine, None, 0.9, i)))?);
    }
    for (i, s) in together.into_iter().enumerate() {
        assert_eq!(s.collect_blocking()?.token_ids, alone[i], "row {i}");
    }
    for s in constrained {
        assert!(valid(&serde_json::from_str(&s.collect_blocking()?.text)?));
    }
    Ok(())
}

#[test]
fn bad_constraints_are_refused_at_submit() -> Result<()> {
    let engine = builder(2).build()?;
    let vocab = engine.config().vocab_size;
    let submit = |c: Constraint| -> Result<EngineError> {
        let mut p = SamplingParams::greedy(8);
        p.constraint = Some(c);
        let err = match p.validate(vocab) {
            Err(e) => e,
            Ok(p) => match engine.submit(GenerateRequest::new("base", "x").params(p)) {
                Err(e) => e,
                Ok(_) => anyhow::bail!("accepted"),
            },
        };
        Ok(err)
    };
    let huge = json!({"type": "object", "description": "x".repeat(MAX_CONSTRAINT_BYTES + 1)});
    let cases = [
        (Constraint::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "strung"}}})), "json"),
        (Constraint::JsonSchema(json!({"type": "string", "format": "no-such-format"})), "json"),
        (Constraint::JsonSchema(json!([1, 2])), "json"),
        (Constraint::JsonSchema(huge), "json"),
        (Constraint::Regex("(unclosed".into()), "regex"),
        (Constraint::Regex("a".repeat(MAX_CONSTRAINT_BYTES + 1)), "regex"),
        (Constraint::Grammar("start: undefined_rule".into()), "grammar"),
        (Constraint::Grammar("root ::= \"a\"".into()), "grammar"),
        (Constraint::Choice(Vec::new()), "choice"),
    ];
    for (c, kind) in cases {
        let shown = format!("{c:?}").chars().take(80).collect::<String>();
        match submit(c)? {
            EngineError::Constraint { kind: k, reason } => {
                assert_eq!(k, kind, "{shown}: {reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{shown}: {other:?}"),
        }
    }
    // The engine goes on.
    let out = run(&engine, "base", "x", Some(Constraint::Choice(vec!["yes".into(), "no".into()])), 0.0, 0)?;
    assert!(out.text == "yes" || out.text == "no");
    Ok(())
}
