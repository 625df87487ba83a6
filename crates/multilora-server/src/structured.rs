//! Structured outputs as the OpenAI endpoints spell them: OpenAI's `response_format`
//! (`json_object`, `json_schema`; the Responses API's `text.format`), vLLM's `structured_outputs`
//! object and its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` fields, each read into the engine's
//! [`Constraint`] with the name of the field it came from (the 400 of a constraint the engine
//! refuses names that field). At most one of them may constrain a request.

use multilora::Constraint;
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// A request's constraint and the field that set it.
pub(crate) type Constrained = (Constraint, &'static str);

/// The fields a request may constrain its output with, as the body spells them.
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub(crate) struct ConstraintFields {
    pub(crate) response_format: Option<Value>,
    pub(crate) structured_outputs: Option<Value>,
    pub(crate) guided_json: Option<Value>,
    pub(crate) guided_regex: Option<Value>,
    pub(crate) guided_choice: Option<Value>,
    pub(crate) guided_grammar: Option<Value>,
}

impl ConstraintFields {
    /// The one constraint these fields set, if any; two set at once is a 400.
    pub(crate) fn constraint(&self) -> Result<Option<Constrained>> {
        let mut found: Vec<Constrained> = Vec::new();
        if let Some(v) = non_null(&self.response_format) {
            found.extend(response_format(v)?);
        }
        if let Some(v) = non_null(&self.structured_outputs) {
            found.extend(structured_outputs(v)?);
        }
        if let Some(v) = non_null(&self.guided_json) {
            found.push((Constraint::JsonSchema(schema_value(v, "guided_json")?), "guided_json"));
        }
        if let Some(v) = non_null(&self.guided_regex) {
            found.push((Constraint::Regex(string(v, "guided_regex")?), "guided_regex"));
        }
        if let Some(v) = non_null(&self.guided_choice) {
            found.push((Constraint::Choice(choices(v, "guided_choice")?), "guided_choice"));
        }
        if let Some(v) = non_null(&self.guided_grammar) {
            found.push((Constraint::Grammar(string(v, "guided_grammar")?), "guided_grammar"));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(_, f)| *f).collect();
            return Err(Error::bad(found[1].1, format!("{} each constrain the output: give one", names.join(" and "))));
        }
        Ok(found.pop())
    }
}

fn non_null(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

fn string(v: &Value, param: &'static str) -> Result<String> {
    v.as_str().map(str::to_string).ok_or_else(|| Error::bad(param, format!("{param} must be a string")))
}

fn choices(v: &Value, param: &'static str) -> Result<Vec<String>> {
    let bad = || Error::bad(param, format!("{param} must be a list of strings"));
    v.as_array().ok_or_else(bad)?.iter().map(|c| c.as_str().map(str::to_string).ok_or_else(bad)).collect()
}

/// A JSON schema given as an object, or as a string holding one (vLLM takes both).
fn schema_value(v: &Value, param: &'static str) -> Result<Value> {
    match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| Error::bad(param, format!("{param}: not JSON: {e}"))),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(Error::bad(param, format!("{param} must be a JSON schema object"))),
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `{name, schema, strict}` (the schema is followed exactly whatever `strict` says).
fn response_format(v: &Value) -> Result<Option<Constrained>> {
    const P: &str = "response_format";
    let kind = v.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((Constraint::JsonObject, P))),
        Some("json_schema") => {
            let spec = v
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::bad(P, "response_format.json_schema must be an object with a schema"))?;
            let schema =
                spec.get("schema").ok_or_else(|| Error::bad(P, "response_format.json_schema.schema is required"))?;
            Ok(Some((Constraint::JsonSchema(schema_value(schema, P)?), P)))
        }
        other => {
            Err(Error::bad(P, format!("response_format.type must be text, json_object or json_schema, got {other:?}")))
        }
    }
}

