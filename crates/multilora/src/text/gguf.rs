//! A tokenizer built from a GGUF file's metadata (`tokenizer.ggml.*`), the way transformers builds
//! one when it loads the file, so prompts get the ids the model was trained on:
//!
//! - `gpt2` (byte-level BPE: Llama 3, Qwen2, SmolLM, …): the vocabulary and merges, the
//!   pre-tokenizer that `tokenizer.ggml.pre` names (each one's split regex and byte-level
//!   settings, as in the model's own `tokenizer.json`), byte-level decoding;
//! - `llama` (SentencePiece: Llama 2, Mistral v0.1): a BPE over the pieces with byte fallback,
//!   merges derived from the pieces' scores as transformers derives them, `▁` for spaces;
//! - control tokens (type 3) are special tokens, user-defined ones (type 4) added tokens; BOS is
//!   prepended when `tokenizer.ggml.add_bos_token` says so.
//!
//! A pre-tokenizer this table does not know is refused (a silently different split would give
//! the model other ids than it was trained on): `--tokenizer DIR` serves the model's own.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use multilora_models::GgufFile;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NFC, Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::tokenizer::SplitDelimiterBehavior;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

/// Why a GGUF file's tokenizer could not be built.
pub(crate) type Refusal = String;

/// Llama 3's split (llama.cpp's `llama-bpe`, transformers' Llama 3 `tokenizer.json`).
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: as Llama 3's, with single digits.
const REGEX_QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer the metadata describes.
pub(crate) fn tokenizer(gguf: &GgufFile) -> Result<Tokenizer, Refusal> {
    let model = gguf.string("tokenizer.ggml.model").ok_or("no tokenizer.ggml.model")?;
    let tokens = strings(gguf, "tokenizer.ggml.tokens")?;
    let types: Vec<u32> = match gguf.metadata().get("tokenizer.ggml.token_type") {
        Some(v) => numbers(v, "tokenizer.ggml.token_type")?.into_iter().map(|x| x as u32).collect(),
        None => vec![1; tokens.len()],
    };
    let id = |key: &str| gguf.integer(&format!("tokenizer.ggml.{key}")).map(|x| x as u32);
    let mut tok = match model {
        "gpt2" => byte_level_bpe(gguf, &tokens)?,
        "llama" => sentencepiece_bpe(gguf, &tokens, id("unknown_token_id"))?,
        other => return Err(format!("tokenizer.ggml.model {other:?} is not supported (gpt2 and llama are)")),
    };
    let mut special = Vec::new();
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        match types.get(i) {
            Some(3) => special.push(AddedToken::from(t.clone(), true).normalized(false)),
            Some(4) => added.push(AddedToken::from(t.clone(), false).normalized(false)),
            _ => {}
        }
    }
    tok.add_special_tokens(special).map_err(|e| format!("its special tokens: {e}"))?;
    tok.add_tokens(added).map_err(|e| format!("its added tokens: {e}"))?;
    let add_bos = gguf.metadata().get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false);
    if add_bos {
        let bos = id("bos_token_id").and_then(|b| tokens.get(b as usize).map(|t| (t.clone(), b)));
        let (bos, bos_id) = bos.ok_or("tokenizer.ggml.add_bos_token is set but there is no bos_token_id")?;
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos}:0 $A:0"))
            .and_then(|b| b.try_pair(format!("{bos}:0 $A:0 {bos}:1 $B:1")))
            .map_err(|e| format!("the bos template: {e}"))?
            .special_tokens(vec![(bos, bos_id)])
            .build()
            .map_err(|e| format!("the bos template: {e}"))?;
        tok.with_post_processor(Some(template));
    }
    Ok(tok)
}

