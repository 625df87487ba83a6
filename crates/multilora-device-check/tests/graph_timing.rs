//! The `timing` section's graph replays, checked on a machine without a GPU (feature `cuda`): the
//! device-check binary runs `--only timing` on the counting fake driver (`fakecuda/`), whose
//! stream capture breaks as the driver's does (on a synchronisation, a synchronous allocation, or
//! a copy with pageable host memory). Every timed kernel must be captured and replayed: a call
//! that cannot be replayed is timed with the host's cost in it, and the line says so. The
//! replays launch what the capture recorded, each launch counted again.
//!
//! The fake is built by `.ci/cuda-env.sh` (`MULTILORA_FAKE_CUDA`); CI requires it
//! (`MULTILORA_REQUIRE_FAKE_CUDA=1`), elsewhere the test says it skipped. The fake's times mean
//! nothing: only what was captured and launched is checked.

#![cfg(feature = "cuda")]

mod common;

use std::process::Command;

use serde_json::Value;

#[test]
fn every_timed_kernel_is_captured_and_replayed() {
    let Some(path) = common::fake_library_path("the graph replays") else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary folder");
    let (prefix, counts) = (dir.path().join("timing"), dir.path().join("counts.txt"));
    let out = Command::new(env!("CARGO_BIN_EXE_multilora-device-check"))
        .args(["--fixtures", "unused", "--only", "timing", "--report"])
        .arg(&prefix)
        .env("LD_LIBRARY_PATH", path)
        .env("FAKE_CUDA_REPORT", &counts)
        .output()
        .expect("running the device check");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "the timing section on the fake driver:\n{text}");
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(prefix.with_extension("json")).expect("the section's JSON report"),
    )
    .expect("the JSON report parses");
    let timed: Vec<&Value> = report["lines"]
        .as_array()
        .expect("lines")
        .iter()
        .filter(|l| l["section"] == "timing" && l["figures"].is_object())
        .collect();
    // 5 per decoder layer (4), their 3 sums, the KV write and its replaced form, 3 attention
    // cases, 3 fused kernels.
    assert_eq!(timed.len(), 4 * 5 + 3 + 2 + 3 + 3, "timed lines:\n{text}");
    for l in &timed {
        let (f, name, value) = (&l["figures"], l["name"].as_str().unwrap_or(""), l["value"].as_str().unwrap_or(""));
        if name.contains("(replaced)") {
            // candle's scatter_set, timed for comparison: its strided copy uploads its layout
            // from pageable memory on every call, which no capture takes; the line says so.
            assert!(f["replay_s"].is_null() && value.contains("no graph replay: "), "{l}");
            assert!(!value.contains('\n'), "one line of the error, no backtrace: {value}");
            continue;
        }
        assert!(f["replay_s"].is_number(), "{name} was not replayed: {}", f["replay_error"]);
        assert!(value.contains("in graph replays"), "{l}");
    }
    // Each timed call runs once to warm up and 100 times between events, then is captured (not
    // launched), its graph launched once to warm up and 100 times between events: 202 launches
    // of a one-kernel call, 101 had it not been replayed. The decode-shaped shrink runs once more
    // per decoder layer (the expand's input), in 4 layers.
    let counts = std::fs::read_to_string(&counts).expect("the fake's counts");
    let launches = |kernel: &str| -> u64 {
        counts
            .lines()
            .find_map(|l| l.strip_prefix(&format!("kernel {kernel} ")))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {kernel} launches counted:\n{counts}"))
    };
    assert_eq!(launches("lora_shrink_bgmv_bf16_bf16_r16"), 4 * (202 + 1), "{counts}");
    for fused in ["rope_kv_write_bf16", "add_rms_norm_bf16", "silu_mul_bf16"] {
        assert_eq!(launches(fused), 202, "{counts}");
    }
}
