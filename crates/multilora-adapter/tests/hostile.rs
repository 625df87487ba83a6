//! Hostile adapter files: every bound is checked before anything is sized or read past it. A rank
//! of a billion, an alpha that overflows once folded into B, a config that is a FIFO or
//! `/dev/zero`, weights that are a FIFO: each a typed refusal, at once, naming the adapter.

mod common;

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use common::{base_shapes, fixtures};
use multilora_adapter::{CONFIG_FILE, LoadOptions, WEIGHTS_FILE, load_dir, read_config};
use serde_json::{Value, json};

/// A copy of the fixture adapter `qv_r8` with `changes` applied to its config.
fn edited(changes: Value) -> tempfile::TempDir {
    let src = fixtures().join("adapters/qv_r8");
    let dir = tempfile::tempdir().unwrap();
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join(CONFIG_FILE)).unwrap()).unwrap();
    for (k, v) in changes.as_object().unwrap() {
        config[k] = v.clone();
    }
    std::fs::write(dir.path().join(CONFIG_FILE), config.to_string()).unwrap();
    std::fs::copy(src.join(WEIGHTS_FILE), dir.path().join(WEIGHTS_FILE)).unwrap();
    dir
}

/// Loads `dir` on another thread: a load that blocks fails the test instead of hanging it.
fn load_within(dir: &Path, seconds: u64) -> multilora_adapter::Result<multilora_adapter::LoraAdapter> {
    let (tx, rx) = mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(load_dir("hostile", &dir, &base_shapes(), &LoadOptions::default().max_lora_rank(64)));
    });
    rx.recv_timeout(Duration::from_secs(seconds)).expect("the load blocked instead of refusing the file")
}

#[test]
fn a_rank_of_a_billion_is_refused_before_anything_is_sized() {
    for changes in [json!({"r": 1_000_000_000}), json!({"rank_pattern": {"q_proj": 1_000_000_000}})] {
        let dir = edited(changes.clone());
        // No `max_lora_rank`: the engine's start-up scan reads ranks this way, to size the slots.
        let err = read_config("huge", dir.path(), &base_shapes(), &LoadOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert_eq!(err.kind(), "rank_too_large", "{changes}: {msg}");
        assert!(msg.contains("\"huge\"") && msg.contains("1000000000") && msg.contains("1024"), "{msg}");
        let err = load_dir("huge", dir.path(), &base_shapes(), &LoadOptions::default()).unwrap_err();
        assert_eq!(err.kind(), "rank_too_large", "{changes}: {err}");
    }
}

#[test]
fn an_alpha_that_overflows_once_folded_into_b_is_refused() {
    let dir = edited(json!({"lora_alpha": 1e300}));
    let err = load_within(dir.path(), 30).unwrap_err();
    let msg = err.to_string();
    assert_eq!(err.kind(), "non_finite", "{msg}");
    assert!(msg.contains("\"hostile\"") && msg.contains("lora_B") && msg.contains("scaled by"), "{msg}");
    // A large but representable alpha still loads.
    assert!(load_within(edited(json!({"lora_alpha": 1e3})).path(), 30).is_ok());
}

#[cfg(unix)]
#[test]
fn a_config_or_weights_that_is_a_fifo_or_a_device_is_refused_at_once() {
    fn fifo(path: &Path) {
        let ok = std::process::Command::new("mkfifo").arg(path).status().map(|s| s.success()).unwrap_or(false);
        assert!(ok, "mkfifo {}", path.display());
    }
    fn dev_zero(path: &Path) {
        std::os::unix::fs::symlink("/dev/zero", path).unwrap();
    }
    fn too_big(path: &Path) {
        std::fs::write(path, vec![b' '; multilora_adapter::MAX_CONFIG_FILE_BYTES as usize + 1]).unwrap();
    }
    /// Which file is replaced, by what, and the refusal: kind and what the message says.
    type Case = (&'static str, fn(&Path), &'static str, &'static str);
    let table: [Case; 4] = [
        // Opening a FIFO would block until a writer came.
        (CONFIG_FILE, fifo, "config_invalid", "not a regular file"),
        // Reading `/dev/zero` would never end.
        (CONFIG_FILE, dev_zero, "config_invalid", "not a regular file"),
        // Over the size limit: refused without being read.
        (CONFIG_FILE, too_big, "config_invalid", "more than"),
        (WEIGHTS_FILE, fifo, "io", "not a regular file"),
    ];
    for (file, replace, kind, says) in table {
        let dir = edited(json!({}));
        std::fs::remove_file(dir.path().join(file)).unwrap();
        replace(&dir.path().join(file));
        let err = load_within(dir.path(), 10).unwrap_err();
        assert_eq!(err.kind(), kind, "{file}: {err}");
        assert!(err.to_string().contains(says), "{file}: {err}");
    }
}