/// Byte-level BPE with the split `tokenizer.ggml.pre` names.
fn byte_level_bpe(gguf: &GgufFile, tokens: &[String]) -> Result<Tokenizer, Refusal> {
    let merges = strings(gguf, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or(format!("merge {m:?} is not two tokens"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let pre = gguf.string("tokenizer.ggml.pre").unwrap_or("default");
    let add_prefix_space =
        gguf.metadata().get("tokenizer.ggml.add_space_prefix").and_then(|v| v.to_bool().ok()).unwrap_or(false);
    // (split regex before the byte-level step, whether the byte-level step splits by GPT-2's own
    // regex, ignore_merges, NFC)
    let (regex, gpt2_regex, ignore_merges, nfc) = match pre {
        "default" | "gpt2" | "smollm" | "starcoder" | "refact" | "codeshell" => (None, true, false, false),
        "llama-bpe" | "llama3" | "smaug-bpe" => (Some(REGEX_LLAMA3), false, true, false),
        "qwen2" => (Some(REGEX_QWEN2), false, false, true),
        other => {
            return Err(format!(
                "tokenizer.ggml.pre {other:?} is a pre-tokenizer this engine does not know; serve the model's \
                 own tokenizer with --tokenizer DIR"
            ));
        }
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| format!("the BPE model: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(add_prefix_space, true, gpt2_regex);
    let pre_tokenizer: PreTokenizerWrapper = match regex {
        None => byte_level.into(),
        Some(r) => {
            let split = Split::new(SplitPattern::Regex(r.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| format!("the split regex: {e}"))?;
            Sequence::new(vec![split.into(), byte_level.into()]).into()
        }
    };
    if nfc {
        tok.with_normalizer(Some(NormalizerWrapper::from(NFC))).map_err(|e| format!("its normalizer: {e}"))?;
    }
    tok.with_pre_tokenizer(Some(pre_tokenizer));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tok)
}

/// SentencePiece pieces as a BPE with byte fallback: merges of every piece that two other
/// pieces make, best score first (transformers' `SentencePieceExtractor`), `▁` for spaces and a
/// `▁` before the text unless `tokenizer.ggml.add_space_prefix` is false.
fn sentencepiece_bpe(gguf: &GgufFile, tokens: &[String], unk: Option<u32>) -> Result<Tokenizer, Refusal> {
    let scores: Vec<f64> = match gguf.metadata().get("tokenizer.ggml.scores") {
        Some(v) => numbers(v, "tokenizer.ggml.scores")?,
        None => return Err("a llama (SentencePiece) tokenizer needs tokenizer.ggml.scores".into()),
    };
    if scores.len() != tokens.len() {
        return Err(format!("{} scores for {} tokens", scores.len(), tokens.len()));
    }
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(usize, usize, f64)> = Vec::new();
    for (piece, &score) in tokens.iter().zip(&scores) {
        let mut local = Vec::new();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                local.push((li, ri, score));
            }
        }
        local.sort_by_key(|&(l, r, _)| (l, r));
        merges.extend(local);
    }
    // Stable: pieces of equal score keep the order above.
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    let merges = merges.into_iter().map(|(l, r, _)| (tokens[l].clone(), tokens[r].clone())).collect();
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(t) = unk.and_then(|u| tokens.get(u as usize)) {
        builder = builder.unk_token(t.clone());
    }
    let mut tok = Tokenizer::new(builder.build().map_err(|e| format!("the BPE model: {e}"))?);
    let prefix = gguf.metadata().get("tokenizer.ggml.add_space_prefix").and_then(|v| v.to_bool().ok()).unwrap_or(true);
    let space = Replace::new(" ", "\u{2581}").map_err(|e| e.to_string())?;
    let normalizer: NormalizerWrapper = if prefix {
        tokenizers::normalizers::Sequence::new(vec![Prepend::new("\u{2581}".into()).into(), space.into()]).into()
    } else {
        space.into()
    };
    tok.with_normalizer(Some(normalizer)).map_err(|e| format!("its normalizer: {e}"))?;
    let back = Replace::new("\u{2581}", " ").map_err(|e| e.to_string())?;
    let mut steps: Vec<DecoderWrapper> = vec![back.into(), ByteFallback::new().into(), Fuse::new().into()];
    if prefix {
        steps.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(DecoderSequence::new(steps)));
    Ok(tok)
}

fn strings(gguf: &GgufFile, key: &str) -> Result<Vec<String>, Refusal> {
    let v = gguf.metadata().get(key).ok_or(format!("no {key}"))?;
    let items = v.to_vec().map_err(|_| format!("{key} is not an array"))?;
    items
        .iter()
        .map(|x| x.to_string().cloned().map_err(|_| format!("{key} holds a value that is not a string")))
        .collect()
}

fn numbers(v: &Value, key: &str) -> Result<Vec<f64>, Refusal> {
    let items = v.to_vec().map_err(|_| format!("{key} is not an array"))?;
    items.iter().map(|x| number(x).ok_or(format!("{key} holds a value that is not a number"))).collect()
}

/// Any integer or float metadata value as f64.
fn number(v: &Value) -> Option<f64> {
    Some(match *v {
        Value::U8(x) => f64::from(x),
        Value::I8(x) => f64::from(x),
        Value::U16(x) => f64::from(x),
        Value::I16(x) => f64::from(x),
        Value::U32(x) => f64::from(x),
        Value::I32(x) => f64::from(x),
        Value::U64(x) => x as f64,
        Value::I64(x) => x as f64,
        Value::F32(x) => f64::from(x),
        Value::F64(x) => x,
        _ => return None,
    })
}
