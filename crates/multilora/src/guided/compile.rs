//! [`Grammars`]: the engine's one `llguidance` parser factory over the model's vocabulary, made
//! on the first constrained request (an engine that never sees one never pays for it), and the
//! compiled grammars kept by content (an LRU of [`CACHED_GRAMMARS`]): a constraint seen before
//! costs a copy of its parser, not a compile. Compilation runs on the submitting thread under
//! llguidance's limits (grammar size, lexer fuel), so a schema too large or a regex too costly
//! is refused at `submit`.

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::InferenceCapabilities;
use llguidance::{ParserFactory, TokenParser};
use lru::LruCache;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::guide::{CLOSERS, Guide};
use super::vocab::Vocab;
use super::{Constraint, guarded};

/// Compiled grammars kept, by their constraint's content (a large schema's parser is megabytes).
pub const CACHED_GRAMMARS: usize = 64;

/// The limits every grammar compiles and runs under (llguidance's defaults but the grammar size,
/// which [`super::MAX_CONSTRAINT_BYTES`] bounds first): the lexer fuel bounds the compile
/// (1M units, ~20 ms) and each mask (200k units, ~15 ms); a constraint past them is refused, or
/// (mid-stream, a mask past its bound) ends its request with an error.
fn limits() -> ParserLimits {
    ParserLimits { max_grammar_size: 200_000, ..ParserLimits::default() }
}

/// JSON schemas compile to JSON whose whitespace between items is free but bounded (at most 16
/// spaces, tabs or newlines in a row: a model can pretty-print, not loop on blanks); a schema's
/// own `x-guidance` options win.
fn json_options() -> Value {
    json!({"whitespace_flexible": true, "whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{1,16}"})
}

/// The vocabulary's parser factory and its single-byte tokens in closing order (see `Guide`).
type Factory = (ParserFactory, Arc<[u32]>);

/// The engine's grammars: the vocabulary's parser factory (made once, on first use) and the
/// compiled-grammar cache.
pub(crate) struct Grammars {
    tokenizer: Option<Arc<Tokenizer>>,
    vocab_size: usize,
    eos: Vec<u32>,
    factory: OnceLock<Result<Factory, String>>,
    cache: Mutex<LruCache<blake3::Hash, TokenParser>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .field("cached", &self.cache.lock().len())
            .finish()
    }
}

impl Grammars {
    /// Grammars over `tokenizer`'s vocabulary (`None`: the engine has no tokenizer, and every
    /// constraint is refused), for a model of `vocab_size` logits ending on `eos`.
    pub(crate) fn new(tokenizer: Option<Arc<Tokenizer>>, vocab_size: usize, eos: Vec<u32>) -> Grammars {
        let capacity = NonZeroUsize::new(CACHED_GRAMMARS).unwrap_or(NonZeroUsize::MIN);
        Grammars { tokenizer, vocab_size, eos, factory: OnceLock::new(), cache: Mutex::new(LruCache::new(capacity)) }
    }

    /// The parser factory and the vocabulary's single-byte closing tokens.
    fn factory(&self) -> Result<&Factory, String> {
        let made = self.factory.get_or_init(|| {
            let tokenizer = self.tokenizer.clone().ok_or("structured outputs need the model's tokenizer")?;
            let started = Instant::now();
            let env = guarded("reading the vocabulary", || Vocab::env(tokenizer, self.vocab_size, &self.eos))?;
            let slices = llguidance::earley::SlicedBiasComputer::general_slices();
            let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &slices)
                .map_err(|e| format!("building the grammar vocabulary: {e}"))?;
            factory.quiet();
            *factory.limits_mut() = limits();
            tracing::info!(
                ms = started.elapsed().as_secs_f64() * 1e3,
                fast_forward = env.tokenize_is_canonical(),
                "structured outputs: vocabulary ready"
            );
            let trie = env.tok_trie();
            // The closers first, then every other printable byte, whitespace last.
            let rest = (0x21..0x7f).chain(*b" \n\t").filter(|b| !CLOSERS.contains(b));
            let closers: Arc<[u32]> = CLOSERS.iter().copied().chain(rest).filter_map(|b| trie.token_id(&[b])).collect();
            Ok((factory, closers))
        });
        made.as_ref().map_err(Clone::clone)
    }

    /// A guide for `constraint` (checked by [`Constraint::check`] already), compiled or copied
    /// from the cache; `fast_forward` lets it hand back the tokens its grammar forces,
    /// `speculate` lets its row try a token before any mask (see [`Guide`]).
    pub(crate) fn guide(&self, constraint: &Constraint, fast_forward: bool, speculate: bool) -> Result<Guide, String> {
        let (factory, closers) = self.factory()?;
        let key = cache_key(constraint);
        let cached = self.cache.lock().get(&key).map(TokenParser::deep_clone);
        let parser = match cached {
            Some(p) => p,
            None => {
                let compile = || factory.create_parser(grammar(constraint)).map_err(|e| e.to_string());
                let parser = guarded("compiling the constraint", compile)?;
                self.cache.lock().put(key, parser.deep_clone());
                parser
            }
        };
        let fast_forward = fast_forward && factory.tok_env().tokenize_is_canonical();
        Guide::new(parser, fast_forward, speculate, Arc::clone(closers))
    }
}

/// The cache's key: a digest of the constraint's kind and content.
fn cache_key(c: &Constraint) -> blake3::Hash {
    let text = match c {
        Constraint::JsonSchema(v) => format!("json:{v}"),
        Constraint::JsonObject => "json_object".into(),
        Constraint::Regex(s) => format!("regex:{s}"),
        Constraint::Choice(v) => format!("choice:{}", Value::from(v.clone())),
        Constraint::Grammar(s) => format!("grammar:{s}"),
    };
    blake3::hash(text.as_bytes())
}

/// The llguidance grammar of a constraint.
fn grammar(c: &Constraint) -> TopLevelGrammar {
    let schema = |mut v: Value| {
        if let Some(o) = v.as_object_mut() {
            o.entry("x-guidance").or_insert_with(json_options);
        }
        TopLevelGrammar::from_json_schema(v)
    };
    match c {
        Constraint::JsonSchema(v) => schema(v.clone()),
        Constraint::JsonObject => schema(json!({"type": "object"})),
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(v) => {
            let quoted: Vec<String> = v.iter().map(|s| Value::from(s.as_str()).to_string()).collect();
            TopLevelGrammar::from_lark(format!("start: {}", quoted.join(" | ")))
        }
        Constraint::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
    }
}
