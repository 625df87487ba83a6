//! `ServerConfig`: what the HTTP layer adds to the engine's own configuration.

use crate::drain::Drain;
use crate::template::ChatTemplate;
use crate::tool_parsers::ToolCallParser;

use std::time::Duration;

/// Default bound on requests waiting beyond the engine's `max_num_seqs` (then 429).
pub const DEFAULT_MAX_WAITING_REQUESTS: usize = 1024;

/// Default most engine requests (prompts × `n`) one HTTP request may ask for (then 400).
pub const DEFAULT_MAX_CHOICES_PER_REQUEST: usize = 256;

/// Default most HTTP requests handled at once across every route (then 503).
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 4096;

/// Default time after which `/health` answers 503 when the engine loop has not shown it is
/// alive (a step that has not returned).
pub const DEFAULT_HEALTH_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The server's settings; the engine's knobs live in [`multilora::EngineConfig`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Bearer token every `/v1/*` request must carry (vLLM's `--api-key`); `/health` stays
    /// open, and `/metrics` too unless `metrics_need_key`. Compared in constant time.
    pub api_key: Option<String>,
    /// `/metrics` needs the API key too (off by default, as in vLLM).
    pub metrics_need_key: bool,
    /// Most engine requests (prompts × `n`) one HTTP request may ask for; more is a 400,
    /// counted before anything is built.
    pub max_choices_per_request: usize,
    /// Most HTTP requests handled at once across every route; more get 503 at once.
    pub max_concurrent_requests: usize,
    /// `/health` answers 503 once the engine loop has shown no sign of life for this long.
    pub health_stall_timeout: Duration,
    /// A chat template overriding the model's (`--chat-template`).
    pub chat_template: Option<ChatTemplate>,
    /// Requests in flight beyond the engine's `max_num_seqs` before new ones get 429.
    pub max_waiting_requests: usize,
    /// `owned_by` of `/v1/models` entries.
    pub owned_by: String,
    /// Honour a chat request's own `chat_template` (vLLM's `--trust-request-chat-template`; off
    /// by default: a template is code the server runs). Off, such a request is a 400.
    pub trust_request_chat_template: bool,
    /// The drain the routes follow: started, `/health` and new generation requests answer 503
    /// while admitted requests finish. A new one by default; give your own to start it.
    pub drain: Drain,
    /// Responses of `/v1/responses` kept in memory for `previous_response_id` and `GET`, the
    /// oldest dropped first (`--responses-store`; 0, the default: stateless).
    pub responses_store: usize,
    /// `tool_choice: "auto"` (the default with `tools`) is served: the model's own tool-call
    /// syntax is parsed by `tool_call_parser` (vLLM's `--enable-auto-tool-choice`). Off, such a
    /// request is a 400.
    pub enable_auto_tool_choice: bool,
    /// The model's tool-call syntax (vLLM's `--tool-call-parser`).
    pub tool_call_parser: Option<ToolCallParser>,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            api_key: None,
            metrics_need_key: false,
            max_choices_per_request: DEFAULT_MAX_CHOICES_PER_REQUEST,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            health_stall_timeout: DEFAULT_HEALTH_STALL_TIMEOUT,
            chat_template: None,
            max_waiting_requests: DEFAULT_MAX_WAITING_REQUESTS,
            owned_by: "multilora".to_string(),
            trust_request_chat_template: false,
            drain: Drain::new(),
            responses_store: 0,
            enable_auto_tool_choice: false,
            tool_call_parser: None,
        }
    }
}

impl ServerConfig {
    /// Serves `tool_choice: "auto"`, parsing the model's calls with `parser`.
    pub fn auto_tool_choice(mut self, parser: ToolCallParser) -> ServerConfig {
        self.enable_auto_tool_choice = true;
        self.tool_call_parser = Some(parser);
        self
    }

    /// Keeps the last `n` responses of `/v1/responses` (0: none).
    pub fn responses_store(mut self, n: usize) -> ServerConfig {
        self.responses_store = n;
        self
    }

    /// Requires `Authorization: Bearer <key>` on `/v1/*` (or Anthropic's `x-api-key: <key>`).
    pub fn api_key(mut self, key: impl Into<String>) -> ServerConfig {
        self.api_key = Some(key.into());
        self
    }

    /// Overrides the model's chat template.
    pub fn chat_template(mut self, template: ChatTemplate) -> ServerConfig {
        self.chat_template = Some(template);
        self
    }

    /// Honours a chat request's own `chat_template` (bounded in size and in the work it may do).
    pub fn trust_request_chat_template(mut self, on: bool) -> ServerConfig {
        self.trust_request_chat_template = on;
        self
    }

    /// `/metrics` needs the API key too.
    pub fn metrics_need_key(mut self, on: bool) -> ServerConfig {
        self.metrics_need_key = on;
        self
    }

    /// Most engine requests (prompts × `n`) per HTTP request (default 256).
    pub fn max_choices_per_request(mut self, n: usize) -> ServerConfig {
        self.max_choices_per_request = n;
        self
    }

    /// Most HTTP requests handled at once (default 4096).
    pub fn max_concurrent_requests(mut self, n: usize) -> ServerConfig {
        self.max_concurrent_requests = n;
        self
    }

    /// When `/health` turns 503 for an engine loop that shows no sign of life (default 30 s).
    pub fn health_stall_timeout(mut self, timeout: Duration) -> ServerConfig {
        self.health_stall_timeout = timeout;
        self
    }

    /// The drain the routes follow (see [`Drain`]).
    pub fn drain(mut self, drain: Drain) -> ServerConfig {
        self.drain = drain;
        self
    }

    /// Bound on requests waiting beyond `max_num_seqs` (default 1024).
    pub fn max_waiting_requests(mut self, n: usize) -> ServerConfig {
        self.max_waiting_requests = n;
        self
    }
}
