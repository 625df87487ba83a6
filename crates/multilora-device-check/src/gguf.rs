//! A GGUF base on the GPU: a random Llama written as a GGUF file here (so nothing large travels to
//! the GPU machine) with every quantized type the engine serves (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! Q2_K…Q6_K) spread over its projections, two adapters in slots, and one mixed batch:
//! - the logits of the quantized model on CUDA (candle's quantized matmul for the base, this
//!   project's kernels for the LoRA rows) against the same file dequantized to f32 on the CPU (the
//!   reference path): relative error and top-1 agreement, beside the CPU's own quantized path;
//! - a decode step on CUDA at batch 1 and 16, LoRA rows against base rows.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};
use multilora_adapter::{LoadOptions, SyntheticAdapter};
use multilora_models::{Batch, KvCacheConfig, Model, ModelOptions, ModelSource, SeqInput};
use multilora_types::{LogitsWanted, LoraLimits, ModuleKind, SlotId};

use crate::report::Report;
use crate::util::{rel_err, time_per_call};

const SECTION: &str = "gguf";
const HIDDEN: usize = 1024;
const INTER: usize = 2816;
const LAYERS: usize = 4;
const HEADS: usize = 16;
const KV_HEADS: usize = 8;
const VOCAB: usize = 8192;

/// The types of a layer's q, k, v, o, gate, up, down: every served type appears.
const TYPES: [[GgmlDType; 7]; 2] = {
    use GgmlDType::*;
    [[Q4_1, Q5_0, Q5_1, Q4_0, Q4K, Q5K, Q6K], [Q8_0, Q4K, Q6K, Q3K, Q2K, Q4K, Q5K]]
};

