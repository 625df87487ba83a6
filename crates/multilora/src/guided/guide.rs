//! [`Guide`]: one constrained request's grammar state. A greedy or plain-temperature row first
//! tries the token it samples from its whole row ([`Guide::allows`], one token checked, no mask);
//! otherwise, or when the grammar refuses it, its allowed-token mask is computed
//! ([`Guide::prepare`]; ahead, beside the step's forward pass, for a row that cannot try first or
//! was refused last time) and the sampler draws under it ([`Guide::mask`]). The sampled token is
//! then fed to the grammar ([`Guide::accept`]), which hands back the tokens it now forces (at most
//! the room the request has left), fed to it as well. A panic inside the grammar library is caught
//! and becomes this request's error.
//!
//! Near `max_tokens` a guide closes its grammar: it plays the shortest way to an accepting state
//! it finds greedily (closing quotes and brackets first, [`CLOSERS`]) on a copy, and once the
//! tokens left are that many plus [`CLOSE_MARGIN`], the masks allow only that way's next token,
//! then the end of the sequence: a reply cut by its budget still parses (it finishes with
//! `length`), where an unconstrained engine returns a truncated one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, TokenParser};

use super::guarded;

/// The bytes tried first, in order, when closing a grammar: what ends a string, an object or an
/// array, then the shortest values and separators, then letters of `true` / `false` / `null`.
pub(crate) const CLOSERS: &[u8] = b"\"}])0:,eluasrtfn1";

/// Tokens kept in hand beyond the closing way's length before closing starts.
pub(crate) const CLOSE_MARGIN: usize = 8;

/// Longest closing way looked for; a grammar that needs more is cut by `max_tokens` as usual.
const MAX_CLOSE: usize = 64;

/// One request's grammar state.
pub(crate) struct Guide {
    matcher: Matcher,
    /// The vocabulary's single-byte tokens: those of [`CLOSERS`] in that order, then the other
    /// printable bytes, whitespace last.
    closers: Arc<[u32]>,
    /// Closing: the masks allow only the closing way's next token.
    closing: bool,
    /// Tokens left at which to look at the closing way again.
    close_check: usize,
    /// The mask for the next sampled token, once computed.
    mask: Option<SimpleVob>,
    /// Whether forced tokens are handed back (off when the request wants logprobs, which forced
    /// tokens have none of, or when the tokenizer is not canonical).
    fast_forward: bool,
    /// Whether the row may try a token before any mask: greedy, or a temperature with no top-k,
    /// top-p or min-p. Drawing from the whole row and keeping the token when the grammar allows
    /// it, drawing again under the mask when not, then samples exactly the masked distribution
    /// (rejection sampling; greedy's argmax is the masked argmax whenever it is allowed).
    speculate: bool,
    /// The last try was refused: the next mask is computed ahead, beside the forward pass.
    missed: bool,
    /// This token was tried first.
    tried: bool,
    /// How long the last mask took, until the metrics take it.
    mask_time: Option<Duration>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("mask_ready", &self.mask.is_some())
            .field("fast_forward", &self.fast_forward)
            .finish()
    }
}

/// Whether `t` is one of the grammar's end-of-sequence tokens.
fn is_eos(m: &Matcher, t: u32) -> bool {
    m.tok_env().is_ok_and(|env| env.tok_trie().eos_tokens().contains(&t))
}

/// The closing way's next token: an end-of-sequence token when the grammar accepts, else the
/// first of `closers` it allows (single bytes, closing ones first; each checked alone, no mask
/// computed), else the lowest id of its mask.
fn closing_step(m: &mut Matcher, closers: &[u32]) -> Result<u32, String> {
    let env = m.tok_env().map_err(|e| e.to_string())?;
    if m.is_stopped() || m.is_accepting().map_err(|e| e.to_string())? {
        return Ok(env.tok_trie().eos_token());
    }
    for &t in closers {
        if m.validate_tokens(&[t]).map_err(|e| e.to_string())? == 1 {
            return Ok(t);
        }
    }
    let mask = m.compute_mask().map_err(|e| e.to_string())?;
    mask.first_bit_set().map(|t| t as u32).ok_or_else(|| "the grammar allows no token".to_string())
}

/// What feeding a sampled token gave.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Accepted {
    /// Tokens the grammar forces next, already fed to it.
    pub(crate) forced: Vec<u32>,
    /// The grammar cannot go on: the request ends here.
    pub(crate) stopped: bool,
}

