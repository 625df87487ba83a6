//! Shared helpers of the integration tests: the PEFT fixture, adapters in slots, block tables.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use multilora_adapter::LoadOptions;
use multilora_models::{Batch, KvCache, KvCacheConfig, Model, ModelOptions, SeqInput};
use multilora_types::{LogitsWanted, LoraLimits, SlotId};
use serde_json::Value;

pub const TOL: f32 = 1e-4;

/// `test_device!`, shared with the layers' tests.
#[path = "../../../../tests/support/test_device.rs"]
mod test_device;
#[allow(unused_imports)]
pub(crate) use test_device::test_device;

/// The fixture's adapter table, shared with the engine's tests.
#[path = "../../../../tests/support/peft_tiny.rs"]
mod peft_tiny;
pub use peft_tiny::ADAPTERS;

pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/peft-tiny")
}

pub fn cases() -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(fixture().join("cases.json"))?)?)
}

/// The base model with every fixture adapter in a slot; returns the model and name → slot.
pub fn model_with_adapters(dtype: DType) -> Result<(Model, HashMap<String, SlotId>)> {
    model_with_adapters_on(dtype, &Device::Cpu)
}

/// [`model_with_adapters`] on `device`.
pub fn model_with_adapters_on(dtype: DType, device: &Device) -> Result<(Model, HashMap<String, SlotId>)> {
    model_at_with_adapters(&fixture().join("base"), dtype, device)
}

/// One row of a fixture batch.
#[derive(Clone, Debug)]
pub struct Row {
    pub batch: String,
    pub tensor: String,
    pub adapter: Option<String>,
    pub ids: Vec<u32>,
    pub expected: Tensor,
}

/// The fixture list `v[key]`; a missing key fails the test instead of checking nothing.
pub fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key).and_then(Value::as_array).unwrap_or_else(|| panic!("fixture: no list {key:?}")).as_slice()
}

/// A fixture's token id list; a missing key or a value that is not an id fails the test.
pub fn ids(v: &Value) -> Vec<u32> {
    let list = v.as_array().unwrap_or_else(|| panic!("fixture: expected a list of token ids, found {v}"));
    list.iter().map(|x| x.as_u64().unwrap_or_else(|| panic!("fixture: {x} is not a token id")) as u32).collect()
}

/// A fixture row's `adapter` (`null`: the base model); a row without the key fails the test.
pub fn adapter_of(row: &Value) -> Option<String> {
    match row.get("adapter") {
        Some(Value::Null) => None,
        Some(Value::String(name)) => Some(name.clone()),
        other => panic!("fixture: a row without a valid \"adapter\" ({other:?}): {row}"),
    }
}

/// A fixture string field; a missing one fails the test.
pub fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_else(|| panic!("fixture: no string {key:?} in {v}"))
}

/// Rows of `batches` (and of `extra_batches` when `extra`), with their expected logits.
pub fn rows(extra: bool) -> Result<Vec<Row>> {
    let cases = cases()?;
    let mut lists = vec![list(&cases, "batches")];
    if extra {
        lists.push(list(&cases, "extra_batches"));
    }
    let mut out = Vec::new();
    for b in lists.into_iter().flatten() {
        let name = text(b, "name").to_string();
        let expected =
            candle_core::safetensors::load(fixture().join(format!("expected/{name}.safetensors")), &Device::Cpu)?;
        for r in list(b, "rows") {
            let tensor = text(r, "tensor").to_string();
            out.push(Row {
                batch: name.clone(),
                adapter: adapter_of(r),
                ids: ids(&r["input_ids"]),
                expected: expected[&tensor].clone(),
                tensor,
            });
        }
    }
    Ok(out)
}

/// Hands out fresh block ids.
#[derive(Debug, Default)]
pub struct Blocks {
    next: u32,
}

impl Blocks {
    pub fn table(&mut self, tokens: usize, block_size: usize) -> Vec<u32> {
        let n = tokens.div_ceil(block_size) as u32;
        let t = (self.next..self.next + n).collect();
        self.next += n;
        t
    }
}

pub fn cache(model: &Model, num_blocks: usize, block_size: usize) -> Result<KvCache> {
    Ok(model.new_kv_cache(KvCacheConfig::new(num_blocks, block_size))?)
}

pub fn slot_of(slots: &HashMap<String, SlotId>, adapter: &Option<String>) -> Option<SlotId> {
    adapter.as_ref().map(|a| slots[a])
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// Runs `rows` as one flat batch from position 0 with logits at every position; returns each
/// row's `[len, vocab]` logits.
pub fn run_all_positions(model: &Model, slots: &HashMap<String, SlotId>, rows: &[Row]) -> Result<Vec<Tensor>> {
    let bs = 16;
    let need: usize = rows.iter().map(|r| r.ids.len().div_ceil(bs)).sum();
    let mut kv = cache(model, need, bs)?;
    let mut blocks = Blocks::default();
    let seqs = rows
        .iter()
        .map(|r| {
            SeqInput::new(r.ids.clone(), 0, blocks.table(r.ids.len(), bs), slot_of(slots, &r.adapter))
                .with_logits(LogitsWanted::AllPrompt)
        })
        .collect();
    let logits = model.forward(&Batch::new(seqs), &mut kv)?;
    let mut out = Vec::new();
    let mut at = 0;
    for r in rows {
        out.push(logits.narrow(0, at, r.ids.len())?);
        at += r.ids.len();
    }
    Ok(out)
}

pub fn argmax(row: &Tensor) -> Result<u32> {
    Ok(row.to_dtype(DType::F32)?.argmax(0)?.to_scalar::<u32>()?)
}

/// A bf16 checkpoint made from the fixture's base (every tensor rounded to bf16, `config.json`
/// naming `bfloat16`), in `dir`.
pub fn bf16_checkpoint(dir: &std::path::Path) -> Result<PathBuf> {
    let out = dir.join("base-bf16");
    multilora_models::write_checkpoint_copy(&fixture().join("base"), &out, DType::BF16)?;
    Ok(out)
}

/// The checkpoint in `base` in `dtype` on `device`, with every fixture adapter in a slot.
pub fn model_at_with_adapters(
    base: &std::path::Path,
    dtype: DType,
    device: &Device,
) -> Result<(Model, HashMap<String, SlotId>)> {
    let lora = LoraLimits::new(ADAPTERS.len(), 32, &LoraLimits::default_targets())?;
    let opts = ModelOptions::default().dtype(dtype).device(device.clone()).lora(lora);
    let mut model = Model::load_dir(base, &opts)?;
    let mut slots = HashMap::new();
    for (slot, (name, dir)) in ADAPTERS.iter().enumerate() {
        let load = LoadOptions::new(dtype).max_lora_rank(32);
        let adapter = multilora_adapter::load_dir(name, &fixture().join(dir), model.shapes(), &load)?;
        model.write_slot(SlotId::new(slot), &adapter)?;
        slots.insert(name.to_string(), SlotId::new(slot));
    }
    Ok((model, slots))
}
