//! Host emulation of the kernels: the same `.cu` sources, compiled by the host C++ compiler
//! against `emulate/emu.h` (CUDA's threads as fibers, barriers, warp collectives and 16-bit
//! types), run on the CPU over host buffers. Tests use it to check each kernel, with the host
//! plan's real parameters, against the CPU ops on machines that have no GPU; on a GPU the same
//! kernels run for real and the device check compares them again.
//!
//! The emulation is strict, to catch what a GPU would get wrong silently. Every launch runs under
//! several deterministic schedules from the same input (blocks in order, then in a seeded
//! shuffle with several blocks live and interleaved at `__syncthreads`, threads forwards and
//! backwards) and the results must agree byte for byte, or the launch fails with a
//! [`FaultKind::Race`]; every access through a pointer field is checked against the
//! [`Memory`] view the pointer came from ([`FaultKind::OutOfBounds`]); every warp collective's
//! mask must name exactly the lanes that are active and call it ([`FaultKind::WarpSync`]); and
//! launches past CUDA's limits fail ([`FaultKind::Launch`]). `MULTILORA_EMU_SCHEDULES` sets the
//! number of schedules (default 2; more for a thorough run, 1 for none of the race check), and
//! `MULTILORA_EMU_SEED` the shuffle's seed (by default a hash of the launch, printed in a report).
//!
//! The harness is built once per process (and cached in the temp directory under a hash of the
//! sources) with `$CXX` or `c++`. A launch is written to a file (`MLEMU2`: kernel name, grid,
//! block, parameter bytes, buffers, views, seed, schedules), the harness runs it and writes the
//! buffers back. Pointer fields of the parameters name views through [`Memory`].
//!
//! With `MULTILORA_EMU_RECORD=DIR` the launches that ran are kept there with their results (a
//! few per kernel), for the device replay (`emulate/replay.cpp`): on a GPU machine, it runs them
//! from the shipped fatbins with nothing but the driver and compares every buffer with what the
//! emulator left (`scripts/device-check.sh` lays the corpus out).

mod memory;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub use memory::Memory;

/// What can go wrong building or running the emulator, or reading a fatbin.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A fatbin's bytes are not laid out as nvcc writes them.
    #[error("not a CUDA fatbin nvcc wrote: {0}")]
    Fatbin(String),
    /// No host C++ compiler could be run.
    #[error("no host C++ compiler `{compiler}` to emulate the CUDA kernels with: {source}")]
    NoCompiler {
        /// The compiler tried (`$CXX` or `c++`).
        compiler: String,
        /// Why it could not be run.
        #[source]
        source: std::io::Error,
    },
    /// The kernels did not compile for the host.
    #[error("the kernels do not compile for the host emulator with `{compiler}`:\n{stderr}")]
    Compile {
        /// The compiler.
        compiler: String,
        /// Its messages.
        stderr: String,
    },
    /// Reading or writing the emulator's files failed.
    #[error("emulator file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The harness rejected the launch or failed while running it.
    #[error("emulated {kernel} failed: {reason}")]
    Run {
        /// The kernel.
        kernel: String,
        /// The harness's message, or how it ended.
        reason: String,
    },
    /// The emulator caught the kernel doing something the device would do silently wrong.
    #[error("emulated {kernel}: {kind}: {detail}")]
    Fault {
        /// The kernel.
        kernel: String,
        /// What kind of fault.
        kind: FaultKind,
        /// The harness's report: where (block, thread, view, field, offset) and why.
        detail: String,
    },
    /// A view asked of a [`Memory`] lies outside its buffer, or a pointer names no view.
    #[error("emulator memory: {reason}")]
    View {
        /// What was asked.
        reason: String,
    },
}

