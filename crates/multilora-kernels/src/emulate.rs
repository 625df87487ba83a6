//! Host emulation of the kernels: the same `.cu` sources, compiled by the host C++ compiler
//! against `emulate/emu.h` (CUDA's thread, barrier, shuffle and 16-bit types on `std::thread`),
//! run on the CPU over host buffers. Tests use it to check each kernel, with the host plan's real
//! parameters, against the CPU ops on machines that have no GPU; on a GPU the same kernels run for
//! real and the device check compares them again.
//!
//! The harness is built once per process (and cached in the temp directory under a hash of the
//! sources) with `$CXX` or `c++`. A launch is written to a file (kernel name, grid, block,
//! parameter bytes, buffers), the harness runs it and writes the buffers back. Pointer fields of
//! the parameters name buffers through [`buffer_ptr`].

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// What can go wrong building or running the emulator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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
    ("emulate/emu.h", include_str!("emulate/emu.h")),
    ("emulate/harness.cpp", include_str!("emulate/harness.cpp")),
];

/// A pointer field's value naming byte `byte_offset` of buffer `buffer` of a launch.
pub fn buffer_ptr(buffer: usize, byte_offset: usize) -> u64 {
    (((buffer as u64) + 1) << 48) | byte_offset as u64
}

/// The built harness.
#[derive(Debug)]
pub struct Emulator {
    exe: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// FNV-1a over the sources and the compiler's name: the cache key of a built harness.
fn sources_hash(compiler: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in SOURCES.iter().flat_map(|(p, s)| [p.as_bytes(), s.as_bytes()]).chain([compiler.as_bytes()]) {
        for &b in part {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl Emulator {
    /// The process's emulator, built on first use.
    pub fn get() -> Result<&'static Emulator> {
        static EMULATOR: OnceLock<std::result::Result<Emulator, String>> = OnceLock::new();
        let built = EMULATOR.get_or_init(|| Emulator::build().map_err(|e| e.to_string()));
        match built {
            Ok(e) => Ok(e),
            // The first failure is kept as text (errors are not `Clone`); say it again.
            Err(reason) => Err(Error::Run { kernel: "harness".to_string(), reason: reason.clone() }),
        }
    }

    /// For tests: the process's emulator, or `None` after printing why it is unavailable (a
    /// test that needs it then says it was skipped). With `MULTILORA_REQUIRE_EMULATION=1`, which
    /// CI sets, an unavailable emulator panics instead.
    pub fn for_tests() -> Option<&'static Emulator> {
        match Emulator::get() {
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

    fn build() -> Result<Emulator> {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let dir = std::env::temp_dir().join(format!("multilora-emulator-{:016x}", sources_hash(&compiler)));
        let exe = dir.join("harness");
        if exe.is_file() {
            return Ok(Emulator { exe });
        }
        std::fs::create_dir_all(dir.join("src/emulate")).map_err(io(&dir))?;
        for (path, text) in SOURCES {
            let p = dir.join("src").join(path);
            std::fs::write(&p, text).map_err(io(&p))?;
        }
        // Built under a name of this process's own, then renamed: concurrent test processes
        // never see a half-written harness.
        let tmp = dir.join(format!("harness.{}", std::process::id()));
        let out = Command::new(&compiler)
            .args(["-std=c++20", "-O2", "-pthread", "-DMULTILORA_EMULATE", "-Wno-unknown-pragmas", "-o"])
            .arg(&tmp)
            .arg(dir.join("src/emulate/harness.cpp"))
            .output()
            .map_err(|source| Error::NoCompiler { compiler: compiler.clone(), source })?;
        if !out.status.success() {
            return Err(Error::Compile { compiler, stderr: String::from_utf8_lossy(&out.stderr).into_owned() });
        }
        std::fs::rename(&tmp, &exe).map_err(io(&exe))?;
        Ok(Emulator { exe })
    }

    /// Runs `kernel` over `grid` × `block` with the parameter struct's `params` bytes; the
    /// buffers its pointers name ([`buffer_ptr`]) are updated with what the kernel wrote.
    pub fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        params: &[u8],
        buffers: &mut [Vec<u8>],
    ) -> Result<()> {
        let id = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = std::env::temp_dir().join(format!("multilora-emulator-launch-{}-{id}", std::process::id()));
        let (input, output) = (base.with_extension("in"), base.with_extension("out"));
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"MLEMU1\0\0");
        bytes.extend_from_slice(&(kernel.len() as u32).to_le_bytes());
        bytes.extend_from_slice(kernel.as_bytes());
        for v in grid.iter().chain(&block) {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes.extend_from_slice(&(params.len() as u32).to_le_bytes());
        bytes.extend_from_slice(params);
        bytes.extend_from_slice(&(buffers.len() as u32).to_le_bytes());
        for b in buffers.iter() {
            bytes.extend_from_slice(&(b.len() as u64).to_le_bytes());
            bytes.extend_from_slice(b);
        }
        std::fs::File::create(&input).and_then(|mut f| f.write_all(&bytes)).map_err(io(&input))?;
        let run = Command::new(&self.exe).arg(&input).arg(&output).output();
        let _ = std::fs::remove_file(&input);
        let run = run.map_err(io(&self.exe))?;
        if !run.status.success() {
            let _ = std::fs::remove_file(&output);
            let stderr = String::from_utf8_lossy(&run.stderr).trim().to_string();
            return Err(Error::Run { kernel: kernel.to_string(), reason: format!("{} ({})", stderr, run.status) });
        }
        let out = std::fs::read(&output).map_err(io(&output))?;
        let _ = std::fs::remove_file(&output);
        read_buffers(&out, buffers).map_err(|reason| Error::Run { kernel: kernel.to_string(), reason })
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
