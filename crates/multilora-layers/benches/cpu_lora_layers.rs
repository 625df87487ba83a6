//! CPU benchmarks of the LoRA layers, f32, 64 tokens over 8 adapters of rank 16 unless said:
//!
//! - (a) `a_step/*`: a LoRA step vs the base-only step, on a 4096×4096 layer and on the seven
//!   projections of a 2048-hidden Llama layer (intermediate 5632, 16 heads, 8 KV heads of 128),
//!   separate and fused as a model would run them (qkv, o, gate_up, down);
//! - (b) `b_lora_part/*`: the LoRA part alone, segmented vs the slow gathered reference;
//! - (c) `c_mixed/*`: one mixed batch vs the same tokens run as one batch per adapter;
//! - (d) `d_rank/*`: the LoRA part with rank-8 adapters in rank-64 slots vs rank-64 adapters
//!   (and rank 8 in rank-8 slots);
//! - (e) `e_slot_write/*`: writing a rank-16 adapter (all seven projections, 16 layers of the same
//!   model, loaded from PEFT files) into slots vs a plain memcpy of the same bytes.
//!
//! Ratios are meant to be read from one run: `cargo bench -p multilora-layers --bench cpu_lora_layers`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use criterion::{Criterion, criterion_group, criterion_main};
use multilora_adapter::{AdapterConfig, LoadOptions, LoraAdapter, LoraModule, ModelShapes, ModuleId, SyntheticAdapter};
use multilora_layers::{
    LoraLinear, LoraMapping, LoraSlots, SlotConfig, lora_expand, lora_expand_slow, lora_shrink, lora_shrink_slow,
};
use multilora_types::{Fingerprint, ModuleKind, SlotId, SplitMix64};

const TOKENS: usize = 64;
const ADAPTERS: usize = 8;

/// Seeded data ([`SplitMix64`]), so every run benchmarks the same data and slot map.
struct Rng(SplitMix64);

impl Rng {
    fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (self.0.next_f32() - 0.5) * scale).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor")
    }

    /// 64 tokens, 8 per adapter, shuffled as a real batch arrives.
    fn slots(&mut self) -> Vec<Option<SlotId>> {
        let mut s: Vec<Option<SlotId>> = (0..TOKENS).map(|i| Some(SlotId::new(i % ADAPTERS))).collect();
        for i in (1..s.len()).rev() {
            let j = self.0.below(i as u64 + 1) as usize;
            s.swap(i, j);
        }
        s
    }
}

/// A layer `in → out` with `ADAPTERS` slots of `max_rank`, each written with a random adapter of `rank`.
fn layer(rng: &mut Rng, id: ModuleId, inp: usize, out: usize, rank: usize, max_rank: usize) -> LoraLinear {
    fused_layer(rng, &[(id, out)], inp, rank, max_rank)
}