/// What the strict emulation caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultKind {
    /// Two schedules of one launch gave different results: blocks, or threads of a block, read
    /// or write what another writes without ordering.
    Race,
    /// An access outside the view its pointer came from.
    OutOfBounds,
    /// A warp collective whose mask is not the set of lanes that are active and call it.
    WarpSync,
    /// A grid or block past CUDA's launch limits.
    Launch,
}

impl FaultKind {
    /// The name the harness reports the fault under.
    fn from_report(s: &str) -> Option<FaultKind> {
        Some(match s {
            "race" => FaultKind::Race,
            "out of bounds" => FaultKind::OutOfBounds,
            "warp sync" => FaultKind::WarpSync,
            "launch" => FaultKind::Launch,
            _ => return None,
        })
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FaultKind::Race => "race",
            FaultKind::OutOfBounds => "out of bounds",
            FaultKind::WarpSync => "warp sync",
            FaultKind::Launch => "launch",
        })
    }
}

/// The emulator's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// The sources the harness is built from, as `(path under src/, text)`.
const SOURCES: &[(&str, &str)] = &[
    ("params.h", include_str!("params.h")),
    ("multilora.cuh", include_str!("multilora.cuh")),
    ("lora_shrink.cu", include_str!("lora_shrink.cu")),
    ("lora_expand.cu", include_str!("lora_expand.cu")),
    ("lora_embed.cu", include_str!("lora_embed.cu")),
    ("paged_attention.cu", include_str!("paged_attention.cu")),
    ("vec.cuh", include_str!("vec.cuh")),
    ("kv_write.cu", include_str!("kv_write.cu")),
    ("lora_bgmv.cu", include_str!("lora_bgmv.cu")),
    ("paged_decode_split.cu", include_str!("paged_decode_split.cu")),
    ("fused.cu", include_str!("fused.cu")),
    ("emulate/emu.h", include_str!("emulate/emu.h")),
    ("emulate/views.h", include_str!("emulate/views.h")),
    ("emulate/faults.cuh", include_str!("emulate/faults.cuh")),
    ("emulate/kernels.h", include_str!("emulate/kernels.h")),
    ("emulate/fix_ptrs.h", include_str!("emulate/fix_ptrs.h")),
    ("emulate/harness.cpp", include_str!("emulate/harness.cpp")),
];

/// Schedules each launch runs under when `MULTILORA_EMU_SCHEDULES` is not set.
const DEFAULT_SCHEDULES: u32 = 2;

/// The built harness.
#[derive(Debug)]
pub struct Emulator {
    exe: PathBuf,
    /// Whether its launches may be recorded for the device replay (not the planted faults').
    records: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// FNV-1a over the sources and the compiler's name: the cache key of a built harness.
fn sources_hash(compiler: &str) -> u64 {
    let parts: Vec<&[u8]> =
        SOURCES.iter().flat_map(|(p, s)| [p.as_bytes(), s.as_bytes()]).chain([compiler.as_bytes()]).collect();
    fnv(&parts)
}

/// The harness's name and extra compiler flags: the kernels alone, or with the planted faults.
#[derive(Clone, Copy)]
struct Flavor {
    name: &'static str,
    defines: &'static [&'static str],
}

const KERNELS: Flavor = Flavor { name: "harness", defines: &[] };
const WITH_FAULTS: Flavor = Flavor { name: "harness-faults", defines: &["-DMULTILORA_EMULATE_FAULTS"] };

