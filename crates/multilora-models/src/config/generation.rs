//! `generation_config.json`: the sampling defaults and EOS ids a checkpoint ships, read as vLLM's
//! `--generation-config auto` reads them (`temperature`, `top_p`, `top_k`, `min_p`,
//! `repetition_penalty`, `max_new_tokens`; `do_sample` is ignored, as vLLM ignores it), for
//! requests that leave those fields unset. Errors name the file and the field.

use std::path::Path;

use serde::Deserialize;

use super::{ConfigError, TokenIds, read_config_text};

/// What a checkpoint's `generation_config.json` sets; every field `None` (or empty) when the
/// file does not set it.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct GenerationConfig {
    /// Default `temperature`.
    pub temperature: Option<f32>,
    /// Default `top_p`.
    pub top_p: Option<f32>,
    /// Default `top_k`.
    pub top_k: Option<i32>,
    /// Default `min_p`.
    pub min_p: Option<f32>,
    /// Default `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// Default `max_tokens`.
    pub max_new_tokens: Option<usize>,
    /// `eos_token_id` (one or a list): generation stops at any of them, beside `config.json`'s.
    pub eos_token_ids: Vec<u32>,
}

/// The file as written: the fields read, unknown ones ignored (transformers writes many).
#[derive(Debug, Deserialize)]
struct RawGeneration {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_new_tokens: Option<usize>,
    eos_token_id: Option<TokenIds>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` (a regular file of at most
    /// [`super::MAX_CONFIG_BYTES`]); a checkpoint without one has no defaults: `Ok` of the
    /// empty config.
    pub fn from_file(path: &Path) -> Result<GenerationConfig, ConfigError> {
        if !path.exists() {
            return Ok(GenerationConfig::default());
        }
        GenerationConfig::parse(&read_config_text(path)?, path)
    }

    /// Reads the text of a `generation_config.json`; errors name `path`.
    pub fn parse(text: &str, path: &Path) -> Result<GenerationConfig, ConfigError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let raw: RawGeneration = serde_path_to_error::deserialize(de)
            .map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })?;
        let bad = |field: &'static str, reason: String| ConfigError::Field { path: path.to_path_buf(), field, reason };
        let finite = |field: &'static str, v: Option<f32>, ok: fn(f32) -> bool, range: &str| match v {
            Some(x) if !x.is_finite() || !ok(x) => Err(bad(field, format!("is {x}, not {range}"))),
            _ => Ok(v),
        };
        Ok(GenerationConfig {
            temperature: finite("temperature", raw.temperature, |t| t >= 0.0, ">= 0")?,
            top_p: finite("top_p", raw.top_p, |p| p > 0.0 && p <= 1.0, "in (0, 1]")?,
            top_k: raw.top_k,
            min_p: finite("min_p", raw.min_p, |p| (0.0..=1.0).contains(&p), "in [0, 1]")?,
            repetition_penalty: finite("repetition_penalty", raw.repetition_penalty, |r| r > 0.0, "> 0")?,
            max_new_tokens: match raw.max_new_tokens {
                Some(0) => return Err(bad("max_new_tokens", "is 0".to_string())),
                v => v,
            },
            eos_token_ids: match raw.eos_token_id {
                Some(TokenIds::One(id)) => vec![id],
                Some(TokenIds::Many(ids)) => ids,
                None => Vec::new(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<GenerationConfig, ConfigError> {
        GenerationConfig::parse(text, Path::new("generation_config.json"))
    }

    #[test]
    fn reads_what_vllm_reads_and_ignores_the_rest() {
        let g = parse(
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                "repetition_penalty": 1.1, "max_new_tokens": 256, "eos_token_id": [128001, 128009],
                "transformers_version": "4.44.0", "pad_token_id": 0}"#,
        )
        .unwrap();
        assert_eq!(
            (g.temperature, g.top_p, g.top_k, g.min_p, g.repetition_penalty, g.max_new_tokens),
            (Some(0.6), Some(0.9), Some(20), Some(0.05), Some(1.1), Some(256))
        );
        assert_eq!(g.eos_token_ids, vec![128001, 128009]);
        let g = parse(r#"{"eos_token_id": 2, "bos_token_id": 1}"#).unwrap();
        assert_eq!(g, GenerationConfig { eos_token_ids: vec![2], ..GenerationConfig::default() });
    }

    #[test]
    fn bad_values_name_the_field() {
        for (text, field) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"max_new_tokens": 0}"#, "max_new_tokens"),
            (r#"{"top_k": "many"}"#, "top_k"),
            (r#"{"eos_token_id": [1, -2]}"#, "eos_token_id"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains("generation_config.json") && err.contains(field), "{text}: {err}");
        }
    }

    #[test]
    fn a_missing_file_has_no_defaults_and_a_fifo_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("generation_config.json");
        assert_eq!(GenerationConfig::from_file(&missing).unwrap(), GenerationConfig::default());
        std::fs::create_dir(&missing).unwrap();
        let err = GenerationConfig::from_file(&missing).unwrap_err();
        assert!(err.kind() == "config" && err.to_string().contains("not a regular file"), "{err}");
    }
}
