//! Shared helpers of the engine's integration tests: the PEFT fixtures and engines built on them.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use multilora::{Engine, EngineBuilder, GenerateRequest, MetricsSnapshot, RequestStream, SamplingParams};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::Value;

/// The served base model's name in these tests.
pub const BASE: &str = "base";

/// The fixture's adapter table, shared with the models' tests (and the server's, through these).
#[path = "../../../../tests/support/peft_tiny.rs"]
mod peft_tiny;
pub use peft_tiny::ADAPTERS;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny")
}

pub fn path(rel: &str) -> String {
    fixtures().join(rel).display().to_string()
}

pub fn cases() -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json"))?)?)
}

/// A builder on the fixture base model with every fixture adapter registered at start.
pub fn builder(max_loras: usize) -> EngineBuilder {
    builder_at(&path("base"), max_loras)
}

/// [`builder`] over the checkpoint at `model`.
pub fn builder_at(model: &str, max_loras: usize) -> EngineBuilder {
    let mut b =
        Engine::builder(model).served_model_name(BASE).max_loras(max_loras).max_lora_rank(32).kv_cache_bytes(16 << 20);
    for (name, rel) in ADAPTERS {
        b = b.lora(name, path(rel));
    }
    b
}

/// A fixture's token id list. A missing key or a value that is not a token id fails the test
/// loudly, never a silently empty list.
pub fn ids(v: &Value) -> Vec<u32> {
    let list = v.as_array().unwrap_or_else(|| panic!("fixture: expected a list of token ids, found {v}"));
    list.iter().map(|x| x.as_u64().unwrap_or_else(|| panic!("fixture: {x} is not a token id")) as u32).collect()
}

/// The model a fixture row or case names: its `adapter`, `null` meaning the base model. A row
/// without the key fails the test.
pub fn model_of(row: &Value) -> String {
    match row.get("adapter") {
        Some(Value::Null) => BASE.to_string(),
        Some(Value::String(name)) => name.clone(),
        other => panic!("fixture: a row without a valid \"adapter\" ({other:?}): {row}"),
    }
}

/// The fixture list `v[key]`; a missing key fails the test instead of checking nothing.
pub fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key).and_then(Value::as_array).unwrap_or_else(|| panic!("fixture: no list {key:?}")).as_slice()
}

/// A copy of the checkpoint in `src` with every float tensor rounded to bf16 and `config.json`
/// naming `bfloat16`, written to `dst` (the other files copied as they are).
pub fn bf16_checkpoint(src: &std::path::Path, dst: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src)? {
        let path = entry?.path();
        let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match file.as_str() {
            "model.safetensors" => {
                let bytes = std::fs::read(&path)?;
                let file_in = safetensors::SafeTensors::deserialize(&bytes)?;
                let mut out = Vec::new();
                for (name, view) in file_in.tensors() {
                    let data = match view.dtype() {
                        Dtype::F32 => to_bf16(view.data(), 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                        Dtype::F16 => to_bf16(view.data(), 2, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
                        _ => (view.data().to_vec(), view.dtype()),
                    };
                    out.push((name, view.shape().to_vec(), data));
                }
                let views = out
                    .iter()
                    .map(|(name, shape, (data, dtype))| {
                        Ok((name.as_str(), TensorView::new(*dtype, shape.clone(), data)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                std::fs::write(dst.join(&file), safetensors::serialize(views, None)?)?;
            }
            "config.json" => {
                let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
                for key in ["torch_dtype", "dtype"] {
                    cfg[key] = Value::from("bfloat16");
                }
                std::fs::write(dst.join(&file), cfg.to_string())?;
            }
            _ => {
                std::fs::copy(&path, dst.join(&file))?;
            }
        }
    }
    Ok(())
}

/// Little-endian floats of `width` bytes each, rounded to bf16 (to nearest, ties to even).
fn to_bf16(data: &[u8], width: usize, read: impl Fn(&[u8]) -> f32) -> (Vec<u8>, Dtype) {
    let bytes = data.chunks_exact(width).flat_map(|b| half::bf16::from_f32(read(b)).to_le_bytes()).collect();
    (bytes, Dtype::BF16)
}

/// The f32 matrix `name` of the safetensors file `file`, by rows.
pub fn f32_rows(file: &std::path::Path, name: &str) -> Result<Vec<Vec<f32>>> {
    let bytes = std::fs::read(file)?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)?;
    let view = tensors.tensor(name)?;
    let (&[rows, cols], Dtype::F32) = (view.shape(), view.dtype()) else {
        anyhow::bail!("{}: {name} is not an f32 matrix", file.display());
    };
    let values: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    anyhow::ensure!(values.len() == rows * cols, "{}: {name} holds {} values", file.display(), values.len());
    Ok(values.chunks(cols.max(1)).map(<[f32]>::to_vec).collect())
}

/// `n` requests of `model` that each run to the fixture's longest sequence (512 positions),
/// submitted one behind another: with `max_num_seqs(1)` they keep the engine busy for about
/// `n` × 500 steps, until dropped. One such request lasts ~50 ms on the tiny base, a window that
/// a test thread descheduled on a loaded 2-core machine has outlived in CI; a queue of them
/// makes the window seconds long.
pub fn hold(engine: &Engine, model: &str, n: usize) -> Result<Vec<RequestStream>> {
    let mut long = SamplingParams::greedy(500);
    long.ignore_eos = true;
    let long = long.validate(engine.config().vocab_size)?;
    let streams = (0..n)
        .map(|_| engine.submit(GenerateRequest::new(model, vec![1, 2, 3]).params(long.clone())))
        .collect::<multilora::Result<Vec<_>>>()?;
    until(engine, "the first held request runs", |m| m.running >= 1);
    Ok(streams)
}

/// Polls metrics until `done` holds (the loop may still be releasing after a drop).
pub fn wait_for(engine: &Engine, done: impl Fn(&MetricsSnapshot) -> bool) -> MetricsSnapshot {
    let start = Instant::now();
    loop {
        let m = engine.metrics();
        if done(&m) || start.elapsed() > Duration::from_secs(10) {
            return m;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Polls metrics without pausing (each answer comes between two steps, so no step is missed)
/// until `state` holds; fails the test, naming `what`, if it never does. For states that last
/// only a few steps, where [`wait_for`]'s pause could miss them.
pub fn until(engine: &Engine, what: &str, state: impl Fn(&MetricsSnapshot) -> bool) {
    let start = Instant::now();
    while !state(&engine.metrics()) {
        assert!(start.elapsed() < Duration::from_secs(20), "never reached: {what}: {:?}", engine.metrics());
    }
}

/// Everything returned: nothing running, waiting or deferred, no KV blocks or slot pins held.
pub fn assert_idle(m: &MetricsSnapshot) {
    assert_eq!((m.running, m.waiting, m.deferred), (0, 0, 0), "{m:?}");
    assert_eq!(m.kv_usage, 0.0, "kv blocks still held: {m:?}");
    assert_eq!(m.pinned_slots, 0, "slot pins still held: {m:?}");
}
