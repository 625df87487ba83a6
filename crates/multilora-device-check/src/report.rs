//! The summary every section adds to: one line per check or figure, printed as it is made (so a
//! run cut short still shows how far it got) and again as one table at the end; a few key
//! figures per section for `scripts/device-check.sh`'s one-screen summary; and all of it as JSON.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::clock::{Replay, Timed};
use crate::floor::floor_secs;

/// How a line counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A check that met its target.
    Pass,
    /// A correctness check that missed, or a section that could not finish (exit 1).
    Fail,
    /// A speed target missed (exit 3 when nothing failed).
    Slow,
    /// A figure with no pass/fail (reported as measured).
    Info,
}

impl Verdict {
    fn tag(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "FAIL",
            Verdict::Slow => "SLOW",
            Verdict::Info => "",
        }
    }
}

#[derive(Debug)]
struct Line {
    section: String,
    name: String,
    value: String,
    target: String,
    verdict: Verdict,
    /// Machine-readable figures (the timed lines' seconds and bytes).
    figures: Option<Value>,
}

/// The lines so far, and the key figures.
#[derive(Debug, Default)]
pub(crate) struct Report {
    lines: Vec<Line>,
    keys: Vec<(String, String)>,
}

/// `s` seconds with a unit that keeps three figures.
pub(crate) fn secs(s: f64) -> String {
    match s {
        s if s < 1e-3 => format!("{:.1} µs", s * 1e6),
        s if s < 1.0 => format!("{:.2} ms", s * 1e3),
        s => format!("{s:.2} s"),
    }
}

impl Report {
    fn push(&mut self, section: &str, name: String, value: String, target: String, verdict: Verdict) {
        println!(
            "[{:4}] {section}: {name} = {value}{}",
            verdict.tag(),
            if target.is_empty() { String::new() } else { format!("  (target {target})") }
        );
        self.lines.push(Line { section: section.to_string(), name, value, target, verdict, figures: None });
    }

    /// A correctness check: `ok` decides between pass and fail.
    pub(crate) fn check(&mut self, section: &str, name: impl Into<String>, value: String, target: &str, ok: bool) {
        let verdict = if ok { Verdict::Pass } else { Verdict::Fail };
        self.push(section, name.into(), value, target.to_string(), verdict);
    }

    /// A speed target: `ok` decides between pass and slow.
    pub(crate) fn target(&mut self, section: &str, name: impl Into<String>, value: String, target: &str, ok: bool) {
        let verdict = if ok { Verdict::Pass } else { Verdict::Slow };
        self.push(section, name.into(), value, target.to_string(), verdict);
    }

    /// A measured figure.
    pub(crate) fn info(&mut self, section: &str, name: impl Into<String>, value: String) {
        self.push(section, name.into(), value, String::new(), Verdict::Info);
    }

    /// A timed operation that must move `bytes`: the kernels' device time against its floor (its
    /// bytes at the device's bandwidth), the graph replays' where they were measured, beside the
    /// candle calls' device time and the host's enqueue time per call. Returns the line's value,
    /// for a key figure.
    pub(crate) fn timed(&mut self, section: &str, name: impl Into<String>, t: &Timed, bytes: u64) -> String {
        let floor = floor_secs(bytes);
        let kernel = t.kernel();
        let head = format!("{} / {} floor ({:.1}×)", secs(kernel), secs(floor), kernel / floor);
        let calls = format!("host {} per call", secs(t.host));
        let value = match &t.replay {
            Replay::Device(_) => format!("{head} in graph replays; candle calls {}, {calls}", secs(t.device)),
            Replay::Failed(why) => format!("{head}, {calls}; no graph replay: {why}"),
            Replay::NotAsked => format!("{head}, {calls}"),
        };
        self.push(section, name.into(), value.clone(), String::new(), Verdict::Info);
        if let Some(line) = self.lines.last_mut() {
            let (replay, replay_error) = match &t.replay {
                Replay::Device(s) => (json!(s), Value::Null),
                Replay::Failed(why) => (Value::Null, json!(why)),
                Replay::NotAsked => (Value::Null, Value::Null),
            };
            line.figures = Some(json!({
                "device_s": t.device, "host_s": t.host, "replay_s": replay, "replay_error": replay_error,
                "floor_s": floor, "bytes": bytes,
            }));
        }
        value
    }

    /// A key figure of `section`, for the one-screen summary.
    pub(crate) fn key(&mut self, section: &str, text: impl Into<String>) {
        self.keys.push((section.to_string(), text.into()));
    }

    /// A section that could not run, with why.
    pub(crate) fn error(&mut self, section: &str, e: &anyhow::Error) {
        self.push(section, "error".to_string(), format!("{e:#}"), String::new(), Verdict::Fail);
    }

    /// A section that was not asked for or lacked its inputs.
    pub(crate) fn skipped(&mut self, section: &str, why: &str) {
        self.push(section, "skipped".to_string(), why.to_string(), String::new(), Verdict::Info);
    }

    fn count(&self, v: Verdict) -> usize {
        self.lines.iter().filter(|l| l.verdict == v).count()
    }

    /// The exit status: 1 when a check failed or a section could not finish, else 3 when a
    /// speed target was missed, else 0.
    pub(crate) fn exit_code(&self) -> u8 {
        if self.count(Verdict::Fail) > 0 {
            1
        } else if self.count(Verdict::Slow) > 0 {
            3
        } else {
            0
        }
    }

