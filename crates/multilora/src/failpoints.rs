//! The `failpoints` feature (tests only): `FAILPOINTS="engine-step=panic;…"` in the environment
//! configures the engine's fail points once per process, as `fail::FailScenario` would, without
//! its process-wide lock (several engines may run in one test process). A test in the same
//! process may also call `fail::cfg` itself.

use std::sync::Once;

/// Applies `FAILPOINTS` (`name=actions` pairs separated by `;`) once.
pub(crate) fn from_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Ok(spec) = std::env::var("FAILPOINTS") else { return };
        for pair in spec.split(';').filter(|p| !p.trim().is_empty()) {
            match pair.split_once('=') {
                Some((name, actions)) => {
                    if let Err(e) = fail::cfg(name.trim(), actions.trim()) {
                        tracing::warn!(%pair, error = %e, "FAILPOINTS: ignoring a bad fail point");
                    }
                }
                None => tracing::warn!(%pair, "FAILPOINTS: expected name=actions"),
            }
        }
    });
}
