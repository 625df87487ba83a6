//! The device replay (`src/emulate/replay.cpp`) on a machine without a GPU. A child of this test
//! records a corpus through the emulator (`MULTILORA_EMU_RECORD`): a KV write that writes
//! nothing, one that writes, a SiLU · up and a greedy pick. The replay, built with the host
//! compiler, then runs it on the counting fake driver (`MULTILORA_FAKE_CUDA`, built by
//! `.ci/cuda-env.sh`), which launches nothing, so every buffer comes back as it went: each launch
//! must reach the driver by name, the launch that writes nothing must match, and the others must
//! be caught. Then the comparison's rules, by editing what went in so that what comes back is the
//! emulator's result give or take: equal, an ulp (within rounding), 1% (a failure), a token off
//! (a failure). Without the fake the test says it skipped (CI requires it); without a driver at
//! all the replay exits 2.

/// The counting fake driver's lookup, shared with the device check's tests.
#[path = "../../multilora-device-check/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use multilora_kernels::Emulator;
use multilora_kernels::emulate::Memory;
use multilora_kernels::params::{
    FUSED_THREADS, GREEDY_THREADS, GreedyParams, KV_WRITE_THREADS, KvWriteParams, SiluMulParams,
};

/// The child test, which records when `MULTILORA_EMU_RECORD` is set.
const CHILD: &str = "record_a_corpus";

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Emulates `params` with `memory`, which the recorder keeps.
fn emulate(emu: &Emulator, kernel: &str, grid: [u32; 3], block: u32, params: &[u8], mut memory: Memory) {
    emu.launch(kernel, grid, [block, 1, 1], params, &mut memory).unwrap_or_else(|e| panic!("{kernel}: {e}"));
}

#[test]
#[ignore = "the replay test's child: records launches when MULTILORA_EMU_RECORD is set"]
fn record_a_corpus() {
    assert!(std::env::var_os("MULTILORA_EMU_RECORD").is_some(), "run by tests/replay.rs with MULTILORA_EMU_RECORD");
    let emu = Emulator::get().expect("the emulator");
    let (width, tokens, rows) = (24u32, 3u32, 8u32);
    let src: Vec<f32> = (0..width * tokens).map(|i| i as f32 * 0.5 - 3.0).collect();
    // Two launches of one kernel: the first writes nothing (every slot past the cache), the
    // second three rows.
    for slots in [vec![u32::MAX; tokens as usize], vec![5, 0, 2]] {
        let mut m = Memory::new();
        let p = KvWriteParams {
            src: m.add(f32_bytes(&src)),
            cache: m.add(vec![0; (rows * width * 4) as usize]),
            slots: m.add(u32_bytes(&slots)),
            width,
            src_stride: width,
            elem_bytes: 4,
            num_rows: rows,
        };
        emulate(emu, "paged_kv_write", [tokens, 1, 1], KV_WRITE_THREADS, &p.to_bytes(), m);
    }
    let (inter, n) = (200u32, 2u32);
    let gu: Vec<f32> = (0..2 * inter * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
    let mut m = Memory::new();
    let p = SiluMulParams {
        gu: m.add(f32_bytes(&gu)),
        out: m.add(vec![0; (inter * n * 4) as usize]),
        inter,
        gu_stride: 2 * inter,
    };
    emulate(emu, "silu_mul_f32", [inter.div_ceil(FUSED_THREADS), n, 1], FUSED_THREADS, &p.to_bytes(), m);
    let vocab = 1000u32;
    let logits: Vec<f32> = (0..2 * vocab).map(|i| ((i * 7919 % 1009) as f32) / 97.0).collect();
    let mut m = Memory::new();
    let p = GreedyParams {
        logits: m.add(f32_bytes(&logits)),
        rows: m.add(u32_bytes(&[1, 0])),
        out: m.add(vec![0; 16]),
        vocab,
        stride: vocab,
    };
    emulate(emu, "greedy_rows_f32", [2, 1, 1], GREEDY_THREADS, &p.to_bytes(), m);
}

/// A launch file's buffers, and where each lies in the file (the MLEMU2 layout of
/// `src/emulate.rs`).
fn buffers(launch: &[u8]) -> Vec<(usize, usize)> {
    let u32_at = |at: usize| u32::from_le_bytes(launch[at..at + 4].try_into().expect("4 bytes")) as usize;
    let mut at = 8;
    at += 4 + u32_at(at); // the kernel's name
    at += 24; // grid, block
    at += 4 + u32_at(at); // the parameters
    let n = u32_at(at);
    at += 4;
    (0..n)
        .map(|_| {
            let len = u64::from_le_bytes(launch[at..at + 8].try_into().expect("8 bytes")) as usize;
            at += 8 + len;
            (at - len, len)
        })
        .collect()
}

/// The expectation file's buffers (a count, then each buffer's length and bytes).
fn expected(expect: &[u8]) -> Vec<Vec<u8>> {
    let n = u32::from_le_bytes(expect[..4].try_into().expect("4 bytes")) as usize;
    let mut at = 4;
    (0..n)
        .map(|_| {
            let len = u64::from_le_bytes(expect[at..at + 8].try_into().expect("8 bytes")) as usize;
            at += 8 + len;
            expect[at - len..at].to_vec()
        })
        .collect()
}

/// The recorded files of `kernel` with extension `ext`, sorted.
fn recorded(corpus: &Path, kernel: &str, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(corpus)
        .expect("the corpus")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with(&format!("{kernel}.")) && name.ends_with(ext)
        })
        .collect();
    v.sort();
    v
}

