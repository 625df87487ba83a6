//! What one decode step asks of a GPU, counted on a machine without one (feature `cuda`): a
//! Llama-3-8B-shaped bf16 model of 32 layers with 8 rank-16 adapters on all seven projections runs
//! its decode steps on the counting fake driver (`fakecuda/`: host memory for device memory,
//! kernels counted and never run, one log line per launch, GEMM, memset, copy and sync; its cuRAND
//! draws nothing, so the random weights stay unwritten and cost no memory), in a child
//! process of this test started with the fake first on `LD_LIBRARY_PATH`. The child writes a mark
//! into the same log before each step, so each step's events are the lines between two marks.
//!
//! The fake is built by `.ci/cuda-env.sh` (`MULTILORA_FAKE_CUDA`); CI requires it
//! (`MULTILORA_REQUIRE_FAKE_CUDA=1`), elsewhere the test says it skipped. Nothing the fake
//! computes is a result: only the counts are.

#![cfg(feature = "cuda")]

#[path = "common/child.rs"]
mod child;
mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device};
use multilora_models::{Batch, KvCacheConfig, Model, ModelOptions, SeqInput};
use multilora_types::{LoraLimits, ModuleKind, SlotId};

/// The model and adapters the device check's `decode` section times (the binary's own file).
#[path = "../src/llama8b.rs"]
mod llama8b;

/// The child test, run only under the fake.
const CHILD: &str = "decode_steps_under_the_counting_driver";
/// Where the child writes its marks (the fake's `FAKE_CUDA_LOG`).
const LOG_VAR: &str = "MULTILORA_LAUNCH_LOG";
const LAYERS: usize = 32;
const ADAPTERS: usize = 8;
const RANK: usize = 16;
/// Decode steps' batch sizes.
const BATCHES: [usize; 3] = [1, 16, 64];
/// Context of each sequence and the cache's block size.
const CTX: usize = 64;
const BLOCK: usize = 16;

/// The most launches (kernels, cuBLAS GEMMs and memsets) a 32-layer decode step with LoRA on all
/// seven projections may make at any batch size: today's count, 17 a layer (4 GEMMs, 8 LoRA
/// launches, 2 fused add + norm, the fused RoPE + KV write, attention, SiLU · up) and 6 more;
/// 838 before the fused kernels. A change that adds launches fails here; one that removes some
/// lowers it.
const MAX_LORA_STEP_LAUNCHES: usize = 550;
/// #50's goal for that step.
const GOAL: usize = 560;

/// One step's events.
#[derive(Clone, Debug, Default, PartialEq)]
struct Step {
    kernels: BTreeMap<String, usize>,
    gemms: usize,
    memsets: usize,
    htod: (usize, usize),
    dtoh: (usize, usize),
    dtod: usize,
    syncs: usize,
}

impl Step {
    fn launches(&self) -> usize {
        self.kernels.values().sum::<usize>() + self.gemms + self.memsets
    }
}

/// Each mark's step, in order, from the log's lines.
fn steps(log: &str) -> Vec<(String, Step)> {
    let mut out: Vec<(String, Step)> = Vec::new();
    for line in log.lines() {
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        if kind == "mark" {
            out.push((rest.to_string(), Step::default()));
            continue;
        }
        let Some((_, s)) = out.last_mut() else { continue };
        let bytes = || rest.trim().parse::<usize>().unwrap_or(0);
        match kind {
            "launch" => *s.kernels.entry(rest.to_string()).or_default() += 1,
            "gemm" => s.gemms += 1,
            "memset" => s.memsets += 1,
            "htod" => s.htod = (s.htod.0 + 1, s.htod.1 + bytes()),
            "dtoh" => s.dtoh = (s.dtoh.0 + 1, s.dtoh.1 + bytes()),
            "dtod" => s.dtod += 1,
            "sync" => s.syncs += 1,
            other => panic!("unknown line in the fake's log: {other:?}"),
        }
    }
    out
}

