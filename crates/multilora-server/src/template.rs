//! Chat templates: the model's (as the engine found it: `chat_template.jinja`,
//! `tokenizer_config.json` or a GGUF file's metadata), a file given with `--chat-template`, or a
//! request's own (when trusted), rendered with `minijinja` the way transformers renders it (`trim_blocks`,
//! `lstrip_blocks`, Python string methods, `raise_exception`, `bos_token` / `eos_token`).

use std::path::Path;
use std::sync::Arc;

use minijinja::{Environment, ErrorKind, context};
use multilora::ChatTemplateSource;
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

    /// A template file (`--chat-template`), with the model's special tokens (those of the
    /// engine's own template source, if it has one).
    pub fn from_file(path: &Path, model: Option<&ChatTemplateSource>) -> Result<ChatTemplate> {
        let source = read_capped(path)?;
        let (bos, eos) = model.map_or(("", ""), |m| (m.bos_token.as_str(), m.eos_token.as_str()));
        ChatTemplate::new(&source, bos, eos)
    }

    /// The engine's template (see [`multilora::EngineConfig::chat_template`]).
    pub fn from_source(model: &ChatTemplateSource) -> Result<ChatTemplate> {
        ChatTemplate::new(&model.source, &model.bos_token, &model.eos_token)
            .map_err(|e| Error::ModelTemplate { origin: model.origin.clone(), source: Box::new(e) })
    }

    /// A template a request brought (vLLM's `chat_template` field, honoured only when the server
    /// trusts request templates), with the model's special tokens; it renders under a bound on
    /// the work it may do, so a template cannot loop a handler forever.
    pub fn from_request(source: &str, model: Option<&ChatTemplateSource>) -> Result<ChatTemplate> {
        if source.len() > MAX_REQUEST_TEMPLATE_BYTES {
            return Err(Error::bad(
                "chat_template",
                format!(
                    "{} bytes, more than the {MAX_REQUEST_TEMPLATE_BYTES} a request's template may have",
                    source.len()
                ),
            ));
        }
        let (bos, eos) = model.map_or(("", ""), |m| (m.bos_token.as_str(), m.eos_token.as_str()));
        let mut t = ChatTemplate::new(source, bos, eos)?;
        if let Some(env) = Arc::get_mut(&mut t.env) {
            env.set_fuel(Some(REQUEST_TEMPLATE_FUEL));
        }
        Ok(t)
    }

    /// Renders `messages` (`{"role", "content"}` objects); `extra` is `chat_template_kwargs`.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        self.render_with_tools(messages, add_generation_prompt, None, extra)
    }

    /// [`ChatTemplate::render`] with the request's `tools` (OpenAI's objects, as given) in the
    /// template's context, as transformers passes them.
    pub fn render_with_tools(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&[Value]>,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(Error::Template)?;
        // The fixed names win over `chat_template_kwargs` of the same name.
        let ctx = context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..minijinja::Value::from_serialize(extra)
        };
        tmpl.render(ctx).map_err(Error::Template)
    }
}

/// The largest chat template a request may bring.
pub const MAX_REQUEST_TEMPLATE_BYTES: usize = 64 << 10;

/// The work (minijinja's fuel: roughly one unit per instruction) a request's template may do.
const REQUEST_TEMPLATE_FUEL: u64 = 1_000_000;

/// The largest `--chat-template` file read.
const MAX_TEMPLATE_FILE_BYTES: u64 = 16 << 20;

fn read_capped(path: &Path) -> Result<String> {
    use std::io::Read;
    let file = |source: Box<dyn std::error::Error + Send + Sync>| Error::File {
        what: "reading chat template",
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(|e| file(Box::new(e)))?;
    if !meta.is_file() || meta.len() > MAX_TEMPLATE_FILE_BYTES {
        return Err(file(format!("not a regular file of at most {MAX_TEMPLATE_FILE_BYTES} bytes").into()));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TEMPLATE_FILE_BYTES).read_to_string(&mut text))
        .map_err(|e| file(Box::new(e)))?;
    Ok(text)
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
