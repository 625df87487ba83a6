//! The model's vocabulary as `llguidance` reads it: every token id's bytes, read from the
//! tokenizer's `tokenizer.json` form by llguidance's own reader (byte-level BPE through GPT-2's
//! byte alphabet, SentencePiece's `▁` and `<0xNN>` tokens, special tokens behind toktrie's marker;
//! ids past the tokenizer empty), in a token trie with the engine's end-of-sequence ids, and
//! tokenization of forced bytes by the model's own tokenizer.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use tokenizers::Tokenizer;

/// The vocabulary `llguidance` compiles against.
pub(super) struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
    /// Whether the tokenizer writes a string's bytes as given (no prefix space added): only then
    /// may the grammar's forced bytes be tokenized by it (fast-forward tokens).
    canonical: bool,
}

impl Vocab {
    /// The vocabulary of `tokenizer` over a model of `vocab_size` logits whose end-of-sequence
    /// ids are `eos` (allowed when a grammar accepts).
    pub(super) fn env(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: &[u32]) -> Result<TokEnv, String> {
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| (t as usize) < vocab_size).collect();
        let Some(&first_eos) = eos.first() else {
            return Err("the model names no end-of-sequence token within its vocabulary".into());
        };
        let json = serde_json::to_value(&*tokenizer).map_err(|e| format!("writing the tokenizer as JSON: {e}"))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| format!("reading the tokenizer's tokens: {e}"))?;
        words.resize(vocab_size, Vec::new());
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let mut vocab = Vocab { trie, tokenizer, canonical: false };
        let probe = "x1 {\"a\": [2]}";
        vocab.canonical = vocab.trie.decode(&vocab.tokenize_bytes(probe.as_bytes())) == probe.as_bytes();
        Ok(Arc::new(vocab))
    }
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode_fast(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
        })
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture's byte-level tokenizer: its tokens' bytes spell text back, a special token
    /// sits behind the marker, and forced bytes are tokenized as the tokenizer does.
    #[test]
    fn a_byte_level_vocabulary_spells_text_back() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/peft-tiny/base/tokenizer.json");
        let tok = Arc::new(Tokenizer::from_file(dir).unwrap());
        let vocab = tok.get_vocab_size(true) + 3;
        let env = Vocab::env(Arc::clone(&tok), vocab, &[0]).unwrap();
        let text = " hello world\n{\"a\": 1}";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(env.tok_trie().decode(&ids), text.as_bytes());
        assert_eq!(env.tok_trie().vocab_size(), vocab);
        assert!(env.tokenize_is_canonical());
        assert!(Vocab::env(tok, vocab, &[vocab as u32]).is_err(), "no EOS within the vocabulary");
    }
}
