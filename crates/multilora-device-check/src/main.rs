//! `multilora-device-check`: one binary that checks and measures multilora on a GPU, for the
//! brief and rare times a GPU machine is at hand (`scripts/device-check.sh` builds it on a build
//! machine, lays it out with the fixtures and a PEFT script, and runs it there).
//!
//! Sections, each a line per check or figure, then one summary table (`--only` picks some: the
//! script runs each in its own process):
//! - `jit`: loads every module the others launch from (ours from their fatbins, candle's PTX,
//!   which the driver compiles once and caches for the later processes), each timed;
//! - `kernels`: every CUDA kernel against its slow tensor-op reference (Llama-3-8B shapes, 1…4096
//!   tokens, 1…16 adapters of ranks 4…64 in slots of rank 64, and 32, 16, 8, base-model rows,
//!   f32 / bf16 / f16);
//! - `timing`: each kernel of a decode step (shrink, expand, base GEMM, KV write, attention, the
//!   fused RoPE + KV write, add + norm and SiLU · up) by CUDA events over replays of the call
//!   captured into a CUDA graph (the kernel's time) and over back-to-back calls (with the host's
//!   cost), as the kernel's time / floor (bytes at the device's bandwidth: its datasheet figure by
//!   its name, else a timed copy's), beside the host's enqueue time; and the `ncu` command line
//!   for each kernel's DRAM bytes where Nsight Compute is installed;
//! - `golden`: the PEFT fixtures through the engine on CUDA, f32 and bf16;
//! - `decode`: a Llama-3-8B-shaped bf16 decode step, LoRA / base at batch 1, 16, 64, against
//!   its floor;
//! - `gguf`: a random GGUF model with every served quantized type on CUDA (candle's quantized
//!   matmul, this project's LoRA kernels) against its f32 dequantization, and its decode step;
//! - `engine`: end-to-end tokens/s, base and 8-adapter mixed, against PEFT on the same GPU.
//!
//! Exit status: 0 when every check passed; 1 when a correctness check failed or a section could
//! not finish; 2 when there is no GPU (or the binary was built without CUDA); 3 when only a speed
//! target was missed. `--report PREFIX` writes `PREFIX.json` (every line) and `PREFIX.key` (the
//! key figures and every failed line, for the script's summary).

mod bandwidth;
mod clock;
mod decode;
mod engine;
mod floor;
mod gguf;
mod golden;
#[cfg(feature = "cuda")]
mod jit;
mod kernels;
mod llama8b;
mod report;
mod timing;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;

use candle_core::Device;
use clap::Parser;
use clap::builder::PossibleValuesParser;

use crate::report::Report;

/// The sections, in the order they run; `none` only opens the device.
const SECTIONS: [&str; 8] = ["jit", "kernels", "timing", "golden", "decode", "gguf", "engine", "none"];

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
    /// Sections to run, comma-separated (default all; `none` opens the device and stops).
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(SECTIONS))]
    only: Vec<String>,
    /// Writes `PREFIX.json` and `PREFIX.key` at the end.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Smaller grids and a 4-layer decode model (a smoke test).
    #[arg(long)]
    quick: bool,
    /// Writes our modules' fatbins to this folder (`NAME.fatbin`, for the device replay) and
    /// stops, without opening a device.
    #[arg(long)]
    write_fatbins: Option<PathBuf>,
}

/// Writes every module's fatbin as `DIR/NAME.fatbin`: what the device replay loads
/// (`scripts/device-check.sh build` lays them out beside it).
fn write_fatbins(dir: &std::path::Path) -> Result<usize, String> {
    #[cfg(not(feature = "cuda"))]
    {
        Err(format!(
            "this multilora-device-check was built without CUDA support: no fatbins to write to {}",
            dir.display()
        ))
    }
    #[cfg(feature = "cuda")]
    {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let modules = multilora_layers::kernel_fatbins();
        for (name, fatbin) in &modules {
            let path = dir.join(format!("{name}.fatbin"));
            std::fs::write(&path, fatbin).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok(modules.len())
    }
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
        let dev = Device::new_cuda_with_stream(0)
            .map_err(|e| format!("no CUDA device: {}", e.to_string().lines().next().unwrap_or_default().trim()))?;
        // One stream does all the work, as in the engine: no per-allocation events, freed memory
        // kept in the pool.
        multilora_layers::prepare_cuda_device(&dev).map_err(|e| format!("readying the device: {e}"))?;
        Ok(dev)
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(dir) = &args.write_fatbins {
        return match write_fatbins(dir) {
            Ok(n) => {
                println!("wrote {n} fatbins to {}", dir.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        };
    }
    let dev = match open_device() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let wants = |s: &str| args.only.is_empty() || args.only.iter().any(|o| o == s);
    let mut report = Report::default();
    // The floors' bandwidth: the device's datasheet figure by its name, else a timed copy's.
    #[cfg(feature = "cuda")]
    let probed = bandwidth::probe(&dev).map_err(|e| report.info("device", "bandwidth probe", format!("{e:#}"))).ok();
    #[cfg(not(feature = "cuda"))]
    let probed: Option<(String, f64)> = None;
    let bw = bandwidth::choose(probed.as_ref().map(|p| p.0.as_str()), probed.as_ref().map(|p| p.1));
    report.info("device", "bandwidth", format!("{:.2} TB/s for the floors ({})", bw.bytes_per_sec / 1e12, bw.basis));
    bandwidth::set(bw);
    match multilora_models::device_memory(&dev) {
        Ok(Some(m)) => report.info("device", "memory", format!("{:.1} GiB, {:.1} GiB free", gib(m.total), gib(m.free))),
        Ok(None) => {}
        Err(e) => report.error("device", &e.into()),
    }
    #[cfg(feature = "cuda")]
    if wants("jit")
        && let Err(e) = jit::warm(&mut report, &dev)
    {
        report.error("jit", &e);
    }
    if wants("kernels") {
        if let Err(e) = kernels::lora(&mut report, &dev, args.quick) {
            report.error("kernels", &e);
        }
        if let Err(e) = kernels::attention(&mut report, &dev, args.quick) {
            report.error("kernels", &e);
        }
        if let Err(e) = kernels::fused(&mut report, &dev, args.quick) {
            report.error("kernels", &e);
        }
    }
    if wants("timing")
        && let Err(e) = timing::run(&mut report, &dev)
    {
        report.error("timing", &e);
    }
    if wants("golden")
        && let Err(e) = golden::check(&mut report, &args.fixtures, &dev)
    {
        report.error("golden", &e);
    }
    if wants("decode")
        && let Err(e) = decode::decode(&mut report, &dev, args.quick)
    {
        report.error("decode", &e);
    }
    if wants("gguf")
        && let Err(e) = gguf::check(&mut report, &dev)
    {
        report.error("gguf", &e);
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
            _ => {
                report.skipped("engine", "no --peft-workdir / --peft-json (bench_peft_cuda.py did not run)");
                report.key("engine", "skipped: no PEFT figures (bench_peft_cuda.py did not run)");
            }
        }
    }
    println!("\n== summary\n{}", report.table());
    println!("{}", report.totals());
    if let Some(prefix) = &args.report
        && let Err(e) = report.write(prefix)
    {
        eprintln!("error: {e:#}");
        return ExitCode::from(1);
    }
    ExitCode::from(report.exit_code())
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}