/// Writes the random model; returns its path.
fn write_model(dir: &Path) -> Result<std::path::PathBuf> {
    let hd = HIDDEN / HEADS;
    let dev = &Device::Cpu;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let q = |rows: usize, cols: usize, ty: GgmlDType, scale: f32| -> Result<QTensor> {
        Ok(QTensor::quantize(&Tensor::randn(0f32, scale, (rows, cols), dev)?, ty)?)
    };
    tensors.push(("token_embd.weight".into(), q(VOCAB, HIDDEN, GgmlDType::Q8_0, 1.0)?));
    tensors.push(("output.weight".into(), q(VOCAB, HIDDEN, GgmlDType::Q6K, 2.0 / (HIDDEN as f32).sqrt())?));
    let ones =
        |n: usize| -> Result<QTensor> { Ok(QTensor::quantize(&Tensor::ones(n, DType::F32, dev)?, GgmlDType::F32)?) };
    tensors.push(("output_norm.weight".into(), ones(HIDDEN)?));
    for l in 0..LAYERS {
        let ty = TYPES[l % 2];
        let s = |i: usize| 1.0 / (i as f32).sqrt();
        for (k, (stem, rows, cols)) in [
            ("attn_q", HEADS * hd, HIDDEN),
            ("attn_k", KV_HEADS * hd, HIDDEN),
            ("attn_v", KV_HEADS * hd, HIDDEN),
            ("attn_output", HIDDEN, HEADS * hd),
            ("ffn_gate", INTER, HIDDEN),
            ("ffn_up", INTER, HIDDEN),
            ("ffn_down", HIDDEN, INTER),
        ]
        .into_iter()
        .enumerate()
        {
            tensors.push((format!("blk.{l}.{stem}.weight"), q(rows, cols, ty[k], s(cols))?));
        }
        tensors.push((format!("blk.{l}.attn_norm.weight"), ones(HIDDEN)?));
        tensors.push((format!("blk.{l}.ffn_norm.weight"), ones(HIDDEN)?));
    }
    use gguf_file::Value as V;
    let meta = [
        ("general.architecture", V::String("llama".into())),
        ("general.type", V::String("model".into())),
        ("llama.block_count", V::U32(LAYERS as u32)),
        ("llama.embedding_length", V::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", V::U32(INTER as u32)),
        ("llama.attention.head_count", V::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", V::U32(KV_HEADS as u32)),
        ("llama.context_length", V::U32(1024)),
        ("llama.rope.freq_base", V::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
    ];
    let meta: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.join("random.gguf");
    gguf_file::write(&mut std::io::BufWriter::new(std::fs::File::create(&path)?), &meta, &refs)?;
    Ok(path)
}

/// The model at `path` on `dev` with two adapters in slots 0 and 1.
fn load(path: &Path, dev: &Device, quantized: bool, adapters: &Path) -> Result<Model> {
    let opts = ModelOptions::default().device(dev.clone()).quantized(quantized).lora(LoraLimits::new(
        2,
        16,
        &LoraLimits::default_targets(),
    )?);
    let mut model = Model::load(&ModelSource::parse(&path.display().to_string())?, &opts)?;
    for slot in 0..2 {
        let dir = adapters.join(format!("a{slot}"));
        let a = multilora_adapter::load_dir(&format!("a{slot}"), &dir, model.shapes(), &LoadOptions::new(DType::F32))?;
        model.write_slot(SlotId::new(slot), &a)?;
    }
    Ok(model)
}

/// Every position's logits of 8 sequences of 32 random tokens (slots: none, 0 and 1 in turn).
fn logits(model: &Model) -> Result<Tensor> {
    let (seqs, len, bs) = (8usize, 32usize, 16usize);
    let mut kv = model.new_kv_cache(KvCacheConfig::new(seqs * len / bs, bs))?;
    let batch = (0..seqs)
        .map(|s| {
            let ids: Vec<u32> = (0..len).map(|i| ((s * 7919 + i * 104_729) % VOCAB) as u32).collect();
            let table = (0..len / bs).map(|b| (s * len / bs + b) as u32).collect();
            let slot = [None, Some(SlotId::new(0)), Some(SlotId::new(1))][s % 3];
            SeqInput::new(ids, 0, table, slot).with_logits(LogitsWanted::AllPrompt)
        })
        .collect();
    Ok(model.forward(&Batch::new(batch), &mut kv)?.to_device(&Device::Cpu)?)
}

fn top1_agreement(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (x, y) = (a.argmax(1)?.to_vec1::<u32>()?, b.argmax(1)?.to_vec1::<u32>()?);
    Ok(x.iter().zip(&y).filter(|(p, q)| p == q).count() as f64 / x.len().max(1) as f64)
}

pub(crate) fn check(report: &mut Report, dev: &Device) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("multilora-device-check-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(report, dev, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(report: &mut Report, dev: &Device, dir: &Path) -> Result<()> {
    let path = write_model(dir)?;
    let shapes = multilora_adapter::ModelShapes::llama(LAYERS, HIDDEN, INTER, VOCAB, HEADS, KV_HEADS);
    use ModuleKind::{DownProj as D, GateProj as G, KProj as K, OProj as O, QProj as Q, UpProj as U, VProj as V};
    SyntheticAdapter::new(8, &[Q, V], 1).write(&dir.join("a0"), &shapes)?;
    SyntheticAdapter::new(16, &[Q, K, V, O, G, U, D], 2).write(&dir.join("a1"), &shapes)?;
    let reference = logits(&load(&path, &Device::Cpu, false, dir)?)?;
    let cpu = logits(&load(&path, &Device::Cpu, true, dir)?)?;
    let gpu_model = load(&path, dev, true, dir)?;
    let gpu = logits(&gpu_model)?;
    let (e_cpu, e_gpu) = (rel_err(&cpu, &reference)?, rel_err(&gpu, &reference)?);
    let (a_cpu, a_gpu) = (top1_agreement(&cpu, &reference)?, top1_agreement(&gpu, &reference)?);
    report.info(SECTION, "weights", gpu_model.kernels());
    report.info(
        SECTION,
        "cpu quantized path vs f32 reference",
        format!("rel err {e_cpu:.2e}, top-1 {:.1}%", a_cpu * 100.0),
    );
    report.check(
        SECTION,
        "cuda quantized base + LoRA kernels vs f32 reference",
        format!("rel err {e_gpu:.2e}, top-1 {:.1}%", a_gpu * 100.0),
        "rel err <= 5e-2, top-1 >= 90%",
        e_gpu <= 5e-2 && a_gpu >= 0.9,
    );
    report.key(
        SECTION,
        format!("cuda vs f32 reference: rel err {e_gpu:.1e} (≤ 5e-2), top-1 {:.1}% (≥ 90%)", a_gpu * 100.0),
    );
    for batch in [1usize, 16] {
        let mut times = HashMap::new();
        for (label, slot) in [("base", None), ("lora", Some(SlotId::new(1)))] {
            let mut kv = gpu_model.new_kv_cache(KvCacheConfig::new(batch * 2, 16))?;
            let step = |kv: &mut multilora_models::KvCache| -> Result<()> {
                let seqs = (0..batch).map(|s| SeqInput::new(vec![5], 7, vec![(2 * s) as u32], slot)).collect();
                gpu_model.forward(&Batch::new(seqs), kv)?;
                Ok(())
            };
            times.insert(label, time_per_call(dev, 20, || step(&mut kv))?);
        }
        let value = format!(
            "base {:.2} ms, LoRA {:.2} ms ({:.2}x)",
            times["base"] * 1e3,
            times["lora"] * 1e3,
            times["lora"] / times["base"]
        );
        report.info(SECTION, format!("decode step, batch {batch}"), value.clone());
        report.key(SECTION, format!("decode step b{batch}: {value}"));
    }
    Ok(())
}
