//! `scripts/device-check.sh run` on a machine without a GPU, with a stub standing in for the
//! binary and the PEFT bench (`DEVICE_CHECK_STUB`): the preflight and the sections are listed,
//! no device stops the run before any section (exit 2), a failed section is rerun once with
//! `CUDA_LAUNCH_BLOCKING=1` (the binary under compute-sanitizer where there is one) and the later
//! sections still run and report, a section past its
//! budget is cut, the total budget bounds the run, and the JSON report parses. Then the binary
//! itself without a device. Each run takes a few seconds at most.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The stub: `STUB SECTION PREFIX`, as the script calls it. It fails the sections named in
/// `STUB_FAIL` (only without `CUDA_LAUNCH_BLOCKING=1`: the rerun then passes), hangs in
/// `STUB_HANG` (in `STUB_HANG_ONCE` only its first time), says "no CUDA device" in `STUB_NODEV`, cannot start in `STUB_NOLOAD` (as the
/// binary without its libraries), misses a speed target in `STUB_SLOW`,
/// and otherwise writes a key figure and a JSON report as the binary does. Every call is
/// appended to `calls.txt` beside it, and the command it stands in for to `argv.txt`.
const STUB: &str = r#"#!/usr/bin/env bash
name="$1"; prefix="$2"; shift 2
echo "$name blocking=${CUDA_LAUNCH_BLOCKING:-unset}" >>"$(dirname "$0")/calls.txt"
echo "$name: $*" >>"$(dirname "$0")/argv.txt"
in_list() { case ",$1," in *",$name,"*) return 0 ;; *) return 1 ;; esac; }
if in_list "${STUB_FAIL:-}" && [ "${CUDA_LAUNCH_BLOCKING:-0}" != 1 ]; then
    echo "error: CUDA_ERROR_ILLEGAL_ADDRESS (planted in $name)"; exit 1
fi
if in_list "${STUB_HANG:-}"; then exec sleep 60; fi
if in_list "${STUB_HANG_ONCE:-}" && [ ! -e "$(dirname "$0")/$name.hung" ]; then
    touch "$(dirname "$0")/$name.hung"; exec sleep 60
fi
if in_list "${STUB_NODEV:-}"; then echo "error: no CUDA device: stub" >&2; exit 2; fi
if in_list "${STUB_NOLOAD:-}"; then
    echo "multilora-device-check: error while loading shared libraries: libcublas.so.13" >&2; exit 127
fi
echo "$name: 2.0 µs / 1.0 µs floor (2.0×)" >"$prefix.key"
printf '{"exit": 0, "key": ["%s"], "lines": []}\n' "$name" >"$prefix.json"
if in_list "${STUB_SLOW:-}"; then exit 3; fi
exit 0
"#;

const SECTIONS: [&str; 9] = ["replay", "jit", "kernels", "timing", "golden", "decode", "gguf", "peft", "engine"];

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    dir: tempfile::TempDir,
}

impl Run {
    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    fn json(&self) -> Value {
        let text = std::fs::read_to_string(self.out().join("device-check.json")).expect("device-check.json");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("device-check.json does not parse: {e}\n{text}"))
    }

    /// The command the stub stood in for in `section`'s first call.
    fn argv(&self, section: &str) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("argv.txt")).unwrap_or_default();
        let found = text.lines().find_map(|l| l.strip_prefix(&format!("{section}: ")));
        found.unwrap_or_else(|| panic!("{section} was not called:\n{text}")).to_string()
    }

    fn calls(&self) -> Vec<String> {
        let text = std::fs::read_to_string(self.dir.path().join("calls.txt")).unwrap_or_default();
        text.lines().map(str::to_string).collect()
    }

    /// The summary's row of `section` (its first line).
    fn row(&self, section: &str) -> &str {
        let summary = self.stdout.split("== summary").nth(1).expect("a summary");
        summary
            .lines()
            .find(|l| l.split_whitespace().next() == Some(section))
            .unwrap_or_else(|| panic!("no summary row for {section}:\n{}", self.stdout))
    }

    fn section(&self, name: &str) -> Value {
        let json = self.json();
        let found = json["sections"].as_array().and_then(|s| s.iter().find(|s| s["name"] == name)).cloned();
        found.unwrap_or_else(|| panic!("no section {name} in {json}"))
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/device-check.sh")
}

