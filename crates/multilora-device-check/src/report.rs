//! The summary every section adds to: one line per check or figure, printed as it is made (so a
//! run cut short still shows how far it got) and again as one table at the end.

use std::fmt::Write as _;

/// How a line counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A check that met its target.
    Pass,
    /// A check that missed it (the binary then exits 1).
    Fail,
    /// A figure with no pass/fail (reported as measured).
    Info,
}

#[derive(Debug)]
struct Line {
    section: String,
    name: String,
    value: String,
    target: String,
    verdict: Verdict,
}

/// The lines so far.
#[derive(Debug, Default)]
pub(crate) struct Report {
    lines: Vec<Line>,
}

impl Report {
    fn push(&mut self, section: &str, name: String, value: String, target: String, verdict: Verdict) {
        let tag = match verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Info => "    ",
        };
        println!(
            "[{tag}] {section}: {name} = {value}{}",
            if target.is_empty() { String::new() } else { format!("  (target {target})") }
        );
        self.lines.push(Line { section: section.to_string(), name, value, target, verdict });
    }

    /// A check: `ok` decides the verdict.
    pub(crate) fn check(&mut self, section: &str, name: impl Into<String>, value: String, target: &str, ok: bool) {
        let verdict = if ok { Verdict::Pass } else { Verdict::Fail };
        self.push(section, name.into(), value, target.to_string(), verdict);
    }

    /// A measured figure.
    pub(crate) fn info(&mut self, section: &str, name: impl Into<String>, value: String) {
        self.push(section, name.into(), value, String::new(), Verdict::Info);
    }

    /// A section that could not run, with why.
    pub(crate) fn error(&mut self, section: &str, e: &anyhow::Error) {
        self.push(section, "error".to_string(), format!("{e:#}"), String::new(), Verdict::Fail);
    }

    /// A section that was not asked for or lacked its inputs.
    pub(crate) fn skipped(&mut self, section: &str, why: &str) {
        self.push(section, "skipped".to_string(), why.to_string(), String::new(), Verdict::Info);
    }

    pub(crate) fn failures(&self) -> usize {
        self.lines.iter().filter(|l| l.verdict == Verdict::Fail).count()
    }

    /// The table of every line.
    pub(crate) fn table(&self) -> String {
        let w = |f: fn(&Line) -> usize| self.lines.iter().map(f).max().unwrap_or(0);
        let (ws, wn, wv) = (w(|l| l.section.len()), w(|l| l.name.len()), w(|l| l.value.len().min(60)));
        let mut out = String::new();
        for l in &self.lines {
            let tag = match l.verdict {
                Verdict::Pass => "pass",
                Verdict::Fail => "FAIL",
                Verdict::Info => "",
            };
            let _ = writeln!(out, "{tag:4}  {:ws$}  {:wn$}  {:wv$}  {}", l.section, l.name, l.value, l.target);
        }
        out
    }
}
