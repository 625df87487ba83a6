//! Writes a random-weight GGUF model of a named shape in Q4_K_M's type mix, and optionally random
//! llama.cpp LoRA files for it: the files of the benchmarks at users' sizes
//! (`benches/peers/compare.py`, `benches/peers/long_context.py`), where no real checkpoint of that
//! size can be fetched.
//!
//! Q4_K_M as llama.cpp's `llama-quantize` makes it: every projection Q4_K, except `attn_v` and
//! `ffn_down` in Q6_K on the layers its `use_more_bits` picks (the first and last eighth, and every
//! third between), `output.weight` in Q6_K, the embedding Q4_K, the norms f32. Weights are normal
//! with standard deviation 0.02 (norms 1), seeded. The tokenizer (the metadata `tokenizer.ggml.*`)
//! is copied from `--tokenizer-from` (a GGUF file of the same tokenizer family, e.g. SmolLM2's),
//! its token list padded with `<|pad_N|>` tokens to the shape's vocabulary, so that llama.cpp and
//! this engine both load the file; prompts are best sent as token ids.
//!
//! ```sh
//! cargo run --release -p multilora-models --example random_gguf -- llama-3.2-1b /tmp/l1b.gguf \
//!     --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf [--layers 2] [--loras /tmp/l1b-loras]
//! ```
//!
//! Shapes (`llama` architecture; Qwen2.5-7B's without its q/k/v biases):
//! `llama-3.2-1b`, `llama-3-8b`, `qwen2.5-7b`; and `gemma-3-4b` (`gemma3` architecture: heads of
//! 256, q/k norms, four norms a layer, a 1024-token window on five layers of six, RoPE scaled
//! linearly by 8 on the others as the real file's `rope.scaling.*` say, the tied embedding in
//! Q6_K as `llama-quantize` keeps an output matrix).

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use multilora_adapter::{LoadOptions, ModelShapes, SyntheticAdapter};
use multilora_types::ModuleKind;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A model shape: the hyper-parameters its `config.json` gives.
struct Shape {
    name: &'static str,
    layers: usize,
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    context: usize,
    rope_theta: f32,
    tied: bool,
    /// Gemma 3's head size (else `hidden / heads`), sliding window and linear RoPE factor.
    gemma: Option<Gemma>,
}

/// What a Gemma 3 shape has beyond the Llama family's.
struct Gemma {
    head_dim: usize,
    window: usize,
    rope_factor: f32,
}

const SHAPES: [Shape; 4] = [
    Shape {
        name: "llama-3.2-1b",
        layers: 16,
        hidden: 2048,
        ffn: 8192,
        heads: 32,
        kv_heads: 8,
        vocab: 128256,
        context: 131072,
        rope_theta: 500000.0,
        tied: true,
        gemma: None,
    },
    Shape {
        name: "llama-3-8b",
        layers: 32,
        hidden: 4096,
        ffn: 14336,
        heads: 32,
        kv_heads: 8,
        vocab: 128256,
        context: 8192,
        rope_theta: 500000.0,
        tied: false,
        gemma: None,
    },
    Shape {
        name: "qwen2.5-7b",
        layers: 28,
        hidden: 3584,
        ffn: 18944,
        heads: 28,
        kv_heads: 4,
        vocab: 152064,
        context: 32768,
        rope_theta: 1000000.0,
        tied: false,
        gemma: None,
    },
    Shape {
        name: "gemma-3-4b",
        layers: 34,
        hidden: 2560,
        ffn: 10240,
        heads: 8,
        kv_heads: 4,
        vocab: 262144,
        context: 131072,
        rope_theta: 1000000.0,
        tied: true,
        gemma: Some(Gemma { head_dim: 256, window: 1024, rope_factor: 8.0 }),
    },
];

/// llama.cpp's `use_more_bits`: the layers whose `attn_v` and `ffn_down` Q4_K_M keeps in Q6_K.
fn more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// A `[rows, cols]` normal tensor (`std`), quantized to `ty`.
fn random(rows: usize, cols: usize, std: f32, ty: GgmlDType) -> Result<QTensor> {
    let t = Tensor::randn(0f32, std, (rows, cols), &Device::Cpu)?;
    Ok(QTensor::quantize(&t, ty)?)
}

fn norm(len: usize) -> Result<QTensor> {
    Ok(QTensor::quantize(&Tensor::ones(len, candle_core::DType::F32, &Device::Cpu)?, GgmlDType::F32)?)
}

