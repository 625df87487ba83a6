//! `multilora-device-check`: one binary that checks and measures multilora on a GPU, for the
//! brief and rare times a GPU machine is at hand (`scripts/device-check.sh` builds it on a build
//! machine, lays it out with the fixtures and a PEFT script, and runs it there).
//!
//! Sections, each a line per check or figure, then one summary table:
//! - `kernels`: every CUDA kernel against its slow tensor-op reference (Llama-3-8B shapes, 1…4096
//!   tokens, 1…16 adapters of ranks 4…64 in rank-64 slots, base-model rows, f32 / bf16 / f16);
//! - `golden`: the PEFT fixtures through the engine on CUDA, f32 and bf16;
//! - `bandwidth`: the LoRA kernels in a decode step against a device-to-device copy;
//! - `decode`: a Llama-3-8B-shaped bf16 decode step, LoRA / base at batch 1, 16, 64;
//! - `engine`: end-to-end tokens/s, base and 8-adapter mixed, against PEFT on the same GPU;
//! - `gguf`: a random GGUF model with every served quantized type on CUDA (candle's quantized
//!   matmul, this project's LoRA kernels) against its f32 dequantization, and its decode step.
//!
//! Exit status: 0 when every check passed, 1 when one failed, 2 when there is no GPU (or the
//! binary was built without CUDA).

mod engine;
mod gguf;
mod golden;
mod kernels;
mod report;
mod speed;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;

use candle_core::Device;
use clap::Parser;

use crate::report::Report;

/// Checks and measures multilora on the first CUDA device.
#[derive(Debug, Parser)]
#[command(name = "multilora-device-check", version)]
struct Args {
    /// The PEFT fixtures (`tests/fixtures/peft-tiny`).
    #[arg(long)]
    fixtures: PathBuf,
    /// The directory `bench_peft_cuda.py` wrote its model and adapters to.
    #[arg(long)]
    peft_workdir: Option<PathBuf>,
    /// `bench_peft_cuda.py`'s JSON report.
    #[arg(long)]
    peft_json: Option<PathBuf>,
    /// Sections to run, comma-separated (default all): kernels, golden, bandwidth, decode, engine, gguf.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Smaller grids and a 4-layer decode model (a smoke test).
    #[arg(long)]
    quick: bool,
}

fn open_device() -> Result<Device, String> {
    #[cfg(not(feature = "cuda"))]
    {
        Err("this multilora-device-check was built without CUDA support; build it with \
             `scripts/device-check.sh build` (cargo's `--features cuda`)"
            .to_string())
    }
    #[cfg(feature = "cuda")]
    {
        // candle's error may carry a backtrace on further lines; the first says what failed.
        Device::new_cuda_with_stream(0)
            .map_err(|e| format!("no CUDA device: {}", e.to_string().lines().next().unwrap_or_default().trim()))
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let dev = match open_device() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let wants = |s: &str| args.only.is_empty() || args.only.iter().any(|o| o == s);
    let mut report = Report::default();
    match multilora_models::device_memory(&dev) {
        Ok(Some(m)) => report.info("device", "memory", format!("{:.1} GiB, {:.1} GiB free", gib(m.total), gib(m.free))),
        Ok(None) => {}
        Err(e) => report.error("device", &e.into()),
    }
    if wants("kernels") {
        if let Err(e) = kernels::lora(&mut report, &dev, args.quick) {
            report.error("kernels", &e);
        }
        if let Err(e) = kernels::attention(&mut report, &dev, args.quick) {
            report.error("kernels", &e);
        }
    }
    if wants("golden")
        && let Err(e) = golden::check(&mut report, &args.fixtures, &dev)
    {
        report.error("peft fixtures", &e);
    }
    if wants("bandwidth")
        && let Err(e) = speed::bandwidth(&mut report, &dev)
    {
        report.error("bandwidth", &e);
    }
    if wants("decode")
        && let Err(e) = speed::decode(&mut report, &dev, args.quick)
    {
        report.error("decode step", &e);
    }
    if wants("engine") {
        match (&args.peft_workdir, &args.peft_json) {
            (Some(dir), Some(json)) => {
                let peft = std::fs::read_to_string(json)
                    .map_err(anyhow::Error::from)
                    .and_then(|text| Ok(serde_json::from_str::<serde_json::Value>(&text)?));
                if let Err(e) = peft.and_then(|peft| engine::throughput(&mut report, &dev, dir, &peft)) {
                    report.error("engine", &e);
                }
            }
            _ => report.skipped("engine", "no --peft-workdir / --peft-json (bench_peft_cuda.py did not run)"),
        }
    }
    if wants("gguf")
        && let Err(e) = gguf::check(&mut report, &dev)
    {
        report.error("gguf", &e);
    }
    println!("\n== summary\n{}", report.table());
    let failed = report.failures();
    println!("{failed} check(s) failed");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}
