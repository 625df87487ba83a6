//! What every layer says about a request: which logits a step must produce for it
//! (`LogitsWanted`), and why it ended (`FinishReason`).

/// Which logits the model must produce for a scheduled sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LogitsWanted {
    /// None: a prefill chunk that does not reach the end of the sequence.
    None,
    /// At the last new token only: the final prefill chunk, or a decode. One token is sampled.
    #[default]
    Last,
    /// At every new token of this chunk (prompt logprobs were asked for); when the chunk reaches
    /// the end of the sequence the last position's logits are also sampled from.
    AllPrompt,
}

impl LogitsWanted {
    /// How many logit rows a chunk of `new_tokens` tokens produces.
    pub fn rows(self, new_tokens: usize) -> usize {
        match self {
            LogitsWanted::None => 0,
            LogitsWanted::Last => 1,
            LogitsWanted::AllPrompt => new_tokens,
        }
    }
}

/// Why a request finished. Exhaustive, like the other shared enums: the engine's public
/// spelling of it (`multilora::FinishReason`) names every reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FinishReason {
    /// `max_new_tokens` generated, or the sequence reached `max_model_len`.
    Length,
    /// A stop token was sampled, or the engine reported a stop (e.g. a stop string).
    Stop,
    /// Aborted by the caller.
    Aborted,
    /// The engine failed the request.
    Error,
}

impl FinishReason {
    /// A stable snake_case label, as OpenAI's `finish_reason` spells the first two.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Aborted => "abort",
            FinishReason::Error => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_rows_per_chunk() {
        assert_eq!(LogitsWanted::None.rows(5), 0);
        assert_eq!(LogitsWanted::Last.rows(5), 1);
        assert_eq!(LogitsWanted::AllPrompt.rows(5), 5);
        assert_eq!(FinishReason::Aborted.as_str(), "abort");
    }
}
