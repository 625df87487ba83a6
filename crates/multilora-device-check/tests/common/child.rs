//! What the tests that run a child of theirs on the counting fake driver share: running it with
//! the fake's event log, and marking that log from the child.

/// Runs this test executable's ignored test `child` on the counting fake driver (`path`: its
/// [`fake_library_path`]), with the fake's event log in a temporary folder named to the child by
/// `log_var` as well (for its [`mark`]s); returns the log's text once the child passed.
pub(crate) fn run_child(child: &str, log_var: &str, path: &str) -> String {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let log = dir.path().join("events.log");
    let out = std::process::Command::new(std::env::current_exe().expect("the test executable"))
        .args([child, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", path)
        .env("FAKE_CUDA_LOG", &log)
        .env(log_var, &log)
        .output()
        .expect("running the child");
    let child_out = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the child under the fake driver failed:\n{child_out}");
    assert!(child_out.contains("1 passed"), "the child test did not run:\n{child_out}");
    std::fs::read_to_string(&log).expect("the fake's log")
}

/// Appends `mark NAME` to the event log `log` (the fake appends whole lines, so they interleave
/// in order).
pub(crate) fn mark(log: &std::ffi::OsStr, name: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).create(true).open(log).expect("the log");
    f.write_all(format!("mark {name}\n").as_bytes()).expect("a mark");
}
