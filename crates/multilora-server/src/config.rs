//! `ServerConfig`: what the HTTP layer adds to the engine's own configuration.

use crate::template::ChatTemplate;

/// Default bound on requests waiting beyond the engine's `max_num_seqs` (then 429).
pub const DEFAULT_MAX_WAITING_REQUESTS: usize = 1024;

/// The server's settings; the engine's knobs live in [`multilora::EngineConfig`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ServerConfig {
    /// Bearer token every `/v1/*` request must carry (vLLM's `--api-key`); `/health` and
    /// `/metrics` stay open, as in vLLM.
    pub api_key: Option<String>,
    /// A chat template overriding the model's (`--chat-template`).
    pub chat_template: Option<ChatTemplate>,
    /// Requests in flight beyond the engine's `max_num_seqs` before new ones get 429.
    pub max_waiting_requests: usize,
    /// `owned_by` of `/v1/models` entries.
    pub owned_by: String,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            api_key: None,
            chat_template: None,
            max_waiting_requests: DEFAULT_MAX_WAITING_REQUESTS,
            owned_by: "multilora".to_string(),
        }
    }
}

impl ServerConfig {
    /// Requires `Authorization: Bearer <key>` on `/v1/*`.
    pub fn api_key(mut self, key: impl Into<String>) -> ServerConfig {
        self.api_key = Some(key.into());
        self
    }

    /// Overrides the model's chat template.
    pub fn chat_template(mut self, template: ChatTemplate) -> ServerConfig {
        self.chat_template = Some(template);
        self
    }

    /// Bound on requests waiting beyond `max_num_seqs` (default 1024).
    pub fn max_waiting_requests(mut self, n: usize) -> ServerConfig {
        self.max_waiting_requests = n;
        self
    }
}