/// `device-check.sh run` laid out alone in a temporary folder, with the stub and `env`.
fn run(env: &[(&str, &str)]) -> Run {
    run_with(&[], env)
}

/// [`run`] with `flags` after `run`.
fn run_with(flags: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = tempfile::tempdir().expect("a temporary folder");
    std::fs::copy(script(), dir.path().join("device-check.sh")).expect("copying the script");
    let stub = dir.path().join("stub.sh");
    std::fs::write(&stub, STUB).expect("writing the stub");
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).expect("making the stub executable");
    let mut cmd = Command::new("bash");
    cmd.arg(dir.path().join("device-check.sh"))
        .arg("run")
        .args(flags)
        .env("OUT", dir.path().join("out"))
        .env("DEVICE_CHECK_STUB", &stub)
        .env_remove("MULTILORA_SKIP_PEFT")
        .env_remove("DEVICE_CHECK_BUDGETS")
        .env_remove("DEVICE_CHECK_TOTAL")
        .env_remove("CUDA_LAUNCH_BLOCKING")
        // The machine's own compute-sanitizer, if any, left out unless a test names one.
        .env("DEVICE_CHECK_SANITIZER", "none");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running bash");
    let run = Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        dir,
    };
    println!("{}\n{}", run.stdout, run.stderr);
    run
}

#[test]
fn every_section_passing_exits_0_with_one_summary_row_each() {
    let r = run_with(&["--quick"], &[("MULTILORA_PEFT_WORKDIR", "/tmp/peft-work")]);
    assert_eq!(r.code, Some(0));
    assert!(r.stdout.contains("== preflight"));
    assert!(r.stdout.contains("libcublas.so.13"), "the preflight names each library");
    for s in SECTIONS {
        assert!(r.row(s).contains("pass"), "{}", r.row(s));
        assert!(r.row(s).contains(&format!("{s}: 2.0 µs / 1.0 µs floor")), "key figures in the row: {}", r.row(s));
    }
    let calls = r.calls();
    let order: Vec<&str> = calls.iter().map(|c| c.split(' ').next().unwrap_or_default()).collect();
    assert_eq!(order, ["none", "replay", "jit", "kernels", "timing", "golden", "decode", "gguf", "peft", "engine"]);
    // The commands stood in for: the binary per section, the flags of `run` passed on, and the
    // engine given the PEFT bench's figures.
    let out = r.out().display().to_string();
    let dir = r.dir.path().display().to_string();
    let bin = format!("{dir}/multilora-device-check --fixtures {dir}/fixtures/peft-tiny");
    assert_eq!(r.argv("none"), format!("{bin} --only none --report {out}/probe"));
    assert_eq!(r.argv("kernels"), format!("{bin} --only kernels --report {out}/kernels --quick"));
    assert_eq!(
        r.argv("replay"),
        format!(
            "{dir}/replay/replay --fatbins {dir}/replay/fatbins --corpus {dir}/replay/corpus --report {out}/replay"
        )
    );
    assert!(r.argv("peft").ends_with(&format!("bench_peft_cuda.py --workdir /tmp/peft-work --json {out}/peft.json")));
    assert!(
        r.argv("engine").ends_with(&format!("--quick --peft-workdir /tmp/peft-work --peft-json {out}/peft.json")),
        "{}",
        r.argv("engine")
    );
    let json = r.json();
    assert_eq!(json["exit"], 0);
    assert_eq!(json["sections"].as_array().map(Vec::len), Some(9));
    assert_eq!(r.section("timing")["report"]["key"][0], "timing");
}

