//! Incremental detokenization for streaming, with the prefix-offset technique of vLLM / TGI:
//! decode a short window of tokens before and after the new one, and emit the difference only
//! when it does not end in U+FFFD (a multi-byte character split across tokens).

use tokenizers::Tokenizer;

/// Tokens of context kept before the unread ones: enough for byte-level BPE to decode the
/// boundary the same way as the whole sequence.
const CONTEXT: usize = 5;

/// One request's detokenization state.
#[derive(Debug)]
pub(crate) struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl Detokenizer {
    /// Starts after `prompt`, so the first generated token decodes in its context.
    pub(crate) fn new(prompt: &[u32], skip_special: bool) -> Detokenizer {
        let tail = prompt.len().saturating_sub(CONTEXT);
        Detokenizer { ids: prompt[tail..].to_vec(), prefix_offset: 0, read_offset: prompt.len() - tail, skip_special }
    }

    /// Adds `token` and returns the text it completes (possibly empty).
    pub(crate) fn push(&mut self, tok: &Tokenizer, token: u32) -> String {
        self.ids.push(token);
        let decode = |ids: &[u32]| tok.decode(ids, self.skip_special).unwrap_or_default();
        let prefix = decode(&self.ids[self.prefix_offset..self.read_offset]);
        let full = decode(&self.ids[self.prefix_offset..]);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = full.get(prefix.len()..).unwrap_or_default().to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            // Keep the window short: drop what no later decode needs.
            if self.prefix_offset > 4 * CONTEXT {
                self.ids.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            delta
        } else {
            if full.len() <= prefix.len() && !full.ends_with('\u{FFFD}') {
                // The new tokens show nothing (special tokens, skipped): nothing is pending, and
                // only the last CONTEXT tokens are kept as context, so a flood of them costs
                // O(1) per token instead of decoding an ever longer window.
                self.read_offset = self.ids.len();
                self.prefix_offset = self.prefix_offset.max(self.read_offset.saturating_sub(CONTEXT));
                if self.prefix_offset > 4 * CONTEXT {
                    self.ids.drain(..self.prefix_offset);
                    self.read_offset -= self.prefix_offset;
                    self.prefix_offset = 0;
                }
            }
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_deltas_never_split_a_character_and_add_up() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/peft-tiny/base/tokenizer.json");
        let tok = Tokenizer::from_file(path).expect("fixture tokenizer");
        let text = "Grüße aus Köln: ☃ naïve café — 東京 🚀 done";
        let ids = tok.encode(text, true).expect("encode").get_ids().to_vec();
        let (prompt, rest) = ids.split_at(3);
        let mut d = Detokenizer::new(prompt, true);
        let mut out = String::new();
        for &t in rest {
            let delta = d.push(&tok, t);
            assert!(!delta.contains('\u{FFFD}'), "delta {delta:?} splits a character");
            out.push_str(&delta);
        }
        let whole = tok.decode(&ids, true).expect("decode");
        let head = tok.decode(prompt, true).expect("decode");
        assert_eq!(format!("{head}{out}"), whole);
    }

    #[test]
    fn a_flood_of_skipped_special_tokens_keeps_the_window_short() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/peft-tiny/base/tokenizer.json");
        let tok = Tokenizer::from_file(path).expect("fixture tokenizer");
        let eos = tok.token_to_id("</s>").expect("an EOS token");
        let text = tok.encode(" hello world", false).expect("encode").get_ids().to_vec();
        let mut d = Detokenizer::new(&[1], true);
        let mut out = String::new();
        for i in 0..10_000 {
            out.push_str(&d.push(&tok, eos));
            assert!(d.ids.len() <= 6 * CONTEXT, "the window grew to {} tokens after {i} specials", d.ids.len());
        }
        for &t in &text {
            out.push_str(&d.push(&tok, t));
        }
        assert_eq!(out, tok.decode(&text, true).expect("decode"), "the text after the flood is intact");
    }
}