struct Replay {
    code: Option<i32>,
    out: String,
    log: String,
}

fn replay(exe: &Path, dir: &Path, corpus: &Path, path: &str) -> Replay {
    let log = dir.join("events.log");
    let _ = std::fs::remove_file(&log);
    let fatbins = dir.join("fatbins");
    std::fs::create_dir_all(&fatbins).expect("a fatbin folder");
    // The fake loads any bytes as a module.
    std::fs::write(fatbins.join("any.fatbin"), b"fatbin").expect("a fatbin");
    let out = Command::new(exe)
        .args(["--fatbins".as_ref(), fatbins.as_os_str(), "--corpus".as_ref(), corpus.as_os_str()])
        .args(["--report".as_ref(), dir.join("replay").as_os_str()])
        .env("LD_LIBRARY_PATH", path)
        .env("FAKE_CUDA_LOG", &log)
        .output()
        .expect("running the replay");
    let r = Replay {
        code: out.status.code(),
        out: format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        log: std::fs::read_to_string(&log).unwrap_or_default(),
    };
    println!("{}", r.out);
    r
}

/// The replay's line for the `nth` launch of `kernel` (in the corpus's sorted order).
fn line<'a>(r: &'a Replay, kernel: &str, nth: usize) -> &'a str {
    r.out
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(kernel))
        .nth(nth)
        .unwrap_or_else(|| panic!("no line {nth} for {kernel}"))
}

