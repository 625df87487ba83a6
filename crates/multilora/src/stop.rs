//! Stop strings, matched incrementally: one Aho–Corasick automaton per request (built on the
//! caller's thread at submit, shared by reference), stepped over each new text delta from the
//! state the previous delta left it in. A token costs O(its bytes), whatever the number and
//! length of the stop strings, so one request's long stop list cannot slow the requests sharing
//! its steps.

use std::sync::Arc;

use aho_corasick::Anchored;
use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;

use crate::error::{EngineError, Result};

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 64;
/// Most bytes (UTF-8) of one stop string.
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// A request's stop strings, compiled.
#[derive(Clone, Debug)]
pub(crate) struct StopStrings {
    automaton: Arc<NFA>,
    /// The strings, in the order the automaton numbers them.
    strings: Arc<[String]>,
    start: StateID,
    /// Bytes of text held back until they cannot start a stop string: the longest less one.
    hold: usize,
}

impl StopStrings {
    /// Compiles `stops` (already checked against the limits); `None` when there are none.
    pub(crate) fn new(stops: &[String]) -> Result<Option<StopStrings>> {
        if stops.is_empty() {
            return Ok(None);
        }
        let invalid = |e: &dyn std::fmt::Display| EngineError::invalid(format!("stop strings: {e}"));
        let automaton = NFA::new(stops).map_err(|e| invalid(&e))?;
        let start = automaton.start_state(Anchored::No).map_err(|e| invalid(&e))?;
        let hold = stops.iter().map(String::len).max().unwrap_or(1) - 1;
        Ok(Some(StopStrings { automaton: Arc::new(automaton), strings: stops.into(), start, hold }))
    }

    /// A scan from the start of the generated text.
    pub(crate) fn scanner(&self) -> StopScan {
        StopScan { stops: self.clone(), state: self.start, scanned: 0, held: String::new() }
    }
}

/// Where one request's scan of its generated text stands. As in vLLM, the text that could still
/// be the start of a stop string is held back, so no part of a stop string is ever sent.
#[derive(Debug)]
pub(crate) struct StopScan {
    stops: StopStrings,
    state: StateID,
    /// Bytes of generated text scanned so far (held ones included).
    scanned: usize,
    /// Scanned text not sent yet.
    held: String,
}

impl StopScan {
    /// Scans `delta`, the next piece of generated text; `last` when the request ends with this
    /// token anyway (length or a stop token). Returns the text to send now and the stop string
    /// found, if one was (then the text is everything before it, and the request stops). The
    /// first position where any stop string ends decides; the longest one ending there is cut
    /// and returned.
    pub(crate) fn push(&mut self, delta: &str, last: bool) -> (String, Option<&str>) {
        let aut = &*self.stops.automaton;
        let held_from = self.scanned - self.held.len();
        for (i, &b) in delta.as_bytes().iter().enumerate() {
            self.state = aut.next_state(Anchored::No, self.state, b);
            if aut.is_match(self.state) {
                let longest = (0..aut.match_len(self.state))
                    .map(|k| aut.match_pattern(self.state, k))
                    .max_by_key(|&p| aut.pattern_len(p));
                let end = self.scanned + i + 1;
                let start = end - longest.map_or(0, |p| aut.pattern_len(p));
                // The stop string began in the held text or in this delta: never in sent text,
                // which is at least `hold` bytes before the end of what was scanned.
                self.held.push_str(&delta[..i + 1]);
                let keep = start.saturating_sub(held_from).min(self.held.len());
                let out = self.held[..keep].to_string();
                self.held.clear();
                self.scanned = end;
                return (out, longest.map(|p| self.stops.strings[p.as_usize()].as_str()));
            }
        }
        self.scanned += delta.len();
        self.held.push_str(delta);
        let mut send = if last { self.held.len() } else { self.held.len().saturating_sub(self.stops.hold) };
        while !self.held.is_char_boundary(send) {
            send -= 1;
        }
        let out: String = self.held.drain(..send).collect();
        (out, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text sent for `deltas` (the last one ends the request) and whether a stop was found.
    fn scan(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let (out, stop) = scan_for(stops, deltas);
        (out, stop.is_some())
    }

    /// [`scan`], with the stop string found.
    fn scan_for(stops: &[&str], deltas: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops).unwrap().unwrap().scanner();
        let mut out = String::new();
        for (i, d) in deltas.iter().enumerate() {
            let (sent, stopped) = s.push(d, i + 1 == deltas.len());
            out.push_str(&sent);
            if let Some(stop) = stopped {
                return (out, Some(stop.to_string()));
            }
        }
        (out, None)
    }

    #[test]
    fn a_stop_across_deltas_is_found_and_none_of_it_is_sent() {
        assert_eq!(scan(&["END"], &["hello E", "N", "D and more"]), ("hello ".into(), true));
        assert_eq!(scan(&["lo"], &["hel", "lo"]), ("hel".into(), true));
        assert_eq!(scan(&["xyz"], &["abc", "def"]), ("abcdef".into(), false));
        assert_eq!(scan(&["abcdef"], &["xxabc", "def"]), ("xx".into(), true));
        assert_eq!(scan(&["s\\Y"], &["ark", "s\\", "Yes"]), ("ark".into(), true));
    }

    #[test]
    fn held_text_is_sent_once_it_cannot_start_a_stop() {
        let stops = vec!["STOP".to_string()];
        let mut s = StopStrings::new(&stops).unwrap().unwrap().scanner();
        assert_eq!(s.push("abcdef", false), ("abc".to_string(), None), "the last 3 bytes are held");
        assert_eq!(s.push("gh", false), ("de".to_string(), None));
        assert_eq!(s.push("ST", true), ("fghST".to_string(), None), "the last token flushes");
        // Held text never splits a character.
        let mut s = StopStrings::new(&stops).unwrap().unwrap().scanner();
        assert_eq!(s.push("aé", false), (String::new(), None));
        assert_eq!(s.push("bc", false), ("a".to_string(), None));
    }

    /// The stop string returned is the one cut: the longest ending at the first end (vLLM's
    /// `stop_reason`).
    #[test]
    fn the_stop_found_is_named() {
        assert_eq!(scan_for(&["bc", "abc", "zzzzz"], &["xabcd"]), ("x".into(), Some("abc".into())));
        assert_eq!(scan_for(&["cd", "abcdef"], &["ab", "cdef"]), ("ab".into(), Some("cd".into())));
        assert_eq!(scan_for(&["END", "\n"], &["a\nEND"]), ("a".into(), Some("\n".into())));
    }

    #[test]
    fn the_first_end_wins_and_the_longest_stop_ending_there() {
        assert_eq!(scan(&["bc", "abc", "zzzzz"], &["xabcd"]), ("x".into(), true));
        assert_eq!(scan(&["cd", "abcdef"], &["abcdef"]), ("ab".into(), true));
        assert_eq!(scan(&["é"], &["caf", "é!"]), ("caf".into(), true));
    }
}