#[test]
fn no_device_stops_before_any_section_with_exit_2() {
    let r = run(&[("STUB_NODEV", "none")]);
    assert_eq!(r.code, Some(2));
    assert!(r.stdout.contains("== preflight"));
    assert!(r.stdout.contains(
        "replay 20s, jit 45s, kernels 60s, timing 40s, golden 40s, decode 50s, gguf 40s, peft 100s, engine 50s = 445 s"
    ));
    assert!(r.stderr.contains("no CUDA device"));
    assert_eq!(r.calls(), ["none blocking=0"]);
    assert_eq!(r.json()["exit"], 2);
    assert_eq!(r.json()["sections"].as_array().map(Vec::len), Some(0));
    // What a device machine sends back: the summary, the JSON, and one archive of everything.
    let summary = std::fs::read_to_string(r.out().join("summary.txt")).expect("summary.txt");
    assert!(summary.contains("== summary") && summary.contains("exit 2"), "{summary}");
    let listing = Command::new("tar").arg("-tzf").arg(r.out().join("device-check.tar.gz")).output().expect("tar");
    let listing = String::from_utf8_lossy(&listing.stdout);
    for file in ["./preflight.txt", "./probe.log", "./device-check.json", "./summary.txt"] {
        assert!(listing.lines().any(|l| l == file), "{file} not in the archive:\n{listing}");
    }
}

#[test]
fn a_binary_that_cannot_start_still_lets_the_replay_and_the_peft_bench_run() {
    let r = run(&[("STUB_NOLOAD", "none")]);
    assert_eq!(r.code, Some(1));
    assert!(r.stdout.contains("the binary cannot start (exit 127)"));
    assert!(r.stdout.contains("error while loading shared libraries: libcublas.so.13"));
    // The replay needs the driver alone, and PEFT neither: both still run.
    assert!(r.row("replay").contains("pass") && r.row("peft").contains("pass"));
    for s in ["jit", "kernels", "timing", "golden", "decode", "gguf", "engine"] {
        assert!(r.row(s).contains("not run: no binary"), "{}", r.row(s));
    }
    assert_eq!(r.calls(), ["none blocking=0", "replay blocking=0", "peft blocking=0"]);
}

#[test]
fn a_failed_section_is_rerun_blocking_and_the_later_sections_still_run() {
    let r = run(&[("STUB_FAIL", "golden")]);
    assert_eq!(r.code, Some(1), "a failure stays a failure when its rerun passes");
    let golden = r.row("golden");
    assert!(golden.contains("FAIL; rerun pass"), "{golden}");
    assert!(r.stdout.contains("last output: error: CUDA_ERROR_ILLEGAL_ADDRESS (planted in golden)"));
    assert!(r.stdout.contains("rerun: golden: 2.0 µs"), "the rerun's key figures are shown");
    for later in ["decode", "gguf", "peft", "engine"] {
        assert!(r.row(later).contains("pass"), "{}", r.row(later));
    }
    let calls = r.calls();
    assert!(calls.contains(&"golden blocking=1".to_string()), "{calls:?}");
    assert_eq!(calls.iter().filter(|c| c.ends_with("blocking=1")).count(), 1, "only the failed section is rerun");
    let g = r.section("golden");
    assert_eq!((g["status"].as_str(), g["rc"].as_i64()), (Some("FAIL"), Some(1)));
    assert_eq!(
        (g["rerun"]["status"].as_str(), g["rerun"]["env"].as_str()),
        (Some("pass"), Some("CUDA_LAUNCH_BLOCKING=1"))
    );
    assert_eq!(g["report"], Value::Null, "the failed run wrote no report");
    assert_eq!(g["rerun"]["report"]["key"][0], "golden");
}