/// A (possibly fused) layer over `slices`, every slice adapted by every adapter.
fn fused_layer(rng: &mut Rng, slices: &[(ModuleId, usize)], inp: usize, rank: usize, max_rank: usize) -> LoraLinear {
    let cfg = SlotConfig::new(ADAPTERS, max_rank, DType::F32, &Device::Cpu);
    let out: usize = slices.iter().map(|s| s.1).sum();
    let mut l = LoraLinear::new(rng.tensor(&[out, inp], 0.05), None, slices.to_vec(), Some(&cfg)).expect("layer");
    for k in 0..ADAPTERS {
        let mut modules = BTreeMap::new();
        for &(id, o) in slices {
            let (a, b) = (rng.tensor(&[rank, inp], 0.05), rng.tensor(&[o, rank], 0.05));
            modules.insert(id, LoraModule::new(a, &b, rank, rank as f64, 1.0).expect("module"));
        }
        let config = AdapterConfig::parse(r#"{"target_modules": ["q_proj"]}"#).expect("config");
        let adapter = LoraAdapter::new(format!("bench{k}"), config, modules, Fingerprint([k as u8; 32]));
        l.write_slot(k, &adapter).expect("write");
    }
    l
}

/// Times `a` and `b` alternately, `pairs` times, and prints the median of `b / a` over the pairs:
/// on a shared machine whose load drifts, a ratio of two separate criterion runs is not reliable,
/// while each pair sees the same load.
fn paired(label: &str, pairs: usize, mut a: impl FnMut(), mut b: impl FnMut()) {
    a();
    b();
    let (mut ta, mut tb, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..pairs {
        let t = Instant::now();
        a();
        let da = t.elapsed().as_secs_f64();
        let t = Instant::now();
        b();
        let db = t.elapsed().as_secs_f64();
        ta.push(da);
        tb.push(db);
        ratios.push(db / da);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ma, mb, mr) = (median(&mut ta), median(&mut tb), median(&mut ratios));
    eprintln!("paired {label}: {:.3} ms vs {:.3} ms, ratio {mr:.3} (median of {pairs} pairs)", ma * 1e3, mb * 1e3);
}

/// The seven projections of one layer of the 2048-hidden Llama: (kind, in, out).
fn llama_projections() -> Vec<(ModuleKind, usize, usize)> {
    let shapes = ModelShapes::llama(16, 2048, 5632, 32000, 16, 8);
    ModuleKind::PROJECTIONS.iter().map(|&k| (k, shapes.in_out(k).0, shapes.in_out(k).1)).collect()
}

fn bench_step(c: &mut Criterion) {
    let mut rng = Rng(SplitMix64::new(1));
    let slots = rng.slots();
    let mut sorted_slots = slots.clone();
    sorted_slots.sort();
    let mixed = LoraMapping::new(&slots, ADAPTERS, &Device::Cpu).expect("mapping");
    let sorted = LoraMapping::new(&sorted_slots, ADAPTERS, &Device::Cpu).expect("mapping");
    let none = LoraMapping::new(&[None; TOKENS], ADAPTERS, &Device::Cpu).expect("mapping");

    let mut g = c.benchmark_group("a_step");
    g.sample_size(20);
    let big = layer(&mut rng, ModuleId::layer(0, ModuleKind::QProj), 4096, 4096, 16, 16);
    let x = rng.tensor(&[TOKENS, 4096], 1.0);
    g.bench_function("4096/base", |b| b.iter(|| black_box(big.forward(&x, &none).expect("fwd"))));
    g.bench_function("4096/lora_mixed", |b| b.iter(|| black_box(big.forward(&x, &mixed).expect("fwd"))));
    g.bench_function("4096/lora_sorted", |b| b.iter(|| black_box(big.forward(&x, &sorted).expect("fwd"))));

    let layers: Vec<(LoraLinear, Tensor)> = llama_projections()
        .into_iter()
        .map(|(k, i, o)| (layer(&mut rng, ModuleId::layer(0, k), i, o, 16, 16), rng.tensor(&[TOKENS, i], 1.0)))
        .collect();
    // The same projections as a model would fuse them: qkv, o, gate_up, down.
    let id = |k| ModuleId::layer(0, k);
    let fused: Vec<(LoraLinear, Tensor)> = [
        (vec![(id(ModuleKind::QProj), 2048), (id(ModuleKind::KProj), 1024), (id(ModuleKind::VProj), 1024)], 2048),
        (vec![(id(ModuleKind::OProj), 2048)], 2048),
        (vec![(id(ModuleKind::GateProj), 5632), (id(ModuleKind::UpProj), 5632)], 2048),
        (vec![(id(ModuleKind::DownProj), 2048)], 5632),
    ]
    .into_iter()
    .map(|(slices, i)| (fused_layer(&mut rng, &slices, i, 16, 16), rng.tensor(&[TOKENS, i], 1.0)))
    .collect();
    g.bench_function("llama2048x7/base", |b| {
        b.iter(|| {
            for (l, x) in &layers {
                black_box(l.forward(x, &none).expect("fwd"));
            }
        })
    });
    for (name, m) in [("lora_mixed", &mixed), ("lora_sorted", &sorted)] {
        g.bench_function(format!("llama2048x7/{name}"), |b| {
            b.iter(|| {
                for (l, x) in &layers {
                    black_box(l.forward(x, m).expect("fwd"));
                }
            })
        });
    }
    g.finish();

    // (b) The LoRA part alone, on the 4096 layer.
    let mut g = c.benchmark_group("b_lora_part");
    g.sample_size(20);
    let sl = &big.lora_slots().expect("slots")[0];
    let y0 = Tensor::zeros((TOKENS, 4096), DType::F32, &Device::Cpu).expect("zeros");
    g.bench_function("4096/segmented", |b| {
        b.iter(|| {
            let s = lora_shrink(&x, &[sl], &mixed).expect("shrink");
            black_box(lora_expand(y0.clone(), &s, &[sl], &mixed).expect("expand"))
        })
    });
    g.bench_function("4096/slow_gather", |b| {
        b.iter(|| {
            let s = lora_shrink_slow(&x, &[sl], &mixed).expect("shrink");
            black_box(lora_expand_slow(&y0, &s, &[sl], &mixed).expect("expand"))
        })
    });
    g.finish();

    // (c) Mixed batch vs one batch per adapter (the same 64 tokens).
    let mut g = c.benchmark_group("c_mixed");
    g.sample_size(20);
    let per_adapter: Vec<(Tensor, LoraMapping)> = (0..ADAPTERS)
        .map(|k| {
            let rows: Vec<u32> = (0..TOKENS as u32).filter(|&r| slots[r as usize] == Some(SlotId::new(k))).collect();
            let idx = Tensor::new(rows.as_slice(), &Device::Cpu).expect("idx");
            let m = LoraMapping::new(&vec![Some(SlotId::new(k)); rows.len()], ADAPTERS, &Device::Cpu).expect("mapping");
            (x.index_select(&idx, 0).expect("rows"), m)
        })
        .collect();
    g.bench_function("4096/mixed_batch", |b| b.iter(|| black_box(big.forward(&x, &mixed).expect("fwd"))));
    g.bench_function("4096/batch_per_adapter", |b| {
        b.iter(|| {
            for (xk, mk) in &per_adapter {
                black_box(big.forward(xk, mk).expect("fwd"));
            }
        })
    });
    g.finish();

    // (d) Padded rank: rank 8 in rank-64 slots must cost what rank 8 costs.
    let mut g = c.benchmark_group("d_rank");
    g.sample_size(20);
    let d_layers: Vec<(&str, LoraLinear)> = [("r8_in_64", 8, 64), ("r64_in_64", 64, 64), ("r8_in_8", 8, 8)]
        .into_iter()
        .map(|(name, rank, max_rank)| {
            (name, layer(&mut rng, ModuleId::layer(0, ModuleKind::QProj), 4096, 4096, rank, max_rank))
        })
        .collect();
    let lora_part = |l: &LoraLinear| {
        let sl = &l.lora_slots().expect("slots")[0];
        let s = lora_shrink(&x, &[sl], &mixed).expect("shrink");
        black_box(lora_expand(y0.clone(), &s, &[sl], &mixed).expect("expand"));
    };
    for (name, l) in &d_layers {
        g.bench_function(format!("4096/lora_part/{name}"), |b| b.iter(|| lora_part(l)));
        g.bench_function(format!("4096/step/{name}"), |b| b.iter(|| black_box(l.forward(&x, &mixed).expect("fwd"))));
    }
    g.finish();

    // The same comparisons as alternating pairs, the figures to quote.
    let base = |l: &LoraLinear, x: &Tensor| {
        black_box(l.forward(x, &none).expect("fwd"));
    };
    paired("a 4096: base -> lora_mixed", 30, || base(&big, &x), || drop(black_box(big.forward(&x, &mixed))));
    paired("a 4096: base -> lora_sorted", 30, || base(&big, &x), || drop(black_box(big.forward(&x, &sorted))));
    for (name, m) in [("lora_mixed", &mixed), ("lora_sorted", &sorted)] {
        paired(
            &format!("a llama2048x7: base -> {name}"),
            12,
            || layers.iter().for_each(|(l, x)| base(l, x)),
            || layers.iter().for_each(|(l, x)| drop(black_box(l.forward(x, m)))),
        );
    }
    for (name, m) in [("lora_mixed", &mixed), ("lora_sorted", &sorted)] {
        paired(
            &format!("a llama2048 fused qkv/gate_up: base -> {name}"),
            12,
            || fused.iter().for_each(|(l, x)| base(l, x)),
            || fused.iter().for_each(|(l, x)| drop(black_box(l.forward(x, m)))),
        );
    }
    paired(
        "b 4096 lora part: segmented -> slow_gather",
        15,
        || lora_part(&big),
        || {
            let s = lora_shrink_slow(&x, &[sl], &mixed).expect("shrink");
            black_box(lora_expand_slow(&y0, &s, &[sl], &mixed).expect("expand"));
        },
    );
    paired(
        "c 4096: mixed_batch -> batch_per_adapter",
        15,
        || drop(black_box(big.forward(&x, &mixed))),
        || per_adapter.iter().for_each(|(xk, mk)| drop(black_box(big.forward(xk, mk)))),
    );
    let (r8_64, r64, r8) = (&d_layers[0].1, &d_layers[1].1, &d_layers[2].1);
    paired("d 4096 lora part: r8_in_8 -> r8_in_64", 30, || lora_part(r8), || lora_part(r8_64));
    paired("d 4096 lora part: r8_in_8 -> r64_in_64", 30, || lora_part(r8), || lora_part(r64));
    paired(
        "d 4096 step: r8_in_8 -> r8_in_64",
        20,
        || drop(black_box(r8.forward(&x, &mixed))),
        || drop(black_box(r8_64.forward(&x, &mixed))),
    );
    paired(
        "d 4096 step: r8_in_8 -> r64_in_64",
        20,
        || drop(black_box(r8.forward(&x, &mixed))),
        || drop(black_box(r64.forward(&x, &mixed))),
    );
}

fn bench_slot_write(c: &mut Criterion) {
    // (e) A rank-16 adapter on all seven projections of a 16-layer 2048-hidden model, as PEFT writes it.
    let shapes = ModelShapes::llama(16, 2048, 5632, 32000, 16, 8);
    let dir = tempfile::tempdir().expect("tempdir");
    SyntheticAdapter::new(16, &ModuleKind::PROJECTIONS, 7).write(dir.path(), &shapes).expect("write adapter");
    let adapter =
        multilora_adapter::load_dir("bench", dir.path(), &shapes, &LoadOptions::new(DType::F32)).expect("load");
    let mut g = c.benchmark_group("e_slot_write");
    g.sample_size(20);
    let bytes = adapter.nbytes() as usize;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut memcpy = || {
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
    };
    g.bench_function("memcpy_same_bytes", |b| b.iter(&mut memcpy));
    for max_rank in [16, 64] {
        let cfg = SlotConfig::new(4, max_rank, DType::F32, &Device::Cpu);
        let mut slots: Vec<LoraSlots> = shapes
            .modules()
            .into_iter()
            .filter(|id| id.kind.is_per_layer())
            .map(|id| {
                let (i, o) = shapes.in_out(id.kind);
                LoraSlots::zeros(id, i, o, &cfg).expect("slots")
            })
            .collect();
        let mut write = || {
            for s in &mut slots {
                let m = adapter.module(&s.module()).expect("module");
                s.write(2, m).expect("slot write");
            }
        };
        g.bench_function(format!("rank16_into_max_rank_{max_rank}"), |b| b.iter(&mut write));
        paired(&format!("e slot write: memcpy -> rank16_into_max_rank_{max_rank}"), 20, &mut memcpy, &mut write);
    }
    g.finish();
    eprintln!("e_slot_write: adapter bytes {bytes} ({:.1} MiB)", bytes as f64 / (1024.0 * 1024.0));
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = bench_step, bench_slot_write
}
criterion_main!(benches);