fn cached(cell: &'static OnceLock<std::result::Result<Emulator, String>>, flavor: Flavor) -> Result<&'static Emulator> {
    match cell.get_or_init(|| Emulator::build(flavor).map_err(|e| e.to_string())) {
        Ok(e) => Ok(e),
        // The first failure is kept as text (errors are not `Clone`); say it again.
        Err(reason) => Err(Error::Run { kernel: flavor.name.to_string(), reason: reason.clone() }),
    }
}

impl Emulator {
    /// The process's emulator, built on first use.
    pub fn get() -> Result<&'static Emulator> {
        static EMULATOR: OnceLock<std::result::Result<Emulator, String>> = OnceLock::new();
        cached(&EMULATOR, KERNELS)
    }

    /// The emulator with the kernels of `emulate/faults.cuh` beside the real ones (`ml_fault_race`,
    /// `ml_fault_read_past_end`, `ml_fault_mask_exited`, …), each with one planted fault, for
    /// the emulator's own tests; built on first use, apart from [`Emulator::get`]'s.
    pub fn with_planted_faults() -> Result<&'static Emulator> {
        static EMULATOR: OnceLock<std::result::Result<Emulator, String>> = OnceLock::new();
        cached(&EMULATOR, WITH_FAULTS)
    }

    /// For tests: the process's emulator, or `None` after printing why it is unavailable (a
    /// test that needs it then says it was skipped). With `MULTILORA_REQUIRE_EMULATION=1`, which
    /// CI sets, an unavailable emulator panics instead.
    pub fn for_tests() -> Option<&'static Emulator> {
        Emulator::or_skip(Emulator::get())
    }

    /// [`Emulator::for_tests`] for [`Emulator::with_planted_faults`].
    pub fn with_planted_faults_for_tests() -> Option<&'static Emulator> {
        Emulator::or_skip(Emulator::with_planted_faults())
    }

    fn or_skip(e: Result<&'static Emulator>) -> Option<&'static Emulator> {
        match e {
            Ok(e) => Some(e),
            Err(e) if std::env::var("MULTILORA_REQUIRE_EMULATION").as_deref() == Ok("1") => {
                panic!("MULTILORA_REQUIRE_EMULATION=1 but the CUDA kernel emulation is unavailable: {e}")
            }
            Err(e) => {
                println!("SKIPPED: CUDA kernel emulation unavailable: {e}");
                None
            }
        }
    }

    fn build(flavor: Flavor) -> Result<Emulator> {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let dir = std::env::temp_dir().join(format!("multilora-emulator-{:016x}", sources_hash(&compiler)));
        let exe = dir.join(flavor.name);
        let records = flavor.defines.is_empty();
        if exe.is_file() {
            return Ok(Emulator { exe, records });
        }
        std::fs::create_dir_all(dir.join("src/emulate")).map_err(io(&dir))?;
        for (path, text) in SOURCES {
            let p = dir.join("src").join(path);
            std::fs::write(&p, text).map_err(io(&p))?;
        }
        // Built under a name of this process's own, then renamed: concurrent test processes
        // never see a half-written harness.
        let tmp = dir.join(format!("{}.{}", flavor.name, std::process::id()));
        let out = Command::new(&compiler)
            .args(["-std=c++20", "-O2", "-pthread", "-DMULTILORA_EMULATE", "-Wno-unknown-pragmas"])
            .args(flavor.defines)
            .arg("-o")
            .arg(&tmp)
            .arg(dir.join("src/emulate/harness.cpp"))
            .output()
            .map_err(|source| Error::NoCompiler { compiler: compiler.clone(), source })?;
        if !out.status.success() {
            return Err(Error::Compile { compiler, stderr: String::from_utf8_lossy(&out.stderr).into_owned() });
        }
        std::fs::rename(&tmp, &exe).map_err(io(&exe))?;
        Ok(Emulator { exe, records })
    }

    /// Runs `kernel` over `grid` × `block` with the parameter struct's `params` bytes, whose
    /// pointer fields name views of `memory` ([`Memory::add`], [`Memory::view`]), under every
    /// schedule (see the module's doc); the buffers are updated with what the kernel wrote. A
    /// race, an access outside a view, a bad warp mask or a launch past CUDA's limits is an
    /// [`Error::Fault`].
    pub fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        params: &[u8],
        memory: &mut Memory,
    ) -> Result<()> {
        let id = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = std::env::temp_dir().join(format!("multilora-emulator-launch-{}-{id}", std::process::id()));
        let (input, output) = (base.with_extension("in"), base.with_extension("out"));
        let bytes = launch_file(kernel, grid, block, params, memory)?;
        std::fs::File::create(&input).and_then(|mut f| f.write_all(&bytes)).map_err(io(&input))?;
        let run = Command::new(&self.exe).arg(&input).arg(&output).output();
        let _ = std::fs::remove_file(&input);
        let run = run.map_err(io(&self.exe))?;
        if !run.status.success() {
            let _ = std::fs::remove_file(&output);
            let stderr = String::from_utf8_lossy(&run.stderr).trim().to_string();
            return Err(run_error(kernel, &stderr, run.status));
        }
        let out = std::fs::read(&output).map_err(io(&output))?;
        let _ = std::fs::remove_file(&output);
        if self.records {
            record(kernel, id, &bytes, &out)?;
        }
        read_buffers(&out, &mut memory.buffers).map_err(|reason| Error::Run { kernel: kernel.to_string(), reason })
    }

    /// `(name, value)` for every parameter struct's size (`"MlTile size"`) and field offset
    /// (`"MlTile.len"`), as the host compiler lays out `params.h`.
    pub fn layout(&self) -> Result<Vec<(String, usize)>> {
        let out = Command::new(&self.exe).arg("--layout").output().map_err(io(&self.exe))?;
        let text = String::from_utf8_lossy(&out.stdout);
        Ok(text
            .lines()
            .filter_map(|l| {
                let (name, v) = l.rsplit_once(' ')?;
                Some((name.to_string(), v.parse().ok()?))
            })
            .collect())
    }
}

