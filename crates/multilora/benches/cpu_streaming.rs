//! Streams that keep arriving: 16 clients over 8 adapters on the PEFT comparison model (hidden
//! 1024, 8 layers, f32), each streaming a 64-token prompt to 32 greedy new tokens and starting the
//! next one as soon as its last finished, for `--seconds` (default 30) per run. Two engines, the
//! step-time budget off (the token budget only: arriving prompts are prefilled in one step, as
//! before) and `auto` (the default), in alternating runs (`--rounds`, default 2), so a slow spell
//! of the machine falls on both. Prints, per setting, the gaps between consecutive tokens of a
//! stream (p50, p99, max, max / p50), time to first token (p50, p99) and new tokens/s, from the
//! clients' own clocks.
//!
//! `cargo bench -p multilora --bench cpu_streaming -- --seconds 30 --rounds 2`

use std::path::Path;
use std::time::{Duration, Instant};

use common::{ADAPTERS, write_model};
use multilora::{DEFAULT_STEP_FACTOR, Engine, Event, GenerateRequest, SamplingParams, StepTime};

mod common;

const CLIENTS: usize = 16;
const PROMPT: usize = 64;
const NEW: usize = 32;

fn engine(dir: &Path, step_time: StepTime) -> anyhow::Result<Engine> {
    let mut b = Engine::builder(dir.display().to_string())
        .served_model_name("base")
        .max_loras(ADAPTERS)
        .kv_cache_bytes(512 << 20)
        .enable_prefix_caching(false)
        .step_time(step_time);
    for a in 0..ADAPTERS {
        b = b.lora(format!("lora{a}"), dir.join(format!("lora{a}")).display().to_string());
    }
    Ok(b.build()?)
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Seen {
    gaps: Vec<Duration>,
    ttft: Vec<Duration>,
    tokens: usize,
    elapsed: Duration,
}

/// One client: prompt after prompt until `deadline` (the prompt in flight then is finished).
fn client(engine: &Engine, id: usize, deadline: Instant) -> Seen {
    let mut seen = Seen::default();
    let mut p = SamplingParams::greedy(NEW);
    p.ignore_eos = true;
    let p = p.validate(engine.config().vocab_size).expect("valid parameters");
    let mut n = 0;
    while Instant::now() < deadline {
        let prompt: Vec<u32> = (0..PROMPT).map(|k| ((id * 7919 + n * 131 + k * 17) % 31990 + 3) as u32).collect();
        let model = format!("lora{}", (id + n) % ADAPTERS);
        n += 1;
        let start = Instant::now();
        let mut stream = engine.submit(GenerateRequest::new(model, prompt).params(p.clone())).expect("submit");
        let mut last: Option<Instant> = None;
        while let Some(ev) = stream.recv_blocking() {
            match ev {
                Event::Token { .. } => {
                    let now = Instant::now();
                    match last {
                        None => seen.ttft.push(now - start),
                        Some(prev) => seen.gaps.push(now - prev),
                    }
                    last = Some(now);
                    seen.tokens += 1;
                }
                Event::Finished { .. } => break,
                Event::Error(e) => panic!("request failed: {e}"),
                _ => {}
            }
        }
    }
    seen
}

/// Every client for `seconds`.
fn run(engine: &Engine, seconds: u64) -> Seen {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(seconds);
    let parts: Vec<Seen> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS).map(|id| s.spawn(move || client(engine, id, deadline))).collect();
        handles.into_iter().map(|h| h.join().expect("client")).collect()
    });
    let mut all = Seen { elapsed: start.elapsed(), ..Seen::default() };
    for p in parts {
        all.gaps.extend(p.gaps);
        all.ttft.extend(p.ttft);
        all.tokens += p.tokens;
    }
    all
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let (seconds, rounds) = (arg("--seconds", 30), arg("--rounds", 2));
    let tmp = tempfile::tempdir()?;
    write_model(tmp.path())?;
    let settings = [
        ("off (token budget only)", StepTime::Unbounded),
        ("auto (default)", StepTime::Auto { factor: DEFAULT_STEP_FACTOR }),
    ];
    let engines = settings.iter().map(|(_, t)| engine(tmp.path(), *t)).collect::<Result<Vec<_>, _>>()?;
    let mut seen: Vec<Seen> = settings.iter().map(|_| Seen::default()).collect();
    for _ in 0..rounds {
        for (engine, total) in engines.iter().zip(&mut seen) {
            let s = run(engine, seconds);
            total.gaps.extend(s.gaps);
            total.ttft.extend(s.ttft);
            total.tokens += s.tokens;
            total.elapsed += s.elapsed;
        }
    }
    println!(
        "\n{CLIENTS} streaming clients over {ADAPTERS} adapters, {PROMPT}-token prompts, {NEW} new tokens, \
         {rounds} x {seconds} s per setting (alternating):"
    );
    println!(
        "  {:<26} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "step-time budget", "gap p50", "gap p99", "gap max", "max/p50", "TTFT p50", "TTFT p99", "tok/s"
    );
    for ((name, _), s) in settings.iter().zip(&mut seen) {
        let (p50, p99, max) = (pct(&mut s.gaps, 0.5), pct(&mut s.gaps, 0.99), pct(&mut s.gaps, 1.0));
        let (t50, t99) = (pct(&mut s.ttft, 0.5), pct(&mut s.ttft, 0.99));
        let tps = s.tokens as f64 / s.elapsed.as_secs_f64();
        println!(
            "  {name:<26} {p50:6.1}ms {p99:6.1}ms {max:6.1}ms {:8.1}x {t50:7.1}ms {t99:7.1}ms {tps:9.1}",
            max / p50
        );
    }
    for (engine, (name, _)) in engines.iter().zip(&settings) {
        let m = engine.metrics();
        println!(
            "  {name:<26} {} steps, mean step {:.1} ms, mean prefill tokens per prefilling step {:.0}",
            m.steps,
            1e3 * m.step_duration.mean(),
            m.prefill_tokens_per_step.mean()
        );
    }
    Ok(())
}
