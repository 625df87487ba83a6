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
}