/// The replay built with the host compiler, or `None` (skipped) without one.
fn build_replay(dir: &Path) -> Option<PathBuf> {
    let exe = dir.join("replay");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/emulate/replay.cpp");
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    match Command::new(&compiler)
        .args(["-std=c++17", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-ldl")
        .output()
    {
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => panic!("the replay does not compile:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            assert!(std::env::var_os("MULTILORA_REQUIRE_EMULATION").is_none(), "no host compiler {compiler}: {e}");
            println!("SKIPPED the device replay: no host compiler {compiler}: {e}");
            None
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("multilora-replay-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

#[test]
fn without_a_driver_the_replay_says_no_device() {
    let dir = scratch("nodriver");
    let Some(exe) = build_replay(&dir) else { return };
    std::fs::create_dir_all(dir.join("f")).expect("folder");
    std::fs::create_dir_all(dir.join("c")).expect("folder");
    std::fs::write(dir.join("f/x.fatbin"), b"x").expect("file");
    std::fs::write(dir.join("c/x.1.launch"), b"x").expect("file");
    let out = Command::new(&exe)
        .args(["--fatbins".as_ref(), dir.join("f").as_os_str(), "--corpus".as_ref(), dir.join("c").as_os_str()])
        .args(["--driver", "/nonexistent/libcuda.so.1"])
        .output()
        .expect("running the replay");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no CUDA device: the NVIDIA driver cannot be opened"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_replay_launches_every_recorded_kernel_and_compares_what_comes_back() {
    if Emulator::for_tests().is_none() {
        return;
    }
    let Some(path) = common::fake_library_path("the device replay on the counting fake driver") else { return };
    let dir = scratch("fake");
    let Some(exe) = build_replay(&dir) else { return };
    let corpus = dir.join("corpus");
    let child = Command::new(std::env::current_exe().expect("the test executable"))
        .args([CHILD, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("MULTILORA_EMU_RECORD", &corpus)
        .output()
        .expect("running the child");
    let child_out = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success() && child_out.contains("1 passed"), "the child failed:\n{child_out}");

    // Recorded: each launch and its expectation, two KV writes, one of each other kernel.
    let kv = recorded(&corpus, "paged_kv_write", ".launch");
    assert_eq!(kv.len(), 2);
    for k in ["silu_mul_f32", "greedy_rows_f32"] {
        assert_eq!((recorded(&corpus, k, ".launch").len(), recorded(&corpus, k, ".expect").len()), (1, 1), "{k}");
    }

    // The fake runs nothing: what comes back is what went in.
    let r = replay(&exe, &dir, &corpus, &path);
    assert_eq!(r.code, Some(1));
    for k in ["paged_kv_write", "silu_mul_f32", "greedy_rows_f32"] {
        assert!(r.log.lines().any(|l| l == format!("launch {k}")), "{k} never reached the driver:\n{}", r.log);
    }
    assert_eq!(r.log.lines().filter(|l| l.starts_with("launch ")).count(), 4);
    let kv_lines: Vec<&str> = (0..2).map(|i| line(&r, "paged_kv_write", i)).collect();
    assert!(kv_lines.iter().any(|l| l.trim_start().starts_with("identical")), "the write of nothing: {kv_lines:?}");
    assert!(
        kv_lines.iter().any(|l| l.contains("FAIL") && l.contains("(cache, bytes)") && l.contains("must be equal")),
        "the write that was not done: {kv_lines:?}"
    );
    assert!(line(&r, "silu_mul_f32", 0).contains("FAIL") && line(&r, "silu_mul_f32", 0).contains("(out, f32)"));
    assert!(line(&r, "greedy_rows_f32", 0).contains("(out, token+logprob)"));
    let key = std::fs::read_to_string(dir.join("replay.key")).expect("replay.key");
    assert_eq!(key.trim(), "4 launches replayed from the emulator: 1 identical, 0 within rounding, 3 failed");
    assert!(
        std::fs::read_to_string(dir.join("replay.json")).expect("replay.json").contains("\"kernel\": \"silu_mul_f32\"")
    );

    // What went in made the emulator's result, give or take: the buffer that comes back.
    let edit = |launch_path: &Path, buffer: usize, change: &dyn Fn(&mut Vec<u8>)| {
        let mut launch = std::fs::read(launch_path).expect("the launch");
        let mut want =
            expected(&std::fs::read(launch_path.with_extension("expect")).expect("the expectation"))[buffer].clone();
        change(&mut want);
        let (at, len) = buffers(&launch)[buffer];
        assert_eq!(len, want.len());
        launch[at..at + len].copy_from_slice(&want);
        std::fs::write(launch_path, launch).expect("the launch");
    };
    let first = |kernel: &str| recorded(&corpus, kernel, ".launch").remove(0);
    let f32_at = |b: &mut Vec<u8>, i: usize, f: &dyn Fn(u32) -> u32| {
        let v = u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        b[4 * i..4 * i + 4].copy_from_slice(&f(v).to_le_bytes());
    };
    // The KV writes: their cache as the emulator left it (a copy, so equal or wrong).
    for p in &kv {
        edit(p, 1, &|_| {});
    }
    edit(&first("silu_mul_f32"), 1, &|b| f32_at(b, 7, &|v| v + 1));
    edit(&first("greedy_rows_f32"), 2, &|b| f32_at(b, 1, &|v| v + 1));
    let r = replay(&exe, &dir, &corpus, &path);
    assert_eq!(r.code, Some(0), "{}", r.out);
    assert!(
        line(&r, "silu_mul_f32", 0).contains("close")
            && line(&r, "silu_mul_f32", 0).contains("1 elements differ, at most 1 ulps")
    );
    assert!(line(&r, "greedy_rows_f32", 0).contains("close"));
    assert_eq!(
        std::fs::read_to_string(dir.join("replay.key")).expect("replay.key").trim(),
        "4 launches replayed from the emulator: 2 identical, 2 within rounding, 0 failed"
    );

    // 1% off in one SiLU output, and a greedy pick one token off: failures.
    edit(&first("silu_mul_f32"), 1, &|b| f32_at(b, 7, &|v| (f32::from_bits(v) * 1.01).to_bits()));
    edit(&first("greedy_rows_f32"), 2, &|b| f32_at(b, 0, &|v| v + 1));
    let r = replay(&exe, &dir, &corpus, &path);
    assert_eq!(r.code, Some(1));
    assert!(
        line(&r, "silu_mul_f32", 0).contains("FAIL")
            && line(&r, "silu_mul_f32", 0).contains("element 7: the device gives")
    );
    assert!(
        line(&r, "greedy_rows_f32", 0).contains("FAIL") && line(&r, "greedy_rows_f32", 0).contains("must be equal")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