/// Launches recorded per kernel at most ([`record`]).
const RECORD_PER_KERNEL: usize = 2;
/// The largest launch file recorded, and the most the corpus holds: it travels to the device
/// machine with the device check's binary, 64 MiB in all.
const RECORD_MAX_BYTES: usize = 256 << 10;
const RECORD_TOTAL_BYTES: u64 = 16 << 20;

/// With `MULTILORA_EMU_RECORD=DIR`, keeps a launch that ran for the device replay
/// (`emulate/replay.cpp`): its launch file as `DIR/KERNEL.ID.launch` and every buffer as the
/// emulator left it as `DIR/KERNEL.ID.expect` (the harness's output), the first
/// [`RECORD_PER_KERNEL`] of each kernel under [`RECORD_MAX_BYTES`], while the folder holds less
/// than [`RECORD_TOTAL_BYTES`]. The expectation is written first and each file under a temporary
/// name, so a reader never sees half a pair.
fn record(kernel: &str, id: u64, launch: &[u8], expect: &[u8]) -> Result<()> {
    let Some(dir) = std::env::var_os("MULTILORA_EMU_RECORD") else { return Ok(()) };
    let dir = PathBuf::from(dir);
    if launch.len() > RECORD_MAX_BYTES {
        return Ok(());
    }
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let prefix = format!("{kernel}.");
    let (mut kept, mut bytes) = (0, 0);
    for entry in std::fs::read_dir(&dir).map_err(io(&dir))?.flatten() {
        bytes += entry.metadata().map_or(0, |m| m.len());
        let name = entry.file_name();
        let name = name.to_string_lossy();
        kept += usize::from(name.starts_with(&prefix) && name.ends_with(".launch"));
    }
    if kept >= RECORD_PER_KERNEL || bytes + (launch.len() + expect.len()) as u64 > RECORD_TOTAL_BYTES {
        return Ok(());
    }
    let id = format!("{}-{id}", std::process::id());
    for (ext, bytes) in [("expect", expect), ("launch", launch)] {
        let path = dir.join(format!("{kernel}.{id}.{ext}"));
        let tmp = dir.join(format!(".{kernel}.{id}.{ext}.tmp"));
        std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
    }
    Ok(())
}

