//! Shared test helpers: a trace runner that prints one line of decisions per step, and `check`.
#![allow(dead_code, unreachable_pub)]

use std::fmt::Write as _;

use multilora_scheduler::{Request, RequestId, RequestResult, Scheduler, SchedulerConfig, StepCost, sim::adapter_gen};
use multilora_types::{AdapterGen, LogitsWanted};

/// Adapter `a` of the tests (same keys as the simulator's).
pub fn lora(a: usize) -> AdapterGen {
    adapter_gen(a)
}

/// The token the fake engine samples at `step`.
pub fn sampled(step: u64) -> u32 {
    1000 + step as u32
}

/// A step-by-step trace: requests arrive before given steps; an ideal engine samples
/// `sampled(step)`; each step prints what was scheduled and every other decision.
#[derive(Debug)]
pub struct Trace {
    pub sched: Scheduler,
    arrivals: Vec<(u64, Request)>,
    aborts: Vec<(u64, RequestId)>,
    show_blocks: bool,
    cost: Option<StepCost>,
}

impl Trace {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            sched: Scheduler::new(config).expect("valid config"),
            arrivals: Vec::new(),
            aborts: Vec::new(),
            show_blocks: false,
            cost: None,
        }
    }

    /// `request` arrives just before step `step` (1-based) is scheduled.
    pub fn arrive(mut self, step: u64, request: Request) -> Self {
        self.arrivals.push((step, request));
        self
    }

    /// `id` is aborted just before step `step` is scheduled.
    pub fn abort(mut self, step: u64, id: RequestId) -> Self {
        self.aborts.push((step, id));
        self
    }

    /// Schedules every step with `cost` ([`Scheduler::schedule_with_cost`]); each line then ends
    /// with the step's modelled time in ms (and its prefill budget when one applied).
    pub fn cost(mut self, cost: StepCost) -> Self {
        self.cost = Some(cost);
        self
    }

    pub fn show_blocks(mut self) -> Self {
        self.show_blocks = true;
        self
    }

    /// Runs until every request finished and no arrival is left, or `max_steps`.
    pub fn run(mut self, max_steps: u64) -> String {
        let mut s = String::new();
        let last_arrival = self.arrivals.iter().map(|a| a.0).max().unwrap_or(0);
        for step in 1..=max_steps {
            for (_, r) in self.arrivals.iter().filter(|a| a.0 == step) {
                self.sched.add_request(r.clone()).expect("valid request");
            }
            for &(_, id) in self.aborts.iter().filter(|a| a.0 == step) {
                let f = self.sched.abort(id).expect("live request");
                let _ = writeln!(s, "abort {id}: {} outputs", f.output_token_ids.len());
            }
            if step > last_arrival && !self.sched.has_unfinished() {
                break;
            }
            let out = match &self.cost {
                Some(cost) => self.sched.schedule_with_cost(cost),
                None => self.sched.schedule(),
            };
            let mut line = format!("{step:>2}:");
            let mut results = Vec::new();
            for r in &out.scheduled {
                let adapter = r.adapter.map(|g| format!("a{}", g.id)).unwrap_or_default();
                let logits = match r.logits {
                    LogitsWanted::None => "-",
                    LogitsWanted::Last => "L",
                    LogitsWanted::AllPrompt => "A",
                };
                let end = r.num_computed_tokens + r.token_ids.len();
                let _ = write!(line, " {}{adapter}[{}..{end}]{logits}", r.id, r.num_computed_tokens);
                if self.show_blocks {
                    let _ = write!(line, "{:?}", r.block_table);
                }
                if r.sample {
                    results.push(RequestResult::token(r.id, sampled(step)));
                }
            }
            if out.scheduled.is_empty() {
                line.push_str(" idle");
            }
            let list = |name: &str, ids: &[RequestId], line: &mut String| {
                if !ids.is_empty() {
                    let _ = write!(line, " | {name} {ids:?}");
                }
            };
            list("preempted", &out.preempted, &mut line);
            list("skipped", &out.skipped_for_adapter_limit, &mut line);
            list("no-blocks", &out.waiting_for_blocks, &mut line);
            if let Some(cost) = &self.cost {
                let rows = out.scheduled.iter().filter(|r| r.token_ids.len() == 1).count();
                let prefill: usize = out.scheduled.iter().map(|r| r.token_ids.len()).filter(|&n| n > 1).sum();
                let _ = write!(line, " | {:.0} ms", 1e3 * cost.step_s(rows, prefill));
                if let Some(p) = out.prefill_budget {
                    let _ = write!(line, " (prefill budget {p})");
                }
            }
            let finished = self.sched.update(&results).expect("update");
            for f in finished {
                let _ = write!(line, " | done {} {}({})", f.id, f.reason.as_str(), f.output_token_ids.len());
            }
            let _ = writeln!(s, "{}", line.trim_end());
        }
        s
    }
}

/// Compares `actual` with an indented `expected` block, line by line, ignoring indentation and
/// blank lines; prints `actual` on mismatch so it can be pasted.
pub fn check(actual: &str, expected: &str) {
    let norm =
        |s: &str| -> Vec<String> { s.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect() };
    let (actual, expected) = (norm(actual), norm(expected));
    if actual != expected {
        panic!("trace mismatch\n--- expected\n{}\n--- actual\n{}", expected.join("\n"), actual.join("\n"));
    }
}
