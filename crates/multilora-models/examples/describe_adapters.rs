//! Loads PEFT adapters against a base model's `config.json` and describes each one — ranks,
//! scaling, modules, memory, fingerprint — or says exactly why it is refused.
//!
//! `cargo run -p multilora-models --example describe_adapters` describes every adapter of the
//! fixtures; `-- --base DIR ADAPTER_DIR_OR_HUB_ID...` describes others. It lives beside the
//! model because the base's `config.json` is read here, by `ModelConfig`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::Device;
use multilora_adapter::{LoadOptions, SourceExt, load};
use multilora_types::AdapterSource;

fn main() -> Result<()> {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny");
    let fixtures = std::fs::canonicalize(&fixtures).unwrap_or(fixtures);
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut base = fixtures.join("base");
    if let Some(i) = args.iter().position(|a| a == "--base") {
        base = PathBuf::from(args.get(i + 1).context("--base needs a directory")?);
        args.drain(i..i + 2);
    }
    if args.is_empty() {
        for group in ["adapters", "invalid_adapters"] {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures.join(group))?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<_>>()?;
            dirs.sort();
            args.extend(dirs.into_iter().map(|d| d.display().to_string()));
        }
    }

    let mut shapes = multilora_models::ModelConfig::from_file(&base.join("config.json"))?.shapes();
    // The embedding digest lets adapters that carry a saved embedding (LoRA on embed_tokens) be
    // checked; without the weights file they are refused, and the output says so.
    let weights_path = base.join("model.safetensors");
    if weights_path.exists() {
        let weights = candle_core::safetensors::load(&weights_path, &Device::Cpu)
            .with_context(|| format!("read {}", weights_path.display()))?;
        let embed = weights.get("model.embed_tokens.weight").context("the base has no model.embed_tokens.weight")?;
        shapes = multilora_adapter::with_embedding_digest(shapes, embed)?;
    }
    println!(
        "base {}: {} layers, hidden {}, intermediate {}, vocab {}, {} heads / {} kv heads",
        shapes.architecture,
        shapes.num_layers,
        shapes.hidden_size,
        shapes.intermediate_size,
        shapes.vocab_size,
        shapes.num_heads,
        shapes.num_kv_heads
    );
    let opts = LoadOptions::default().max_lora_rank(16);
    println!("max_lora_rank {}\n", 16);
    for spec in &args {
        let name = spec.rsplit('/').next().unwrap_or(spec);
        let loaded = AdapterSource::parse(spec).and_then(|source| load(name, &source, &shapes, &opts));
        match loaded {
            Err(e) => println!("{name:<16} REFUSED [{}] {e}\n", e.kind()),
            Ok(adapter) => {
                let mut by_setting: BTreeMap<String, Vec<String>> = BTreeMap::new();
                for (id, m) in adapter.modules() {
                    let layer = id.layer.map_or("-".to_string(), |l| l.to_string());
                    by_setting
                        .entry(format!("r {} alpha {} scaling {:.4}", m.rank, m.alpha, m.scaling))
                        .or_default()
                        .push(format!("{}@{layer}", id.kind));
                }
                println!(
                    "{name:<16} ok: {} modules, max rank {}, {:.1} KiB at own rank, {:.1} KiB in rank-16 slots, fingerprint {}",
                    adapter.modules().len(),
                    adapter.max_rank(),
                    adapter.nbytes() as f64 / 1024.0,
                    adapter.nbytes_at_rank(16, 4) as f64 / 1024.0,
                    &adapter.fingerprint().to_hex()[..16]
                );
                for (setting, modules) in by_setting {
                    println!("    {setting}: {}", modules.join(" "));
                }
                println!();
            }
        }
    }
    Ok(())
}