/// Where the image has compute-sanitizer, a failed section's rerun runs the binary under its
/// memcheck (as well as with blocking launches), and the report says so; the PEFT bench is not.
#[test]
fn a_failed_section_is_rerun_under_compute_sanitizer_where_there_is_one() {
    let r = run(&[("STUB_FAIL", "golden,peft"), ("DEVICE_CHECK_SANITIZER", "/opt/cs/compute-sanitizer")]);
    assert!(r.stdout.contains("compute-sanitizer    /opt/cs/compute-sanitizer"), "the preflight names it");
    assert!(r.row("golden").contains("FAIL; rerun pass"), "{}", r.row("golden"));
    let argv = std::fs::read_to_string(r.dir.path().join("argv.txt")).unwrap_or_default();
    let golden: Vec<&str> = argv.lines().filter(|l| l.starts_with("golden: ")).collect();
    assert_eq!(golden.len(), 2, "{argv}");
    assert!(!golden[0].contains("compute-sanitizer"), "the first run is plain: {}", golden[0]);
    assert!(
        golden[1].starts_with("golden: /opt/cs/compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 1 "),
        "{}",
        golden[1]
    );
    assert!(golden[1].contains("--only golden --report"), "{}", golden[1]);
    let peft: Vec<&str> = argv.lines().filter(|l| l.starts_with("peft: ")).collect();
    assert!(peft.len() == 2 && peft.iter().all(|l| !l.contains("compute-sanitizer")), "{argv}");
    let g = r.section("golden");
    assert_eq!(g["rerun"]["env"].as_str(), Some("CUDA_LAUNCH_BLOCKING=1, compute-sanitizer --tool memcheck"));
    assert_eq!(r.json()["preflight"]["compute_sanitizer"].as_str(), Some("/opt/cs/compute-sanitizer"));
}

/// A section past its budget is cut, rerun once with twice the budget (the sections after it
/// keep theirs), cut again when it hangs again, and the run goes on.
#[test]
fn a_section_past_its_budget_is_cut_rerun_longer_once_and_the_run_goes_on() {
    let t = std::time::Instant::now();
    let r = run(&[("STUB_HANG", "kernels"), ("DEVICE_CHECK_BUDGETS", "kernels=1")]);
    assert!(t.elapsed().as_secs() < 30, "the hung section was not cut: {:?}", t.elapsed());
    assert_eq!(r.code, Some(1));
    assert!(r.row("kernels").contains("timeout; rerun timeout"), "{}", r.row("kernels"));
    assert!(r.row("kernels").contains("/ 1+2 s"), "{}", r.row("kernels"));
    assert!(r.row("engine").contains("pass"));
    let calls = r.calls();
    assert_eq!(calls.iter().filter(|c| c.starts_with("kernels")).count(), 2, "{calls:?}");
    assert!(!calls.iter().any(|c| c.ends_with("blocking=1")), "a timeout is not rerun blocking: {calls:?}");
    let k = r.section("kernels");
    assert_eq!((k["rc"].as_i64(), k["rerun"]["rc"].as_i64()), (Some(124), Some(124)));
    assert_eq!((k["rerun"]["kind"].as_str(), k["rerun"]["budget_s"].as_i64()), (Some("longer"), Some(2)));
}

/// A section that times out once (the driver compiling the kernels on first use) passes on its
/// longer rerun; both runs are reported.
#[test]
fn a_section_that_times_out_once_passes_on_its_longer_rerun() {
    let r = run(&[("STUB_HANG_ONCE", "timing"), ("DEVICE_CHECK_BUDGETS", "timing=2")]);
    assert_eq!(r.code, Some(1), "the first run still timed out");
    let timing = r.row("timing");
    assert!(timing.contains("timeout; rerun pass"), "{timing}");
    assert!(r.stdout.contains("rerun: timing: 2.0 µs"), "the rerun's key figures are shown");
    let t = r.section("timing");
    assert_eq!((t["status"].as_str(), t["rerun"]["status"].as_str()), (Some("timeout"), Some("pass")));
    assert_eq!((t["rerun"]["kind"].as_str(), t["rerun"]["env"].as_str()), (Some("longer"), None));
    assert!(r.row("engine").contains("pass"));
}

