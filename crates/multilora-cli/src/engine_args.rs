//! The engine's flags, shared by `generate` and `serve` (vLLM's names), and building the engine
//! from them with errors that name the flag to blame.

use anyhow::anyhow;
use clap::Args;
use multilora::{DEFAULT_STEP_FACTOR, DType, Device, Engine, EngineBuilder, StepTime};
use serde::Deserialize;

use crate::Failure;

/// Flags that configure the engine.
#[derive(Debug, Args)]
pub(crate) struct EngineArgs {
    /// Base model: a Hugging Face checkpoint directory, a GGUF file (or a directory holding one),
    /// or a hub id.
    #[arg(long)]
    pub(crate) model: String,
    /// The GGUF file of a hub repo to serve (a repo holds one per quantization).
    #[arg(long)]
    pub(crate) gguf_file: Option<String>,
    /// A folder whose `tokenizer.json` (and chat template) to use instead of the model's own
    /// (a GGUF model otherwise builds its tokenizer from its metadata).
    #[arg(long)]
    pub(crate) tokenizer: Option<std::path::PathBuf>,
    /// The base model's name in requests (default: `--model` as given).
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Adapters: `NAME=<DIR|HUB_ID>` or vLLM's JSON `{"name": ..., "path": ...}`; repeatable,
    /// and several may follow one flag (`--lora-modules a=x b=y`, as vLLM takes them).
    #[arg(long = "lora", visible_alias = "lora-modules", value_parser = parse_lora, num_args = 1..)]
    pub(crate) loras: Vec<(String, String)>,
    /// Adapter slots: distinct adapters per step.
    #[arg(long)]
    pub(crate) max_loras: Option<usize>,
    /// Adapters kept in host memory.
    #[arg(long)]
    pub(crate) max_cpu_loras: Option<usize>,
    /// Rank of every slot.
    #[arg(long)]
    pub(crate) max_lora_rank: Option<usize>,
    /// Most running requests.
    #[arg(long)]
    pub(crate) max_num_seqs: Option<usize>,
    /// Most tokens per step (a hard cap; default 2048 on the CPU, 8192 on a GPU).
    #[arg(long)]
    pub(crate) max_num_batched_tokens: Option<usize>,
    /// How long a step that carries decode rows may take, so streams never stall behind arriving
    /// prompts: `auto` (default: 2.5× the step's decode rows alone, measured), `off` (the token
    /// cap only, as vLLM), or milliseconds.
    #[arg(long, value_parser = parse_step_time)]
    pub(crate) max_step_ms: Option<StepTime>,
    /// Context length (default: the model's).
    #[arg(long)]
    pub(crate) max_model_len: Option<usize>,
    /// MiB of host memory for cached prefixes on the CPU, beside the running sequences' KV
    /// (llama.cpp's `--cache-ram`; default an eighth of the machine's memory, at most 8192; 0 for
    /// none): prompts resent after others find their prefix cached.
    #[arg(long)]
    pub(crate) cache_ram: Option<u64>,
    /// What one step's activations may take on the CPU (default 1 GiB): a step's tokens are capped
    /// to what fits, so no request takes the server past weights + KV + slots + this.
    #[arg(long)]
    pub(crate) step_memory_bytes: Option<u64>,
    /// Bytes for the KV cache and the adapter slots together (default on the CPU: one
    /// full-length sequence, at least 256 MiB and at most 4 GiB, `--max-model-len` capped to
    /// what that holds when it is not given, plus `--cache-ram`; on a GPU what
    /// `--gpu-memory-utilization` leaves).
    #[arg(long)]
    pub(crate) kv_cache_bytes: Option<u64>,
    /// Reuse the KV of a prompt's cached prefix (vLLM's flag; on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub(crate) enable_prefix_caching: bool,
    /// Compute every prompt in full (vLLM's flag), e.g. to time prompt processing.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub(crate) no_enable_prefix_caching: bool,
    /// Share of the GPU's memory for weights, slots, activations and KV (vLLM's; default 0.9).
    #[arg(long)]
    pub(crate) gpu_memory_utilization: Option<f64>,
    /// `cpu` or `cuda:N` (`cuda` = `cuda:0`; needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Model dtype (weights and KV cache), in vLLM's spellings: `auto` (the checkpoint's own
    /// `torch_dtype`, f32 when it names none; a GGUF file's quantized weights as they are),
    /// `bfloat16`/`bf16`, `half`/`float16`/`f16`, `float`/`float32`/`f32` (a GGUF file's weights
    /// dequantized to it). On the CPU the activations are f32 whatever it is.
    #[arg(long, default_value = "auto", value_parser = parse_dtype)]
    pub(crate) dtype: Dtype,
    /// Dtype of the adapters' slots (vLLM's `--lora-dtype`), spelled as `--dtype`: `auto` is the
    /// model dtype, f16 for a GGUF file kept quantized on the CPU (llama.cpp's LoRA files).
    #[arg(long, default_value = "auto", value_parser = parse_dtype)]
    pub(crate) lora_dtype: Dtype,
    /// Dtype of the KV cache (vLLM's `--kv-cache-dtype`, here the CPU's float types), spelled as
    /// `--dtype`: `auto` is the model dtype, f16 for a GGUF file kept quantized on the CPU
    /// (llama.cpp's default cache).
    #[arg(long, default_value = "auto", value_parser = parse_dtype)]
    pub(crate) kv_cache_dtype: Dtype,
    /// vLLM's `--generation-config`: `auto` (default) reads the checkpoint's
    /// `generation_config.json` (EOS ids; default temperature, top_p, top_k, min_p,
    /// repetition_penalty, max_new_tokens for requests that set none); `vllm` ignores it.
    #[arg(long, default_value = "auto", value_parser = ["auto", "vllm"])]
    pub(crate) generation_config: String,
}