impl Guide {
    pub(super) fn new(
        parser: TokenParser,
        fast_forward: bool,
        speculate: bool,
        closers: Arc<[u32]>,
    ) -> Result<Guide, String> {
        let matcher = guarded("starting the grammar", || Ok(Matcher::new(Ok(parser))))?;
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Guide {
            matcher,
            closers,
            closing: false,
            close_check: MAX_CLOSE + CLOSE_MARGIN,
            mask: None,
            fast_forward,
            speculate,
            missed: false,
            tried: false,
            mask_time: None,
        })
    }

    /// Whether the next mask is worth computing ahead, beside the forward pass: the row cannot
    /// try a token first, or its last try was refused.
    pub(crate) fn mask_ahead(&self) -> bool {
        !self.speculate || self.missed || self.closing
    }

    /// Whether the row tries a token before any mask now (`left`: the tokens it may still
    /// generate, this one included; closing is decided here too).
    pub(crate) fn tries_first(&mut self, left: usize) -> bool {
        self.check_closing(left);
        self.speculate && !self.closing && self.mask.is_none()
    }

    /// Whether the grammar allows `token` next (an end-of-sequence token: whether it accepts);
    /// the outcome decides whether the next mask is computed ahead.
    pub(crate) fn allows(&mut self, token: u32) -> Result<bool, String> {
        let matcher = &mut self.matcher;
        let ok = guarded("checking a token", || {
            if is_eos(matcher, token) {
                return matcher.is_accepting().map_err(|e| e.to_string());
            }
            Ok(matcher.validate_tokens(&[token]).map_err(|e| e.to_string())? == 1)
        })?;
        (self.missed, self.tried) = (!ok, true);
        Ok(ok)
    }

    /// Decides, once `left` is small enough to matter, whether to close the grammar now.
    fn check_closing(&mut self, left: usize) {
        if !self.closing && left <= self.close_check {
            match self.closing_way(left) {
                // Forced tokens overshot what is left: it will not fit later either.
                Some(n) if n > left => self.close_check = 0,
                Some(n) if n + CLOSE_MARGIN >= left => self.closing = true,
                Some(n) => self.close_check = n + CLOSE_MARGIN,
                // No way within what is left: look again with half as much.
                None => self.close_check = left / 2,
            }
        }
    }

    /// Whether the guide is closing its grammar for want of tokens.
    pub(crate) fn closing(&self) -> bool {
        self.closing
    }

    /// Computes the mask for the next token, unless it is ready; `left`: the tokens the request
    /// may still generate, this one included.
    pub(crate) fn prepare(&mut self, left: usize) -> Result<(), String> {
        if self.mask.is_some() {
            return Ok(());
        }
        let started = Instant::now();
        self.check_closing(left);
        let (matcher, closers, closing) = (&mut self.matcher, &self.closers, self.closing);
        let mask = guarded("computing a mask", || {
            if closing {
                let vocab = matcher.tok_env().map_err(|e| e.to_string())?.tok_trie().vocab_size();
                let mut one = SimpleVob::alloc(vocab);
                one.allow_token(closing_step(matcher, closers)?);
                return Ok(one);
            }
            matcher.compute_mask_or_eos().map_err(|e| e.to_string())
        })?;
        self.mask_time = Some(started.elapsed());
        self.mask = Some(mask);
        Ok(())
    }

    /// The length of the greedy way to an accepting state from here ([`closing_step`] after
    /// step, the forced tokens included), played on a copy of the parser: `None` when none is
    /// found within `limit` tokens (or [`MAX_CLOSE`]), or the grammar fails on the copy.
    fn closing_way(&self, limit: usize) -> Option<usize> {
        // A shallow copy: it shares the lexer's caches with the guide (same thread, one at a
        // time), which a deep copy would duplicate (megabytes for a large schema).
        let mut copy = self.matcher.clone();
        let (closers, fast_forward) = (&self.closers, self.fast_forward);
        guarded("closing a grammar", || {
            let mut n = 0;
            while n < limit.min(MAX_CLOSE) {
                let t = closing_step(&mut copy, closers)?;
                n += 1;
                if is_eos(&copy, t) {
                    return Ok(Some(n));
                }
                copy.consume_token(t).map_err(|e| e.to_string())?;
                // The tokens the grammar then forces come as the real reply's would.
                if fast_forward && !copy.is_stopped() {
                    let forced = copy.compute_ff_tokens();
                    copy.consume_tokens(&forced).map_err(|e| e.to_string())?;
                    n += forced.len();
                }
                if copy.is_stopped() {
                    return Ok(Some(n));
                }
            }
            Ok(None)
        })
        .ok()
        .flatten()
    }

    /// How long the last mask took, once (for the metrics).
    pub(crate) fn take_mask_time(&mut self) -> Option<Duration> {
        self.mask_time.take()
    }

    /// The mask for the next token, if [`Guide::prepare`] made it.
    pub(crate) fn mask(&self) -> Option<&SimpleVob> {
        self.mask.as_ref()
    }

    /// Feeds the sampled `token`; with fast-forward on, also the tokens the grammar then forces,
    /// at most `room` of them.
    pub(crate) fn accept(&mut self, token: u32, room: usize) -> Result<Accepted, String> {
        // A refused try asks for one mask ahead, for the next token only.
        self.missed = self.missed && std::mem::take(&mut self.tried);
        self.mask = None;
        let matcher = &mut self.matcher;
        let fast_forward = self.fast_forward;
        guarded("feeding a token", || {
            matcher.consume_token(token).map_err(|e| e.to_string())?;
            let mut forced = Vec::new();
            if fast_forward && room > 0 && !matcher.is_stopped() {
                forced = matcher.compute_ff_tokens();
                forced.truncate(room);
                if !forced.is_empty() {
                    matcher.consume_tokens(&forced).map_err(|e| e.to_string())?;
                }
            }
            Ok(Accepted { forced, stopped: matcher.is_stopped() })
        })
    }
}
