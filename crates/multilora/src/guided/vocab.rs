//! The model's vocabulary as `llguidance` reads it: every token id's bytes (a byte-level BPE
//! token through GPT-2's byte alphabet, a SentencePiece token with `▁` as a space and `<0xNN>`
//! as its byte, a special token behind toktrie's marker byte, ids past the tokenizer empty), in
//! a token trie with the engine's end-of-sequence ids, and tokenization of forced bytes by the
//! model's own tokenizer.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use tokenizers::Tokenizer;

/// How the tokenizer's decoder turns token strings into text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's byte-level alphabet: each char stands for one byte.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` a raw byte.
    SentencePiece,
}

/// The decoder's spelling, read from its serialized form (a `ByteLevel` decoder anywhere, or
/// `Metaspace` / `ByteFallback` / a `▁` replacement); `None` when it is neither.
fn spelling(tok: &Tokenizer) -> Option<Spelling> {
    let decoder = serde_json::to_string(tok.get_decoder()?).ok()?;
    if decoder.contains("\"ByteLevel\"") {
        Some(Spelling::ByteLevel)
    } else if ["\"Metaspace\"", "\"ByteFallback\"", "▁"].iter().any(|m| decoder.contains(m)) {
        Some(Spelling::SentencePiece)
    } else {
        None
    }
}

/// GPT-2's map from the printable chars of its byte-level alphabet back to bytes.
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                b as u32
            } else {
                next += 1;
                next - 1
            };
            (char::from_u32(c).unwrap_or('\u{FFFD}'), b)
        })
        .collect()
}

/// The bytes `name` (a token's string in the vocabulary) stands for.
fn token_bytes(name: &str, spelling: Spelling, chars: &HashMap<char, u8>) -> Result<Vec<u8>, String> {
    match spelling {
        Spelling::ByteLevel => name
            .chars()
            .map(|c| chars.get(&c).copied().ok_or_else(|| format!("token {name:?}: {c:?} is not a byte-level char")))
            .collect(),
        Spelling::SentencePiece => {
            let hex = name.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
            match hex.filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => Ok(vec![b]),
                None => Ok(name.replace('▁', " ").into_bytes()),
            }
        }
    }
}

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
        let spelling = spelling(&tokenizer).ok_or("the tokenizer's decoder is neither byte-level nor SentencePiece")?;
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| (t as usize) < vocab_size).collect();
        let Some(&first_eos) = eos.first() else {
            return Err("the model names no end-of-sequence token within its vocabulary".into());
        };
        let chars = byte_level_chars();
        let mut words = vec![Vec::new(); vocab_size];
        let specials = tokenizer.get_added_tokens_decoder();
        for (name, id) in tokenizer.get_vocab(true) {
            let Some(word) = words.get_mut(id as usize) else { continue };
            *word = match specials.get(&id) {
                Some(added) if added.special => {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], added.content.as_bytes()].concat()
                }
                Some(added) => added.content.clone().into_bytes(),
                None => token_bytes(&name, spelling, &chars)?,
            };
        }
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

    #[test]
    fn the_byte_level_alphabet_is_gpt2s() {
        let chars = byte_level_chars();
        assert_eq!(chars.len(), 256);
        assert_eq!(chars[&'Ġ'], b' ');
        assert_eq!(chars[&'Ċ'], b'\n');
        assert_eq!(chars[&'a'], b'a');
        assert_eq!(token_bytes("ĠhelloĊ", Spelling::ByteLevel, &chars).unwrap(), b" hello\n");
        assert!(token_bytes("\u{4e00}", Spelling::ByteLevel, &chars).is_err());
    }

    #[test]
    fn sentencepiece_spaces_and_bytes() {
        let chars = HashMap::new();
        assert_eq!(token_bytes("▁the", Spelling::SentencePiece, &chars).unwrap(), b" the");
        assert_eq!(token_bytes("<0x0A>", Spelling::SentencePiece, &chars).unwrap(), b"\n");
        assert_eq!(token_bytes("<0xZZ>", Spelling::SentencePiece, &chars).unwrap(), b"<0xZZ>");
    }
}
