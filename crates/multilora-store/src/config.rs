//! `StoreConfig`: the knobs of the tiers (vLLM's names where vLLM has one) and of runtime updates.

use std::path::PathBuf;
use std::time::Duration;

use candle_core::DType;
use multilora_adapter::{LoadOptions, ModelShapes};
use multilora_types::LoraLimits;

use crate::error::{Error, Result};

/// How the store is sized and what it allows at run time.
///
/// Runtime updates, resolvers and hub sources are off by default: an operator turns each on.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Device slots (`max_loras`, distinct adapter generations per step) and the rank they
    /// hold: adapters whose rank exceeds `max_lora_rank` are refused at load.
    pub lora: LoraLimits,
    /// Capacity of the CPU tier; at least `max_loras`.
    pub max_cpu_loras: usize,
    /// The dtype adapters are held in.
    pub lora_dtype: DType,
    /// The served base model's name: no adapter may take it.
    pub base_model_name: String,
    /// The base model adapters are validated against.
    pub shapes: ModelShapes,
    /// Allows `load`, `unload`, `reload_in_place` and resolvers at run time.
    pub allow_runtime_updates: bool,
    /// Directories runtime local sources must lie in (after resolving `..` and symlinks).
    pub allowed_roots: Vec<PathBuf>,
    /// Allows hub sources at run time (startup adapters may always come from the hub).
    pub allow_hub_at_runtime: bool,
    /// Hub repositories (`org/name`) allowed at run time even with `allow_hub_at_runtime` off:
    /// a hub resolver's allow-list.
    pub allowed_hub_repos: Vec<String>,
    /// Loader threads (at least 1).
    pub loader_threads: usize,
    /// How long `resolve` answers a failed load with its error before loading again; doubled per
    /// consecutive failure of the same adapter, up to 60 s, and reset by a success.
    pub load_retry_backoff: Duration,
}

impl Default for StoreConfig {
    /// vLLM's defaults where it has them ([`LoraLimits::default`], `max_cpu_loras` =
    /// `max_loras`), float32, and an empty model: set [`StoreConfig::shapes`].
    fn default() -> StoreConfig {
        StoreConfig {
            lora: LoraLimits::default(),
            max_cpu_loras: LoraLimits::default().max_loras(),
            lora_dtype: DType::F32,
            base_model_name: String::new(),
            shapes: ModelShapes::llama(0, 0, 0, 0, 0, 0),
            allow_runtime_updates: false,
            allowed_roots: Vec::new(),
            allow_hub_at_runtime: false,
            allowed_hub_repos: Vec::new(),
            loader_threads: 1,
            load_retry_backoff: Duration::from_secs(1),
        }
    }
}

impl StoreConfig {
    /// The defaults for a base model named `base_model_name` with `shapes`.
    pub fn new(base_model_name: impl Into<String>, shapes: ModelShapes) -> StoreConfig {
        StoreConfig { base_model_name: base_model_name.into(), shapes, ..StoreConfig::default() }
    }

    /// Sets the LoRA limits (`max_loras`, `max_lora_rank`).
    pub fn lora(mut self, limits: LoraLimits) -> StoreConfig {
        self.lora = limits;
        self
    }

    /// Sets `max_cpu_loras`.
    pub fn max_cpu_loras(mut self, n: usize) -> StoreConfig {
        self.max_cpu_loras = n;
        self
    }

    /// Sets the LoRA dtype.
    pub fn lora_dtype(mut self, dtype: DType) -> StoreConfig {
        self.lora_dtype = dtype;
        self
    }

    /// Turns runtime load / unload / reload and resolvers on or off.
    pub fn allow_runtime_updates(mut self, allow: bool) -> StoreConfig {
        self.allow_runtime_updates = allow;
        self
    }

    /// Adds a root that runtime local sources may come from.
    pub fn allowed_root(mut self, root: impl Into<PathBuf>) -> StoreConfig {
        self.allowed_roots.push(root.into());
        self
    }

    /// Turns hub sources at run time on or off.
    pub fn allow_hub_at_runtime(mut self, allow: bool) -> StoreConfig {
        self.allow_hub_at_runtime = allow;
        self
    }

    /// Allows one hub repository (`org/name`, any revision) at run time.
    pub fn allowed_hub_repo(mut self, repo: impl Into<String>) -> StoreConfig {
        self.allowed_hub_repos.push(repo.into());
        self
    }

    /// Sets the number of loader threads.
    pub fn loader_threads(mut self, n: usize) -> StoreConfig {
        self.loader_threads = n;
        self
    }

    /// Sets the base back-off after a failed load (1 s by default): within it, requests get the
    /// failure without a new load; after it, the next request loads again. It doubles per
    /// consecutive failure of the same adapter up to 60 s (or this base, if longer), and a
    /// successful load resets it. [`crate::Store::retry`] skips it.
    pub fn load_retry_backoff(mut self, base: Duration) -> StoreConfig {
        self.load_retry_backoff = base;
        self
    }

    /// The options every load uses: the LoRA dtype and `max_lora_rank`.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions::new(self.lora_dtype).max_lora_rank(self.lora.max_lora_rank())
    }

    /// Checks the invariants the tiers rely on.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::Config { reason });
        if self.max_cpu_loras < self.lora.max_loras() {
            return bad(format!(
                "max_cpu_loras ({}) must be at least max_loras ({})",
                self.max_cpu_loras,
                self.lora.max_loras()
            ));
        }
        if self.loader_threads == 0 {
            return bad("loader_threads must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_tier_must_hold_the_slots() {
        let config = StoreConfig::default().lora(LoraLimits::slots(4)).max_cpu_loras(2);
        let err = config.validate().unwrap_err();
        assert_eq!(err.kind(), "config");
        assert!(err.to_string().contains("max_cpu_loras (2) must be at least max_loras (4)"), "{err}");
        assert!(StoreConfig::default().lora(LoraLimits::slots(4)).max_cpu_loras(4).validate().is_ok());
        assert!(StoreConfig::default().loader_threads(0).validate().is_err());
    }
}