/// The tokenizer's metadata of `from`, its tokens (and their types and scores) padded to `vocab`.
fn tokenizer(from: &Path, vocab: usize) -> Result<Vec<(String, Value)>> {
    let mut file = std::fs::File::open(from)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut out = Vec::new();
    for (key, value) in content.metadata {
        if !key.starts_with("tokenizer.") {
            continue;
        }
        let value = match (key.as_str(), value) {
            ("tokenizer.ggml.tokens", Value::Array(mut tokens)) => {
                let have = tokens.len();
                tokens.extend((have..vocab).map(|i| Value::String(format!("<|pad_{i}|>"))));
                Value::Array(tokens)
            }
            ("tokenizer.ggml.token_type", Value::Array(mut types)) => {
                // 4: a user-defined token, as llama.cpp's converter marks added ones.
                types.resize(vocab, Value::I32(4));
                Value::Array(types)
            }
            ("tokenizer.ggml.scores", Value::Array(mut scores)) => {
                scores.resize(vocab, Value::F32(0.0));
                Value::Array(scores)
            }
            (_, v) => v,
        };
        out.push((key, value));
    }
    if out.is_empty() {
        return Err(format!("{} holds no tokenizer.* metadata", from.display()).into());
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: random_gguf SHAPE OUT.gguf --tokenizer-from FILE.gguf [--layers N] [--loras DIR]";
    let (name, out) = match args.as_slice() {
        [n, o, ..] => (n.as_str(), PathBuf::from(o)),
        _ => return Err(usage.into()),
    };
    let flag = |f: &str| args.iter().position(|a| a == f).and_then(|i| args.get(i + 1)).cloned();
    let shape = SHAPES.iter().find(|s| s.name == name).ok_or_else(|| {
        let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        format!("unknown shape {name:?}: one of {names:?}")
    })?;
    let layers = flag("--layers").map(|v| v.parse()).transpose()?.unwrap_or(shape.layers);
    let from = flag("--tokenizer-from").ok_or(usage)?;
    let h = shape.hidden;
    let hd = shape.gemma.as_ref().map_or(shape.hidden / shape.heads, |g| g.head_dim);
    // A tied Gemma embedding is the output matrix too: Q6_K, as llama-quantize keeps `output`.
    let embd = if shape.gemma.is_some() { GgmlDType::Q6K } else { GgmlDType::Q4K };
    let mut tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), random(shape.vocab, h, 0.02, embd)?),
        ("output_norm.weight".into(), norm(h)?),
    ];
    if !shape.tied {
        tensors.push(("output.weight".into(), random(shape.vocab, h, 0.02, GgmlDType::Q6K)?));
    }
    for l in 0..layers {
        let wide = if more_bits(l, layers) { GgmlDType::Q6K } else { GgmlDType::Q4K };
        let kv = shape.kv_heads * hd;
        let blk = |s: &str| format!("blk.{l}.{s}.weight");
        tensors.extend([
            (blk("attn_norm"), norm(h)?),
            (blk("ffn_norm"), norm(h)?),
            (blk("attn_q"), random(shape.heads * hd, h, 0.02, GgmlDType::Q4K)?),
            (blk("attn_k"), random(kv, h, 0.02, GgmlDType::Q4K)?),
            (blk("attn_v"), random(kv, h, 0.02, wide)?),
            (blk("attn_output"), random(h, shape.heads * hd, 0.02, GgmlDType::Q4K)?),
            (blk("ffn_gate"), random(shape.ffn, h, 0.02, GgmlDType::Q4K)?),
            (blk("ffn_up"), random(shape.ffn, h, 0.02, GgmlDType::Q4K)?),
            (blk("ffn_down"), random(h, shape.ffn, 0.02, wide)?),
        ]);
        if shape.gemma.is_some() {
            tensors.extend([
                (blk("attn_q_norm"), norm(hd)?),
                (blk("attn_k_norm"), norm(hd)?),
                (blk("post_attention_norm"), norm(h)?),
                (blk("post_ffw_norm"), norm(h)?),
            ]);
        }
        eprint!("\rlayer {}/{layers}", l + 1);
    }
    eprintln!();
    let arch = if shape.gemma.is_some() { "gemma3" } else { "llama" };
    let k = |key: &str| format!("{arch}.{key}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(format!("random {} ({layers} layers)", shape.name))),
        // llama.cpp's file type 15: MOSTLY_Q4_K_M.
        ("general.file_type".into(), Value::U32(15)),
        (k("block_count"), Value::U32(layers as u32)),
        (k("context_length"), Value::U32(shape.context as u32)),
        (k("embedding_length"), Value::U32(h as u32)),
        (k("feed_forward_length"), Value::U32(shape.ffn as u32)),
        (k("attention.head_count"), Value::U32(shape.heads as u32)),
        (k("attention.head_count_kv"), Value::U32(shape.kv_heads as u32)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(if shape.gemma.is_some() { 1e-6 } else { 1e-5 })),
        (k("rope.freq_base"), Value::F32(shape.rope_theta)),
        (k("rope.dimension_count"), Value::U32(hd as u32)),
        (k("vocab_size"), Value::U32(shape.vocab as u32)),
    ];
    if let Some(g) = &shape.gemma {
        meta.extend([
            (k("attention.key_length"), Value::U32(g.head_dim as u32)),
            (k("attention.value_length"), Value::U32(g.head_dim as u32)),
            (k("attention.sliding_window"), Value::U32(g.window as u32)),
            (k("rope.scaling.type"), Value::String("linear".into())),
            (k("rope.scaling.factor"), Value::F32(g.rope_factor)),
        ]);
    }
    meta.extend(tokenizer(Path::new(&from), shape.vocab)?);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(&out)?, &meta_refs, &refs)?;
    println!("{}", out.display());
    if let Some(dir) = flag("--loras") {
        loras(shape, layers, Path::new(&dir))?;
    }
    Ok(())
}

/// Eight random llama.cpp LoRA files of rank 16 on all seven projections, `r0.gguf` … `r7.gguf`.
fn loras(shape: &Shape, layers: usize, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut shapes = ModelShapes::llama(layers, shape.hidden, shape.ffn, shape.vocab, shape.heads, shape.kv_heads);
    if let Some(g) = &shape.gemma {
        (shapes.architecture, shapes.model_type) = ("Gemma3ForCausalLM".into(), "gemma3_text".into());
        (shapes.head_dim, shapes.tie_word_embeddings) = (g.head_dim, true);
    }
    let tmp = tempfile::tempdir()?;
    for i in 0..8u64 {
        let name = format!("r{i}");
        let peft = tmp.path().join(&name);
        SyntheticAdapter::new(16, &ModuleKind::PROJECTIONS, 0xA11 + i).write(&peft, &shapes)?;
        let adapter = multilora_adapter::load_dir(&name, &peft, &shapes, &LoadOptions::default().max_lora_rank(16))?;
        multilora_adapter::write_gguf_lora(&adapter, &shapes, &dir.join(format!("{name}.gguf")))?;
    }
    println!("{}", dir.display());
    Ok(())
}
