//! Chat templates: the Jinja template of `tokenizer_config.json` (or a file given with
//! `--chat-template`) rendered with `minijinja` the way transformers renders it (`trim_blocks`,
//! `lstrip_blocks`, Python string methods, `raise_exception`, `bos_token` / `eos_token`).

use std::path::Path;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, context};
use serde_json::Value;

use crate::error::{Error, Result};

const NAME: &str = "chat";

/// A compiled chat template with the model's special tokens.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are what the template sees.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source.to_string()).map_err(Error::Template)?;
        Ok(ChatTemplate { env: Arc::new(env), bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// A template file (`--chat-template`), with the special tokens of the model in `model_dir`.
    pub fn from_file(path: &Path, model_dir: &Path) -> Result<ChatTemplate> {
        let source = std::fs::read_to_string(path).map_err(|e| Error::File {
            what: "reading chat template",
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        let cfg = read_tokenizer_config(model_dir)?;
        ChatTemplate::new(&source, &special(&cfg, "bos_token"), &special(&cfg, "eos_token"))
    }

    /// The template of `model_dir/tokenizer_config.json`; `None` when it has none.
    pub fn from_model_dir(model_dir: &Path) -> Result<Option<ChatTemplate>> {
        let cfg = read_tokenizer_config(model_dir)?;
        let source = match cfg.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            // A list of named templates: use the one named "default".
            Some(Value::Array(list)) => {
                let default = list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
                match default.and_then(|t| t.get("template")).and_then(Value::as_str) {
                    Some(s) => s.to_string(),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        ChatTemplate::new(&source, &special(&cfg, "bos_token"), &special(&cfg, "eos_token"))
            .map(Some)
            .map_err(|e| Error::ModelTemplate { model_dir: model_dir.to_path_buf(), source: Box::new(e) })
    }

    /// Renders `messages` (`{"role", "content"}` objects); `extra` is `chat_template_kwargs`.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(Error::Template)?;
        // The fixed names win over `chat_template_kwargs` of the same name.
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..minijinja::Value::from_serialize(extra)
        };
        tmpl.render(ctx).map_err(Error::Template)
    }
}

fn read_tokenizer_config(model_dir: &Path) -> Result<Value> {
    let path = model_dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(Value::Null);
    }
    let file =
        |what, source: Box<dyn std::error::Error + Send + Sync>| Error::File { what, path: path.clone(), source };
    let text = std::fs::read_to_string(&path).map_err(|e| file("reading", Box::new(e)))?;
    serde_json::from_str(&text).map_err(|e| file("parsing", Box::new(e)))
}

/// A special token of `tokenizer_config.json`: a string or `{"content": ...}`.
fn special(cfg: &Value, key: &str) -> String {
    match cfg.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const LLAMA2: &str = "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}\
        {% set messages = messages[1:] %}{% endif %}{% for message in messages %}\
        {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
        {% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}\
        {% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

    #[test]
    fn renders_a_transformers_style_template() {
        let t = ChatTemplate::new(LLAMA2, "<s>", "</s>").unwrap();
        let msgs = vec![
            json!({"role": "user", "content": " hi "}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "user", "content": "again"}),
        ];
        let out = t.render(&msgs, true, &Default::default()).unwrap();
        assert_eq!(out, "<s>[INST] hi [/INST] hello </s><s>[INST] again [/INST]");
    }

    #[test]
    fn raise_exception_is_an_error_with_its_message() {
        let t = ChatTemplate::new(LLAMA2, "<s>", "</s>").unwrap();
        let msgs = vec![json!({"role": "assistant", "content": "x"})];
        let err = t.render(&msgs, true, &Default::default()).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn generation_prompt_and_kwargs_reach_the_template() {
        let src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
                   {% if add_generation_prompt %}<assistant>{% endif %}{% if think %}T{% endif %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let msgs = vec![json!({"role": "user", "content": "q"})];
        let mut kw = serde_json::Map::new();
        kw.insert("think".into(), json!(true));
        assert_eq!(t.render(&msgs, true, &kw).unwrap(), "<user>q<assistant>T");
        assert_eq!(t.render(&msgs, false, &Default::default()).unwrap(), "<user>q");
    }

    #[test]
    fn a_broken_template_is_refused_at_compile_time() {
        assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(Error::Template(_))));
    }
}
