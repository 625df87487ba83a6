//! Replays the seed experiment: how many steps a workload takes under each `max_loras`.
//!
//! ```text
//! cargo run -p multilora-scheduler --example simulate -- --requests 64 --adapters 8 \
//!     --decode-steps 20 --max-loras 1,2,4,8 [--skew 50,2,2,2,2,2,2,2] [--policy fcfs|aging]
//! ```
//!
//! Requests arrive interleaved over the adapters, each with a one-token prompt and
//! `--decode-steps` new tokens; nothing but `max_loras` limits a step. `--skew` gives the number
//! of requests per adapter instead of an even split.

use std::process::ExitCode;

use multilora_scheduler::{Policy, sim};

const USAGE: &str = "usage: simulate [--requests N] [--adapters N] [--decode-steps N] \
[--max-loras L,L,..] [--skew N,N,..] [--policy fcfs|aging]";

#[derive(Debug)]
struct Options {
    counts: Vec<usize>,
    decode_steps: usize,
    max_loras: Vec<usize>,
    policy: Policy,
}

fn parse_list(flag: &str, value: &str) -> Result<Vec<usize>, String> {
    value
        .split(',')
        .map(|v| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("{flag}: expected a comma-separated list of numbers, got {value:?}"))
        })
        .collect()
}

fn parse_number(flag: &str, value: &str) -> Result<usize, String> {
    value.parse().map_err(|_| format!("{flag}: expected a number, got {value:?}"))
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut requests = None;
    let mut adapters = None;
    let mut decode_steps = 20;
    let mut max_loras = vec![1, 2, 4, 8];
    let mut skew = None;
    let mut policy = Policy::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        let value = it.next().ok_or_else(|| format!("{flag}: missing value ({USAGE})"))?;
        match flag.as_str() {
            "--requests" => requests = Some(parse_number(flag, value)?),
            "--adapters" => adapters = Some(parse_number(flag, value)?),
            "--decode-steps" => decode_steps = parse_number(flag, value)?,
            "--max-loras" => max_loras = parse_list(flag, value)?,
            "--skew" => skew = Some(parse_list(flag, value)?),
            "--policy" => {
                policy = match value.as_str() {
                    "fcfs" => Policy::Fcfs,
                    "aging" => Policy::default(),
                    other => return Err(format!("--policy: expected fcfs or aging, got {other:?}")),
                }
            }
            other => return Err(format!("unknown option {other:?} ({USAGE})")),
        }
    }
    let counts = match skew {
        Some(counts) => {
            if let Some(a) = adapters
                && a != counts.len()
            {
                return Err(format!("--skew lists {} adapters but --adapters is {a}", counts.len()));
            }
            let total: usize = counts.iter().sum();
            if let Some(r) = requests
                && r != total
            {
                return Err(format!("--skew adds up to {total} requests but --requests is {r}"));
            }
            counts
        }
        None => {
            let (requests, adapters) = (requests.unwrap_or(64), adapters.unwrap_or(8));
            if adapters == 0 {
                return Err("--adapters must be at least 1".into());
            }
            (0..adapters).map(|a| requests / adapters + usize::from(a < requests % adapters)).collect()
        }
    };
    if counts.iter().sum::<usize>() == 0 {
        return Err("the workload has no requests".into());
    }
    if decode_steps == 0 {
        return Err("--decode-steps must be at least 1".into());
    }
    if max_loras.contains(&0) {
        return Err("--max-loras: every value must be at least 1 (the requests use adapters)".into());
    }
    Ok(Options { counts, decode_steps, max_loras, policy })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("simulate: {message}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{} requests over {} adapters {:?}, interleaved; 1-token prompts, {} new tokens; policy {}",
        options.counts.iter().sum::<usize>(),
        options.counts.len(),
        options.counts,
        options.decode_steps,
        options.policy.name()
    );
    let mut rows = Vec::new();
    for &max_loras in &options.max_loras {
        match sim::seed_experiment(&options.counts, options.decode_steps, max_loras, options.policy) {
            Ok(report) => rows.push((max_loras, report)),
            Err(e) => {
                eprintln!("simulate: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    print!("{}", sim::format_table(&rows));
    ExitCode::SUCCESS
}
