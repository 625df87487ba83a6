//! Rotary position embeddings at absolute positions, for a flat batch of tokens.
//!
//! The Hugging Face Llama family rotates the two halves of each head (`rotate_half`), which is
//! candle-nn's non-interleaved `rope`; `rope_thd` takes `[1, tokens, heads, head_dim]`, so one call
//! covers every token of a varlen batch once the cos/sin rows of their positions are gathered.

use candle_core::{DType, Device, Tensor};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;

/// Precomputed `cos`/`sin` tables, `[max_positions, head_dim / 2]`; with LongRoPE the short
/// factors' rows then the long factors' (`[2 · max_positions, head_dim / 2]`: a token of a
/// sequence whose context passes the original length reads row `max_positions + position`,
/// [`Rope::long_rows`]).
#[derive(Clone, Debug)]
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// The inverse frequencies, computed in f32 the way transformers does, so positions far into a
/// long prompt get the same angles as the reference (an f64 table drifts by ~1e-5 rad at 256).
/// `local` gives the sliding layers' frequencies (their own base, no scaling: Gemma 3). LongRoPE's
/// short factors here; [`long_rope_freqs`] gives both of its sets.
pub(crate) fn inv_freq(cfg: &ModelConfig, local: bool) -> Vec<f32> {
    let d = cfg.head_dim;
    let base = if local { cfg.rope_local_theta.unwrap_or(cfg.rope_theta) } else { cfg.rope_theta } as f32;
    let plain: Vec<f32> = (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32)).collect();
    if local {
        return plain;
    }
    match &cfg.rope_scaling {
        RopeScaling::Default => plain,
        // transformers' `inv_freq / factor`, in f32.
        &RopeScaling::Linear { factor } => plain.iter().map(|&f| f / factor as f32).collect(),
        // llama.cpp divides each frequency's angle by its factor.
        RopeScaling::Factors(factors) => plain.iter().zip(factors).map(|(&f, &d)| f / d).collect(),
        RopeScaling::LongRope { short_factor, .. } => scaled_by(cfg, short_factor),
        &RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            plain
                .iter()
                .map(|&f| {
                    let f = f as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    if wavelen < high_wavelen || wavelen > low_wavelen {
                        scaled as f32
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                    }
                })
                .collect()
        }
    }
}

/// `1 / (factor_i · base^(2i / d))`, in f32 as transformers computes LongRoPE's frequencies.
fn scaled_by(cfg: &ModelConfig, factors: &[f32]) -> Vec<f32> {
    let (d, base) = (cfg.head_dim, cfg.rope_theta as f32);
    factors.iter().enumerate().map(|(i, &f)| 1.0 / (f * base.powf((2 * i) as f32 / d as f32))).collect()
}

/// LongRoPE's two frequency sets (short, long) and its cos / sin scale; `None` for other RoPE.
fn long_rope_freqs(cfg: &ModelConfig) -> Option<([Vec<f32>; 2], f32)> {
    match &cfg.rope_scaling {
        RopeScaling::LongRope { short_factor, long_factor, attention_factor, .. } => {
            Some(([scaled_by(cfg, short_factor), scaled_by(cfg, long_factor)], *attention_factor as f32))
        }
        _ => None,
    }
}

impl Rope {
    /// With LongRoPE, the context past which a sequence's tokens read the long factors' rows, and
    /// the row offset of those rows.
    pub(crate) fn long_rows(cfg: &ModelConfig) -> Option<(usize, usize)> {
        match &cfg.rope_scaling {
            RopeScaling::LongRope { original_max_position_embeddings, .. } => {
                Some((*original_max_position_embeddings, cfg.max_position_embeddings.max(1)))
            }
            _ => None,
        }
    }

    /// The tables of the model's layers, or with `local` of its sliding layers (Gemma 3's own
    /// base).
    pub(crate) fn new(cfg: &ModelConfig, local: bool, dtype: DType, device: &Device) -> Result<Rope> {
        let (sets, scale) = match long_rope_freqs(cfg).filter(|_| !local) {
            Some((sets, scale)) => (sets.to_vec(), scale),
            None => (vec![inv_freq(cfg, local)], 1.0),
        };
        let n = cfg.max_position_embeddings.max(1);
        let half = sets[0].len();
        let rows = n * sets.len();
        let mut cos = Vec::with_capacity(rows * half);
        let mut sin = Vec::with_capacity(rows * half);
        for freqs in &sets {
            for p in 0..n {
                for &f in freqs {
                    // The angle is an f32 product, as in the reference; cos/sin of it are exact
                    // (then times LongRoPE's scale in f32, as transformers does).
                    let angle = (p as f32 * f) as f64;
                    cos.push(angle.cos() as f32 * scale);
                    sin.push(angle.sin() as f32 * scale);
                }
            }
        }
        let cos = Tensor::from_vec(cos, (rows, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (rows, half), device)?.to_dtype(dtype)?;
        Ok(Rope { cos, sin })
    }

    /// The cos/sin rows of `positions` (`[tokens]`, u32), gathered once per step.
    pub(crate) fn gather(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((self.cos.index_select(positions, 0)?, self.sin.index_select(positions, 0)?))
    }

    /// Rotates `x: [tokens, heads, head_dim]` by the gathered rows.
    pub(crate) fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.unsqueeze(0)?.contiguous()?;
        Ok(candle_nn::rotary_emb::rope_thd(&x, cos, sin)?.squeeze(0)?)
    }
}