/// An environment variable as a number (`0x` for hex), if set.
fn env_number(name: &str) -> Result<Option<u64>> {
    let Ok(v) = std::env::var(name) else { return Ok(None) };
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    parsed
        .map(Some)
        .map_err(|_| Error::Run { kernel: "harness".to_string(), reason: format!("{name}={v} is not a number") })
}

/// The launch as the harness reads it (the module's doc gives the layout).
fn launch_file(kernel: &str, grid: [u32; 3], block: [u32; 3], params: &[u8], memory: &Memory) -> Result<Vec<u8>> {
    let schedules = env_number("MULTILORA_EMU_SCHEDULES")?.unwrap_or(DEFAULT_SCHEDULES.into()).clamp(1, 64) as u32;
    // By default the seed is a hash of the launch: the same launch is shuffled the same way.
    let seed = match env_number("MULTILORA_EMU_SEED")? {
        Some(s) => s,
        None => fnv(&[kernel.as_bytes(), params]),
    };
    let mut bytes = Vec::new();
    bytes.extend_from_slice(b"MLEMU2\0\0");
    bytes.extend_from_slice(&(kernel.len() as u32).to_le_bytes());
    bytes.extend_from_slice(kernel.as_bytes());
    for v in grid.iter().chain(&block) {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    bytes.extend_from_slice(&(params.len() as u32).to_le_bytes());
    bytes.extend_from_slice(params);
    bytes.extend_from_slice(&(memory.buffers.len() as u32).to_le_bytes());
    for b in &memory.buffers {
        bytes.extend_from_slice(&(b.len() as u64).to_le_bytes());
        bytes.extend_from_slice(b);
    }
    bytes.extend_from_slice(&(memory.views.len() as u32).to_le_bytes());
    for v in &memory.views {
        bytes.extend_from_slice(&(v.buffer as u32).to_le_bytes());
        bytes.extend_from_slice(&(v.start as u64).to_le_bytes());
        bytes.extend_from_slice(&(v.len as u64).to_le_bytes());
    }
    bytes.extend_from_slice(&seed.to_le_bytes());
    bytes.extend_from_slice(&schedules.to_le_bytes());
    Ok(bytes)
}

/// FNV-1a over some byte strings.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in parts.iter().flat_map(|p| p.iter()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The harness's failure: a fault it caught (`multilora emulator: fault: <kind>: <detail>`), or
/// anything else as it said it.
fn run_error(kernel: &str, stderr: &str, status: std::process::ExitStatus) -> Error {
    let fault = stderr.lines().find_map(|l| {
        let rest = l.strip_prefix("multilora emulator: fault: ")?;
        let (kind, detail) = rest.split_once(": ")?;
        Some((FaultKind::from_report(kind)?, detail.to_string()))
    });
    match fault {
        Some((kind, detail)) => Error::Fault { kernel: kernel.to_string(), kind, detail },
        None => Error::Run { kernel: kernel.to_string(), reason: format!("{stderr} ({status})") },
    }
}

static LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn read_buffers(out: &[u8], buffers: &mut [Vec<u8>]) -> std::result::Result<(), String> {
    let take = |at: &mut usize, n: usize| -> std::result::Result<&[u8], String> {
        let s = out.get(*at..*at + n).ok_or_else(|| format!("output cut short at byte {at}"))?;
        *at += n;
        Ok(s)
    };
    let mut at = 0;
    let count = u32::from_le_bytes(take(&mut at, 4)?.try_into().map_err(|_| "bad count")?) as usize;
    if count != buffers.len() {
        return Err(format!("{count} buffers came back, {} went in", buffers.len()));
    }
    for b in buffers.iter_mut() {
        let len = u64::from_le_bytes(take(&mut at, 8)?.try_into().map_err(|_| "bad length")?) as usize;
        if len != b.len() {
            return Err(format!("a buffer of {} bytes came back as {len}", b.len()));
        }
        b.copy_from_slice(take(&mut at, len)?);
    }
    Ok(())
}
