//! Writes PEFT-format adapters with seeded random weights: for benchmarks, tests of other crates
//! and the demo, which need real adapter files without a training run.

use std::collections::HashMap;
use std::path::Path;

use multilora_types::{ModuleKind, SplitMix64};
use safetensors::{Dtype, tensor::TensorView};

use crate::shapes::ModelShapes;

/// What to write.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SyntheticAdapter {
    /// Rank `r`.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// Targeted module kinds (every layer for per-layer kinds).
    pub targets: Vec<ModuleKind>,
    /// Seed of the weights.
    pub seed: u64,
    /// Standard deviation of the weights (PEFT initialises B to zero; these are trained-like).
    pub std: f32,
}

impl SyntheticAdapter {
    /// A rank-`rank` adapter with alpha `2·rank` on `targets`.
    pub fn new(rank: usize, targets: &[ModuleKind], seed: u64) -> SyntheticAdapter {
        SyntheticAdapter { rank, alpha: 2.0 * rank as f64, targets: targets.to_vec(), seed, std: 0.05 }
    }

    /// Writes `adapter_config.json` and `adapter_model.safetensors` (float32) into `dir`.
    pub fn write(&self, dir: &Path, shapes: &ModelShapes) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut targets: Vec<&str> = self.targets.iter().map(|k| k.short_name()).collect();
        targets.sort();
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": targets,
            "bias": "none",
            "use_rslora": false,
            "use_dora": false,
            "fan_in_fan_out": false,
            "lora_dropout": 0.0,
            "base_model_name_or_path": shapes.architecture,
        });
        std::fs::write(dir.join(crate::load::CONFIG_FILE), serde_json::to_string_pretty(&config)?)?;

        let mut rng = SplitMix64::new(self.seed);
        let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for id in shapes.modules() {
            if !self.targets.contains(&id.kind) {
                continue;
            }
            let (i, o) = shapes.in_out(id.kind);
            let (a, b) = if id.kind == ModuleKind::EmbedTokens {
                ("lora_embedding_A", "lora_embedding_B")
            } else {
                ("lora_A.weight", "lora_B.weight")
            };
            let prefix = format!("base_model.model.{}", id.peft_name());
            buffers.push((
                format!("{prefix}.{a}"),
                vec![self.rank, i],
                normal_bytes(&mut rng, self.rank * i, self.std),
            ));
            buffers.push((
                format!("{prefix}.{b}"),
                vec![o, self.rank],
                normal_bytes(&mut rng, o * self.rank, self.std),
            ));
        }
        let views: HashMap<String, TensorView<'_>> = buffers
            .iter()
            .map(|(name, shape, data)| {
                let view = TensorView::new(Dtype::F32, shape.clone(), data).map_err(std::io::Error::other)?;
                Ok((name.clone(), view))
            })
            .collect::<std::io::Result<_>>()?;
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(meta), &dir.join(crate::load::WEIGHTS_FILE))
            .map_err(std::io::Error::other)
    }
}

/// `n` f32 samples of N(0, `std`²) as little-endian bytes, from `rng`'s Box–Muller stream.
fn normal_bytes(rng: &mut SplitMix64, n: usize, std: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        out.extend_from_slice(&((rng.gaussian() as f32) * std).to_le_bytes());
    }
    out
}