/// No rerun when it would take the time of the sections after it: the total budget leaves none.
#[test]
fn a_timed_out_section_is_not_rerun_at_the_cost_of_later_ones() {
    let env = [("STUB_HANG_ONCE", "kernels"), ("DEVICE_CHECK_BUDGETS", "kernels=2"), ("DEVICE_CHECK_TOTAL", "323")];
    let r = run(&env);
    assert!(r.row("kernels").contains("timeout"), "{}", r.row("kernels"));
    assert!(!r.row("kernels").contains("rerun"), "{}", r.row("kernels"));
    assert_eq!(r.section("kernels")["rerun"], Value::Null);
}

#[test]
fn the_total_budget_bounds_the_run() {
    let r = run(&[("STUB_HANG", "timing"), ("DEVICE_CHECK_TOTAL", "7"), ("DEVICE_CHECK_BUDGETS", "timing=60")]);
    assert_eq!(r.code, Some(1));
    assert!(r.row("timing").contains("timeout"));
    for later in ["golden", "decode", "gguf", "peft", "engine"] {
        assert!(r.row(later).contains("not run: no time"), "{}", r.row(later));
    }
    assert!(r.json()["elapsed_s"].as_f64().is_some_and(|s| s < 10.0));
}

#[test]
fn a_missed_speed_target_exits_3_and_is_not_rerun() {
    let r = run(&[("STUB_SLOW", "decode"), ("MULTILORA_SKIP_PEFT", "1")]);
    assert_eq!(r.code, Some(3));
    assert!(r.row("decode").contains("slow"));
    assert!(r.row("peft").contains("skipped"));
    assert!(!r.calls().iter().any(|c| c.ends_with("blocking=1") || c.starts_with("peft")));
}

/// The binary without a device (a CPU build, or a CUDA build on a machine without one): exit 2
/// before any section, saying why; an unknown section is refused.
#[test]
fn the_binary_without_a_device_exits_2() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let prefix = dir.path().join("kernels");
    let out = Command::new(env!("CARGO_BIN_EXE_multilora-device-check"))
        .args(["--fixtures", "unused", "--only", "kernels", "--report"])
        .arg(&prefix)
        .output()
        .expect("running the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no CUDA device") || stderr.contains("built without CUDA"), "{stderr}");
    assert!(!prefix.with_extension("json").exists());
    let out = Command::new(env!("CARGO_BIN_EXE_multilora-device-check"))
        .args(["--fixtures", "unused", "--only", "bandwidth"])
        .output()
        .expect("running the binary");
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'bandwidth'"));
}

/// A driver that sits only in a folder of `LD_LIBRARY_PATH` (where container and VM images often
/// mount it) is found by the preflight, which lists that folder among those it searched.
#[test]
fn a_driver_only_on_the_loader_path_is_found() {
    let lib = tempfile::tempdir().expect("a temporary folder");
    std::fs::write(lib.path().join("libcuda.so.1"), b"").expect("a stand-in driver");
    let dir = lib.path().to_str().expect("a UTF-8 path");
    // The CUDA build's stubs and toolkit (CI's second run) are not searched here.
    let env = [("LD_LIBRARY_PATH", dir), ("MULTILORA_CUDA_STUBS", ""), ("CUDA_HOME", "")];
    let r = run_with(&["--quick"], &env);
    let pre = std::fs::read_to_string(r.out().join("preflight.txt")).expect("preflight.txt");
    assert!(pre.lines().any(|l| l.contains("libcuda.so.1") && l.contains(dir)), "{pre}");
    let json = r.json();
    assert_eq!(json["preflight"]["libraries"]["libcuda.so.1"], dir, "{json}");
    let searched = json["preflight"]["searched"].as_array().cloned().unwrap_or_default();
    assert!(searched.iter().any(|d| d == dir), "{searched:?}");
}