    /// One line of counts.
    pub(crate) fn totals(&self) -> String {
        format!(
            "{} passed, {} failed, {} slow",
            self.count(Verdict::Pass),
            self.count(Verdict::Fail),
            self.count(Verdict::Slow)
        )
    }

    /// The table of every line.
    pub(crate) fn table(&self) -> String {
        let w = |f: fn(&Line) -> usize| self.lines.iter().map(f).max().unwrap_or(0);
        let (ws, wn, wv) = (w(|l| l.section.len()), w(|l| l.name.len()), w(|l| l.value.len().min(60)));
        let mut out = String::new();
        for l in &self.lines {
            let tag = l.verdict.tag();
            let _ = writeln!(out, "{tag:4}  {:ws$}  {:wn$}  {:wv$}  {}", l.section, l.name, l.value, l.target);
        }
        out
    }

    /// The key figures, then every failed or slow line (`verdict name = value`), one a line.
    fn key_lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self.keys.iter().map(|(_, k)| k.clone()).collect();
        for l in self.lines.iter().filter(|l| matches!(l.verdict, Verdict::Fail | Verdict::Slow)) {
            let text = format!("{} {} = {}", l.verdict.tag(), l.name, l.value);
            // One screen: the first line of the message, cut to a row's width.
            let first = text.lines().next().unwrap_or_default();
            out.push(first.chars().take(110).collect());
        }
        out
    }

    /// Everything as JSON.
    pub(crate) fn to_json(&self) -> Value {
        let lines: Vec<Value> = self
            .lines
            .iter()
            .map(|l| {
                json!({
                    "section": l.section, "name": l.name, "value": l.value, "target": l.target,
                    "verdict": match l.verdict {
                        Verdict::Pass => "pass",
                        Verdict::Fail => "fail",
                        Verdict::Slow => "slow",
                        Verdict::Info => "info",
                    },
                    "figures": l.figures,
                })
            })
            .collect();
        json!({ "exit": self.exit_code(), "totals": self.totals(), "key": self.key_lines(), "lines": lines })
    }

    /// `PREFIX.json` (everything) and `PREFIX.key` (the key figures, one a line).
    pub(crate) fn write(&self, prefix: &Path) -> Result<()> {
        let with = |ext: &str| {
            let mut p = prefix.as_os_str().to_owned();
            p.push(ext);
            std::path::PathBuf::from(p)
        };
        // Each file whole or not at all (a process killed while writing leaves no half file):
        // written beside, then renamed.
        let put = |ext: &str, text: String| -> Result<()> {
            let (path, tmp) = (with(ext), with(&format!("{ext}.tmp")));
            std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
        };
        put(".json", serde_json::to_string_pretty(&self.to_json())? + "\n")?;
        let mut keys = self.key_lines().join("\n");
        keys.push('\n');
        put(".key", keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_code_and_key_lines() {
        let mut r = Report::default();
        r.check("kernels", "a", "1e-6".into(), "≤ 1e-5", true);
        r.key("kernels", "worst 1e-6");
        assert_eq!(r.exit_code(), 0);
        r.target("decode", "lora/base", "1.2".into(), "≤ 1.10", false);
        assert_eq!(r.exit_code(), 3);
        r.error("golden", &anyhow::anyhow!("CUDA_ERROR_ILLEGAL_ADDRESS\nbacktrace"));
        assert_eq!(r.exit_code(), 1);
        assert_eq!(r.key_lines(), ["worst 1e-6", "SLOW lora/base = 1.2", "FAIL error = CUDA_ERROR_ILLEGAL_ADDRESS"]);
        let j = r.to_json();
        assert_eq!(j["exit"], 1);
        assert_eq!(j["lines"].as_array().map(Vec::len), Some(3));
        assert_eq!(j["lines"][1]["verdict"], "slow");
    }

    #[test]
    fn timed_lines_carry_their_figures() {
        let mut r = Report::default();
        let calls = |replay| Timed { device: 8e-6, host: 5e-6, replay };
        let v = r.timed("timing", "kv write", &calls(Replay::NotAsked), 4_800_000);
        assert_eq!(v, "8.0 µs / 1.0 µs floor (8.0×), host 5.0 µs per call");
        // Measured replays are the kernel's figure; the calls' stay beside them.
        let v = r.timed("timing", "kv write", &calls(Replay::Device(2e-6)), 4_800_000);
        assert_eq!(v, "2.0 µs / 1.0 µs floor (2.0×) in graph replays; candle calls 8.0 µs, host 5.0 µs per call");
        let v = r.timed("timing", "kv write", &calls(Replay::Failed("capture invalidated".into())), 4_800_000);
        assert_eq!(v, "8.0 µs / 1.0 µs floor (8.0×), host 5.0 µs per call; no graph replay: capture invalidated");
        let j = r.to_json();
        assert_eq!(j["lines"][0]["figures"]["bytes"], 4_800_000);
        assert_eq!(j["lines"][0]["figures"]["replay_s"], Value::Null);
        assert_eq!(j["lines"][1]["figures"]["replay_s"], 2e-6);
        assert_eq!(j["lines"][2]["figures"]["replay_error"], "capture invalidated");
        assert_eq!(secs(0.0123), "12.30 ms");
        assert_eq!(secs(3.0), "3.00 s");
    }
}