/// The Responses API's `text.format`: `text` (no constraint), `json_object`, or `json_schema`
/// with `name`, `schema` and `strict` beside the type (the schema is followed exactly).
pub(crate) fn text_format(v: &Value) -> Result<Option<Constraint>> {
    const P: &str = "text.format";
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let schema = v.get("schema").ok_or_else(|| Error::bad(P, "text.format.schema is required"))?;
            Ok(Some(Constraint::JsonSchema(schema_value(schema, P)?)))
        }
        other => {
            Err(Error::bad(P, format!("text.format.type must be text, json_object or json_schema, got {other:?}")))
        }
    }
}

/// vLLM's `structured_outputs`: one of `json`, `json_object`, `regex`, `choice`, `grammar`; its
/// options that change nothing here (`disable_fallback`, `whitespace_pattern`, …) are
/// accepted, any other key refused by name.
fn structured_outputs(v: &Value) -> Result<Vec<Constrained>> {
    const P: &str = "structured_outputs";
    const OPTIONS: [&str; 5] = [
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
        "backend",
    ];
    let o: &Map<String, Value> = v.as_object().ok_or_else(|| Error::bad(P, "structured_outputs must be an object"))?;
    let mut found = Vec::new();
    for (key, value) in o {
        if value.is_null() || OPTIONS.contains(&key.as_str()) {
            continue;
        }
        let c = match key.as_str() {
            "json" => Constraint::JsonSchema(schema_value(value, P)?),
            "json_object" if value == &Value::Bool(true) => Constraint::JsonObject,
            "json_object" => continue,
            "regex" => Constraint::Regex(string(value, P)?),
            "choice" => Constraint::Choice(choices(value, P)?),
            "grammar" => Constraint::Grammar(string(value, P)?),
            other => return Err(Error::bad(P, format!("structured_outputs.{other} is not supported by this server"))),
        };
        found.push((c, P));
    }
    if found.len() > 1 {
        return Err(Error::bad(
            P,
            "structured_outputs sets more than one of json, json_object, regex, choice, grammar",
        ));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields(v: Value) -> ConstraintFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn each_spelling_reads_into_its_constraint() {
        let schema = json!({"type": "object"});
        let cases = [
            (json!({"response_format": {"type": "json_object"}}), Some((Constraint::JsonObject, "response_format"))),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some((Constraint::JsonSchema(schema.clone()), "response_format")),
            ),
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"guided_json": "{\"type\": \"object\"}"}),
                Some((Constraint::JsonSchema(schema.clone()), "guided_json")),
            ),
            (json!({"guided_regex": "a+"}), Some((Constraint::Regex("a+".into()), "guided_regex"))),
            (
                json!({"guided_choice": ["a", "b"]}),
                Some((Constraint::Choice(vec!["a".into(), "b".into()]), "guided_choice")),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                Some((Constraint::Grammar("start: \"a\"".into()), "guided_grammar")),
            ),
            (
                json!({"structured_outputs": {"json": schema, "disable_fallback": true}}),
                Some((Constraint::JsonSchema(schema.clone()), "structured_outputs")),
            ),
            (
                json!({"structured_outputs": {"choice": ["x"]}}),
                Some((Constraint::Choice(vec!["x".into()]), "structured_outputs")),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Some((Constraint::JsonObject, "structured_outputs")),
            ),
            (json!({"guided_json": null}), None),
        ];
        for (body, want) in cases {
            assert_eq!(fields(body.clone()).constraint().unwrap(), want, "{body}");
        }
    }

    #[test]
    fn bad_spellings_name_their_field() {
        for (body, param) in [
            (json!({"response_format": {"type": "json_schema"}}), "response_format"),
            (json!({"response_format": {"type": "yaml"}}), "response_format"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": "a"}), "guided_choice"),
            (json!({"guided_regex": 5}), "guided_regex"),
            (json!({"structured_outputs": {"structural_tag": "x"}}), "structured_outputs"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
            (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), "guided_regex"),
        ] {
            let err = fields(body.clone()).constraint().unwrap_err();
            assert!(matches!(&err, Error::BadRequest { param: Some(p), .. } if p == param), "{body}: {err:?}");
        }
    }
}