/// `--max-step-ms`: `auto`, `off` or a positive number of milliseconds.
pub(crate) fn parse_step_time(s: &str) -> Result<StepTime, String> {
    match s {
        "auto" => Ok(StepTime::Auto { factor: DEFAULT_STEP_FACTOR }),
        "off" => Ok(StepTime::Unbounded),
        ms => match ms.parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => Ok(StepTime::Max { seconds: v / 1e3 }),
            _ => Err(format!("{ms:?} is not auto, off or a positive number of milliseconds")),
        },
    }
}

/// `--dtype`: `None` is `auto`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dtype(pub(crate) Option<DType>);

pub(crate) fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Ok(Dtype(match s {
        "auto" => None,
        "bfloat16" | "bf16" => Some(DType::BF16),
        "half" | "float16" | "f16" => Some(DType::F16),
        "float" | "float32" | "f32" => Some(DType::F32),
        other => {
            return Err(format!(
                "{other:?} is not one of auto, bfloat16, bf16, half, float16, f16, float, float32, f32"
            ));
        }
    }))
}

/// A builder setter taking a count.
type Setter = fn(EngineBuilder, usize) -> EngineBuilder;

/// vLLM's JSON form of a `--lora-modules` entry.
#[derive(Deserialize)]
struct LoraJson {
    name: String,
    path: String,
}

pub(crate) fn parse_lora(s: &str) -> Result<(String, String), String> {
    if s.trim_start().starts_with('{') {
        let j: LoraJson = serde_json::from_str(s).map_err(|e| format!("{s:?} is not {{\"name\", \"path\"}}: {e}"))?;
        return Ok((j.name, j.path));
    }
    match s.split_once('=') {
        Some((n, src)) if !n.is_empty() && !src.is_empty() => Ok((n.to_string(), src.to_string())),
        _ => Err(format!("expected NAME=<DIR|HUB_ID>, got {s:?}")),
    }
}

pub(crate) fn parse_device(s: &str) -> anyhow::Result<Device> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    let n = s.strip_prefix("cuda:").or((s == "cuda").then_some("0"));
    let n: usize =
        n.and_then(|n| n.parse().ok()).ok_or_else(|| anyhow!("--device must be cpu or cuda:N, got {s:?}"))?;
    cuda_device(n, s)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_: usize, flag: &str) -> anyhow::Result<Device> {
    Err(anyhow!(
        "--device {flag}: this multilora was built without CUDA support; rebuild with \
         `cargo build --release -p multilora-cli --features cuda`"
    ))
}

/// GPU `n`: the engine opens it when it is built (on a stream of its own), and says so if it
/// cannot ([`multilora::BuildError::Device`]).
#[cfg(feature = "cuda")]
fn cuda_device(n: usize, _: &str) -> anyhow::Result<Device> {
    Ok(Device::Cuda(n))
}

