//! What the tests that run on the counting fake driver (`fakecuda/`) share: finding it.

use std::path::Path;

/// `LD_LIBRARY_PATH` with the counting fake driver first, or `None` when `MULTILORA_FAKE_CUDA`
/// (built by `.ci/cuda-env.sh`) names none: the test then says it skipped `what`, and fails in CI
/// (`MULTILORA_REQUIRE_FAKE_CUDA=1`).
pub(crate) fn fake_library_path(what: &str) -> Option<String> {
    let Some(fake) = std::env::var_os("MULTILORA_FAKE_CUDA") else {
        assert!(
            std::env::var_os("MULTILORA_REQUIRE_FAKE_CUDA").is_none(),
            "MULTILORA_REQUIRE_FAKE_CUDA is set but MULTILORA_FAKE_CUDA names no counting driver (.ci/cuda-env.sh)"
        );
        println!("SKIPPED {what}: no counting fake driver (MULTILORA_FAKE_CUDA, built by .ci/cuda-env.sh)");
        return None;
    };
    Some(match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", Path::new(&fake).display(), Path::new(&old).display()),
        None => Path::new(&fake).display().to_string(),
    })
}
