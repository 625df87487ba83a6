//! Loading a rank-16 adapter on all seven projections of a 2048-hidden, 16-layer Llama
//! (intermediate 5632, 16 heads, 8 KV heads of 128) from a local file, next to `std::fs::read`
//! of the same file in the same run, both reported in bytes per second.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use multilora_adapter::{LoadOptions, ModelShapes, SyntheticAdapter, WEIGHTS_FILE, load_dir};
use multilora_types::ModuleKind;

fn bench(c: &mut Criterion) {
    let shapes = ModelShapes::llama(16, 2048, 5632, 32000, 16, 8);
    let dir = tempfile::tempdir().expect("temp dir");
    SyntheticAdapter::new(16, &ModuleKind::PROJECTIONS, 1).write(dir.path(), &shapes).expect("write adapter");
    let bytes = std::fs::metadata(dir.path().join(WEIGHTS_FILE)).expect("weights").len();
    let opts = LoadOptions::default().max_lora_rank(16);

    let mut group = c.benchmark_group("cpu_adapter_load");
    group.throughput(Throughput::Bytes(bytes));
    group.sample_size(20);
    group
        .bench_function("std_fs_read", |b| b.iter(|| black_box(std::fs::read(dir.path().join(WEIGHTS_FILE)).unwrap())));
    group.bench_function("load_dir_rank16_2048x16", |b| {
        b.iter(|| black_box(load_dir("bench", dir.path(), &shapes, &opts).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