impl EngineArgs {
    /// A builder with every flag given applied; `more` adds what the command adds.
    pub(crate) fn build(&self, more: impl FnOnce(EngineBuilder) -> EngineBuilder) -> Result<Engine, Failure> {
        let mut b = Engine::builder(self.model.clone())
            .served_model_name(self.served_model_name.clone().unwrap_or_else(|| self.model.clone()))
            .device(parse_device(&self.device).map_err(Failure::input)?);
        if let Some(d) = self.dtype.0 {
            b = b.dtype(d);
        }
        if let Some(d) = self.lora_dtype.0 {
            b = b.lora_dtype(d);
        }
        if let Some(d) = self.kv_cache_dtype.0 {
            b = b.kv_cache_dtype(d);
        }
        if let Some(f) = &self.gguf_file {
            b = b.gguf_file(f);
        }
        if let Some(dir) = &self.tokenizer {
            b = b.tokenizer(dir);
        }
        if let Some(u) = self.gpu_memory_utilization {
            b = b.gpu_memory_utilization(u);
        }
        if let Some(t) = self.max_step_ms {
            b = b.step_time(t);
        }
        for (name, src) in &self.loras {
            b = b.lora(name, src);
        }
        let knobs: [(Option<usize>, Setter); 6] = [
            (self.max_loras, EngineBuilder::max_loras),
            (self.max_cpu_loras, EngineBuilder::max_cpu_loras),
            (self.max_lora_rank, EngineBuilder::max_lora_rank),
            (self.max_num_seqs, EngineBuilder::max_num_seqs),
            (self.max_num_batched_tokens, EngineBuilder::max_num_batched_tokens),
            (self.max_model_len, EngineBuilder::max_model_len),
        ];
        for (value, set) in knobs {
            if let Some(v) = value {
                b = set(b, v);
            }
        }
        if let Some(bytes) = self.kv_cache_bytes {
            b = b.kv_cache_bytes(bytes);
        }
        if let Some(mib) = self.cache_ram {
            b = b.cache_ram_bytes(mib << 20);
        }
        if let Some(bytes) = self.step_memory_bytes {
            b = b.step_memory_bytes(bytes);
        }
        b = b.generation_config(self.generation_config == "auto");
        b = b.enable_prefix_caching(!self.no_enable_prefix_caching);
        more(b).build().map_err(|e| {
            // The adapter error's text names the adapter, its file and the reason; say which flag
            // (its message already starts with `adapter "NAME":`, so it is not repeated here).
            match &e {
                multilora::BuildError::Adapter { .. } => Failure::input(anyhow!("--lora: {e}")),
                // candle's error may carry a backtrace on further lines; the first says what failed.
                multilora::BuildError::Device { device, source } => {
                    let cause = source.to_string();
                    let cause = cause.lines().next().unwrap_or_default().trim().to_string();
                    Failure::input(anyhow!("--device {device}: no CUDA device found ({cause})"))
                }
                _ => Failure::input(anyhow!("--model {}: {e}", self.model)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_flags_in_both_forms() {
        assert_eq!(parse_lora("sql=/a/b").unwrap(), ("sql".into(), "/a/b".into()));
        assert_eq!(
            parse_lora(r#"{"name": "sql", "path": "/a/b", "base_model_name": "m"}"#).unwrap(),
            ("sql".into(), "/a/b".into())
        );
        assert!(parse_lora("sql").is_err());
        assert!(parse_lora("{\"name\": 1}").is_err());
    }

    #[test]
    fn max_step_ms_takes_auto_off_or_milliseconds() {
        assert_eq!(parse_step_time("auto").unwrap(), StepTime::Auto { factor: DEFAULT_STEP_FACTOR });
        assert_eq!(parse_step_time("off").unwrap(), StepTime::Unbounded);
        assert_eq!(parse_step_time("250").unwrap(), StepTime::Max { seconds: 0.25 });
        for bad in ["0", "-3", "soon", "inf"] {
            assert!(parse_step_time(bad).unwrap_err().contains(bad), "{bad}");
        }
    }

    #[test]
    fn dtype_takes_vllms_spellings() {
        for (s, want) in [
            ("auto", None),
            ("bfloat16", Some(DType::BF16)),
            ("bf16", Some(DType::BF16)),
            ("half", Some(DType::F16)),
            ("float16", Some(DType::F16)),
            ("f16", Some(DType::F16)),
            ("float", Some(DType::F32)),
            ("float32", Some(DType::F32)),
            ("f32", Some(DType::F32)),
        ] {
            assert_eq!(parse_dtype(s).unwrap().0, want, "{s}");
        }
        let e = parse_dtype("fp8").unwrap_err();
        assert!(e.contains("fp8") && e.contains("bfloat16"), "{e}");
    }
}
