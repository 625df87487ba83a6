//! The `multilora` command: `demo` (the default), `generate` (the offline batch runner), `serve`
//! (the OpenAI-compatible server) and `plan` (capacity arithmetic), a thin shell over the
//! `multilora` engine and `multilora-server`.
//!
//! Errors print one line, `error: ...`, on stderr and exit with status 2 for bad input (1 for
//! anything else); main returns the status itself so no backtrace or debug chain is ever printed.
#![forbid(unsafe_code)]

mod demo;
mod engine_args;
mod generate;
mod jsonl;
mod plan;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Serve one base LLM with many LoRA adapters at once.
#[derive(Debug, Parser)]
#[command(name = "multilora", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build a small model with 8 adapters (once, cached) and serve a mixed workload.
    Demo(demo::DemoArgs),
    /// Run a JSONL file of requests through the engine, all at once; write one result per line.
    Generate(generate::GenerateArgs),
    /// Serve the OpenAI-compatible API (vLLM's flags, endpoints and metrics) until SIGINT/SIGTERM.
    Serve(serve::ServeArgs),
    /// Capacity arithmetic from a model's config.json: weights, adapters, slots, KV cache.
    Plan(PlanCli),
}

/// `plan`'s flags.
#[derive(Debug, Args)]
struct PlanCli {
    /// A model directory or its config.json.
    #[arg(long)]
    model: PathBuf,
    /// Adapter slots on the device.
    #[arg(long, default_value_t = 4)]
    max_loras: u64,
    /// Rank each slot is sized for.
    #[arg(long, default_value_t = 16)]
    max_lora_rank: u64,
    /// Device memory budget in GiB (`80`, `80GiB`).
    #[arg(long, default_value = "80GiB", value_parser = plan::parse_memory)]
    memory: f64,
    /// Value type (default: the config's torch_dtype; 16-bit when it names none).
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    dtype: Option<String>,
    /// Adapter target modules, comma-separated (add embed_tokens / lm_head to count them).
    #[arg(long, value_delimiter = ',', default_values_t = plan::DEFAULT_TARGETS.map(String::from))]
    target_modules: Vec<String>,
}

/// A failure with the exit status it maps to.
#[derive(Debug)]
pub struct Failure {
    /// 2 for bad input, 1 otherwise.
    pub status: u8,
    /// The error, printed with `{:#}` (its causes on one line).
    pub error: anyhow::Error,
}

impl Failure {
    /// Bad input: exit status 2.
    pub fn input(error: anyhow::Error) -> Failure {
        Failure { status: 2, error }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Failure {
        Failure { status: 1, error }
    }
}

fn run_plan(a: PlanCli) -> Result<(), Failure> {
    let config = plan::load_config(&a.model).map_err(Failure::input)?;
    let shapes = plan::Shapes::from_config(&config);
    let args = plan::PlanArgs {
        max_loras: a.max_loras,
        max_lora_rank: a.max_lora_rank,
        memory_bytes: a.memory,
        dtype_bytes: a.dtype.as_deref().and_then(plan::dtype_bytes),
        targets: a.target_modules,
    };
    print!("{}", plan::report(&shapes, &args).map_err(Failure::input)?);
    Ok(())
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => demo::run(demo::DemoArgs::default()),
        Some(Command::Demo(a)) => demo::run(a),
        Some(Command::Generate(a)) => {
            // Its stderr is part of its contract (a progress bar, one line per failure): the
            // engine's log only when asked for with RUST_LOG.
            if std::env::var_os("RUST_LOG").is_some() {
                init_logging();
            }
            generate::run(a)
        }
        Some(Command::Serve(a)) => {
            init_logging();
            serve::run(a)
        }
        Some(Command::Plan(a)) => run_plan(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {:#}", f.error);
            ExitCode::from(f.status)
        }
    }
}