#[test]
fn a_32_layer_decode_step_with_lora_on_7_projections_is_counted() {
    let Some(path) = common::fake_library_path("the launch count") else {
        return;
    };
    let text = child::run_child(CHILD, LOG_VAR, &path);
    let steps = steps(&text);
    let get = |name: &str| steps.iter().find(|(n, _)| n == name).map(|(_, s)| s.clone()).expect(name);

    println!("decode steps of a Llama-3-8B-shaped bf16 model, {LAYERS} layers, {ADAPTERS} rank-{RANK} adapters");
    println!(
        "{:<12} {:>8} {:>8} {:>6} {:>7} {:>12} {:>12} {:>5} {:>5}",
        "step", "launches", "kernels", "gemms", "memsets", "htod", "dtoh", "dtod", "syncs"
    );
    for (name, s) in steps.iter().filter(|(n, _)| n != "end") {
        println!(
            "{name:<12} {:>8} {:>8} {:>6} {:>7} {:>12} {:>12} {:>5} {:>5}",
            s.launches(),
            s.kernels.values().sum::<usize>(),
            s.gemms,
            s.memsets,
            format!("{} ({} B)", s.htod.0, s.htod.1),
            format!("{} ({} B)", s.dtoh.0, s.dtoh.1),
            s.dtod,
            s.syncs
        );
    }
    let lora64 = get("lora 64");
    println!("per kernel, LoRA step at batch 64 (per layer where it runs in each):");
    for (k, n) in &lora64.kernels {
        println!(
            "  {k:<48} {n:>5}{}",
            if n % LAYERS == 0 { format!("  ({}/layer)", n / LAYERS) } else { String::new() }
        );
    }

    for b in BATCHES {
        let (base, lora) = (get(&format!("base {b}")), get(&format!("lora {b}")));
        assert!(
            lora.launches() > base.launches(),
            "batch {b}: LoRA adds launches ({} vs {})",
            lora.launches(),
            base.launches()
        );
        assert!(
            lora.launches() <= MAX_LORA_STEP_LAUNCHES,
            "batch {b}: a LoRA decode step made {} launches, over {MAX_LORA_STEP_LAUNCHES}",
            lora.launches()
        );
        assert_eq!(base.gemms, 4 * LAYERS + 1, "batch {b}: one GEMM a base projection and lm_head");
        assert!(lora.launches() <= GOAL, "batch {b}: {} launches, over the goal of {GOAL}", lora.launches());
        // The step's inputs go up in a few copies, and nothing comes back or waits mid-step.
        assert!(lora.htod.0 <= 4 && lora.dtoh.0 == 0 && lora.syncs == 0, "batch {b}: {lora:?}");
    }
    assert_eq!(get("lora 16"), get("lora 16 again"), "the same step asks the same of the device twice");
}

#[test]
#[ignore = "runs under the counting fake driver only, as a_32_layer_decode_step_with_lora_on_7_projections_is_counted's child"]
fn decode_steps_under_the_counting_driver() {
    let Some(log) = std::env::var_os(LOG_VAR) else { return };
    let mark = |name: &str| child::mark(&log, name);
    let dev = Device::new_cuda_with_stream(0).expect("the fake device");
    let cfg = llama8b::config(LAYERS).expect("the config");
    let w = llama8b::random_weights(&cfg, DType::BF16, &dev).expect("the weights");
    let opts = ModelOptions::default()
        .dtype(DType::BF16)
        .device(dev.clone())
        .lora(LoraLimits::new(ADAPTERS, RANK, &ModuleKind::PROJECTIONS).expect("limits"));
    let mut model = Model::from_tensors(cfg, w, &opts).expect("the model");
    for k in 0..ADAPTERS {
        let adapter = llama8b::random_adapter(model.config(), k, RANK, DType::BF16, &dev).expect("an adapter");
        model.write_slot(SlotId::new(k), &adapter).expect("a slot");
    }
    let per_seq = CTX / BLOCK;
    let mut cache = model.new_kv_cache(KvCacheConfig::new(64 * per_seq, BLOCK)).expect("the cache");
    let batch = |n: usize, lora: bool| {
        Batch::new(
            (0..n)
                .map(|s| {
                    let table: Vec<u32> = (0..per_seq).map(|b| (s * per_seq + b) as u32).collect();
                    SeqInput::new(vec![100 + s as u32], CTX - 1, table, lora.then(|| SlotId::new(s % ADAPTERS)))
                })
                .collect(),
        )
    };
    // The first steps load the modules and make the kept buffers: not counted.
    for n in BATCHES {
        model.forward(&batch(n, true), &mut cache).expect("a warm-up step");
    }
    for n in BATCHES {
        for lora in [false, true] {
            mark(&format!("{} {n}", if lora { "lora" } else { "base" }));
            model.forward(&batch(n, lora), &mut cache).expect("a step");
        }
    }
    mark("lora 16 again");
    model.forward(&batch(16, true), &mut cache).expect("a step");
    mark("end");
}
