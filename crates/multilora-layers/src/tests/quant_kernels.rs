//! The quantized kernels, every type on every instruction set of this CPU, against the f64
//! product with candle's dequantized weight, held to the activation-quantization bound
//! ([`ensure_quant_bound`]); a row's bits whatever its batch, its thread split and its
//! instruction set.

use candle_core::{DType, Device, IndexOp, Tensor};
use proptest::prelude::*;

use super::quant::{ensure_quant_bound, ggml_weight, min_terms};
use super::{Rng, bits};
use multilora_cpu::Isa;
use multilora_cpu::quant::QuantType;

/// Input widths: one block, and several (K-quants: one and two super-blocks).
fn widths(qt: QuantType) -> [usize; 2] {
    if qt.block_elems() == 256 { [256, 512] } else { [32, 160] }
}

/// `(m, n)`: decode-sized and prefill-sized batches, odd column counts (partial tiles).
const SHAPES: [(usize, usize); 11] =
    [(1, 1), (2, 3), (3, 7), (5, 33), (16, 97), (17, 33), (63, 7), (64, 18), (65, 33), (130, 5), (512, 3)];

fn check_type(qt: QuantType, seed: u64) -> anyhow::Result<()> {
    for (s, &(m, n)) in SHAPES.iter().enumerate() {
        let k = widths(qt)[s % 2];
        let (w, deq, bytes) = ggml_weight(qt, n, k, seed + s as u64)?;
        let mins = min_terms(qt, &bytes, n, k);
        let x = Rng::new(seed ^ (0xabc + s as u64)).tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
        for isa in Isa::available_of(&Isa::QUANT) {
            let got = w.forward_with(&x, isa)?;
            ensure_quant_bound(&got, &x, &deq, &mins, &format!("{qt} {isa:?} m={m} n={n} k={k}"))?;
        }
    }
    Ok(())
}

macro_rules! kernel_tests {
    ($($name:ident: $qt:expr,)*) => {$(
        #[test]
        fn $name() -> anyhow::Result<()> {
            check_type($qt, 100)
        }
    )*};
}

kernel_tests! {
    q4_0_products_are_within_the_quantization_bound: QuantType::Q4_0,
    q4_1_products_are_within_the_quantization_bound: QuantType::Q4_1,
    q5_0_products_are_within_the_quantization_bound: QuantType::Q5_0,
    q5_1_products_are_within_the_quantization_bound: QuantType::Q5_1,
    q8_0_products_are_within_the_quantization_bound: QuantType::Q8_0,
    q2_k_products_are_within_the_quantization_bound: QuantType::Q2K,
    q3_k_products_are_within_the_quantization_bound: QuantType::Q3K,
    q4_k_products_are_within_the_quantization_bound: QuantType::Q4K,
    q5_k_products_are_within_the_quantization_bound: QuantType::Q5K,
    q6_k_products_are_within_the_quantization_bound: QuantType::Q6K,
}

#[test]
fn the_bound_rejects_a_product_missing_one_block() -> anyhow::Result<()> {
    for qt in [QuantType::Q4_1, QuantType::Q8_0, QuantType::Q4K, QuantType::Q6K] {
        let (n, k) = (5, 4 * qt.block_elems());
        let (w, deq, bytes) = ggml_weight(qt, n, k, 7)?;
        let mins = min_terms(qt, &bytes, n, k);
        let x = Rng::new(8).tensor(&[3, k], 1.0, DType::F32, &Device::Cpu)?;
        let got = w.forward(&x)?;
        ensure_quant_bound(&got, &x, &deq, &mins, "whole")?;
        // Output (1, 2) without the block of 32 that contributes the most to it.
        let (xr, wr) = (x.i(1)?.to_vec1::<f32>()?, deq.i(2)?.to_vec1::<f32>()?);
        let part = |b: usize| (32 * b..32 * b + 32).map(|p| xr[p] as f64 * wr[p] as f64).sum::<f64>();
        let b = (0..k / 32).max_by(|&a, &c| part(a).abs().total_cmp(&part(c).abs())).unwrap_or(0);
        let mut v = got.to_vec2::<f32>()?;
        v[1][2] -= part(b) as f32;
        let short = Tensor::new(v, &Device::Cpu)?;
        anyhow::ensure!(
            ensure_quant_bound(&short, &x, &deq, &mins, "one block short").is_err(),
            "{qt}: a product missing block {b} passed the bound"
        );
    }
    Ok(())
}

/// Runs `f` inside a rayon pool of `threads` threads.
fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    Ok(rayon::ThreadPoolBuilder::new().num_threads(threads).build()?.install(f))
}

#[test]
fn rows_do_not_depend_on_the_batch_the_threads_or_the_isa() -> anyhow::Result<()> {
    let mut rng = Rng::new(11);
    for (s, qt) in QuantType::ALL.into_iter().enumerate() {
        let (n, k) = (40, 2 * qt.block_elems().max(128));
        let (w, _, _) = ggml_weight(qt, n, k, 30 + s as u64)?;
        let row = rng.tensor(&[1, k], 1.0, DType::F32, &Device::Cpu)?;
        let alone = w.forward_with(&row, Isa::Portable)?;
        let alone_bits = bits(&alone)?;
        for isa in Isa::available_of(&Isa::QUANT) {
            anyhow::ensure!(bits(&w.forward_with(&row, isa)?)? == alone_bits, "{qt} {isa:?}: differs from portable");
            // A decode-sized and a prefill-sized batch, the row at a random place, 1 and 3 threads;
            // and a 16-row step's row group of 8, and a panel of 6 after a whole one (the plain
            // AVX2 set takes a panel of 9 rows or more row-lane, fewer column-lane).
            for (m, threads) in [(64, 1), (64, 3), (300, 1), (300, 3), (8, 1), (22, 3)] {
                let at = rng.range(0, m - 1);
                let others = rng.tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
                let batch =
                    Tensor::cat(&[others.narrow(0, 0, at)?, row.clone(), others.narrow(0, at + 1, m - at - 1)?], 0)?;
                let y = in_pool(threads, || w.forward_with(&batch, isa))??;
                anyhow::ensure!(
                    bits(&y.narrow(0, at, 1)?)? == alone_bits,
                    "{qt} {isa:?}: row {at} of {m} on {threads} threads differs from the row alone"
                );
            }
        }
    }
    Ok(())
}

/// A prefill-sized product whose rows are cut into several blocks (a wide `k`), with panels of
/// the tile unit and rows past the last whole panel: on every set and thread count, each of a
/// few rows spread over the blocks has the bits it has alone.
#[test]
fn row_blocks_and_partial_panels_keep_each_rows_bits() -> anyhow::Result<()> {
    let mut rng = Rng::new(13);
    let (m, n, k) = (201, 24, 8192);
    for (s, qt) in [QuantType::Q4K, QuantType::Q6K, QuantType::Q8_0].into_iter().enumerate() {
        let (w, _, _) = ggml_weight(qt, n, k, 70 + s as u64)?;
        let x = rng.tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
        let alone: Vec<_> = [0, 63, 64, 130, 191, 200]
            .into_iter()
            .map(|i| Ok((i, bits(&w.forward_with(&x.narrow(0, i, 1)?, Isa::Portable)?)?)))
            .collect::<anyhow::Result<_>>()?;
        for isa in Isa::available_of(&Isa::QUANT).into_iter().filter(|&i| i != Isa::Portable) {
            for threads in [1, 3] {
                let y = in_pool(threads, || w.forward_with(&x, isa))??;
                for (i, want) in &alone {
                    anyhow::ensure!(
                        bits(&y.narrow(0, *i, 1)?)? == *want,
                        "{qt} {isa:?} {threads} threads: row {i} of {m} differs from the row alone"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Read-ahead hints (over real buffers, and over addresses nothing is mapped at) change no bit
/// of any product, on any instruction set, in a decode-sized and a prefill-sized batch.
#[test]
fn read_ahead_hints_change_nothing() -> anyhow::Result<()> {
    let mut rng = Rng::new(12);
    let other = vec![1u8; 3 << 20];
    let ranges = [(other.as_ptr() as usize, other.len()), (64, 1 << 20), (usize::MAX - 4096, 4096)];
    for (s, qt) in QuantType::ALL.into_iter().enumerate() {
        let (n, k) = (72, 2 * qt.block_elems().max(128));
        let (w, _, _) = ggml_weight(qt, n, k, 50 + s as u64)?;
        for m in [16, 300] {
            let x = rng.tensor(&[m, k], 1.0, DType::F32, &Device::Cpu)?;
            for isa in Isa::available_of(&Isa::QUANT) {
                let plain = bits(&in_pool(2, || w.forward_with(&x, isa))??)?;
                let ahead = bits(&in_pool(2, || w.forward_ahead(&x, isa, &ranges))??)?;
                anyhow::ensure!(plain == ahead, "{qt} {isa:?} {m} rows: the hints changed the product");
            }
        }
    }
    Ok(())
}

#[test]
fn strided_and_non_f32_inputs() -> anyhow::Result<()> {
    let (w, _, _) = ggml_weight(QuantType::Q4_1, 20, 96, 4)?;
    let xt = Rng::new(3).tensor(&[96, 7], 1.0, DType::F32, &Device::Cpu)?.t()?;
    anyhow::ensure!(!xt.is_contiguous(), "the transposed input should be strided");
    anyhow::ensure!(bits(&w.forward(&xt)?)? == bits(&w.forward(&xt.contiguous()?)?)?, "strided input");
    let xb = xt.to_dtype(DType::BF16)?;
    let y = w.forward(&xb)?;
    anyhow::ensure!(
        y.dtype() == DType::F32 && bits(&y)? == bits(&w.forward(&xb.to_dtype(DType::F32)?)?)?,
        "bf16 input"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn random_shapes_are_within_the_bound(
        t in 0usize..10, m in 1usize..80, n in 1usize..40, blocks in 1usize..4, seed in any::<u64>()
    ) {
        let qt = QuantType::ALL[t];
        let k = blocks * qt.block_elems();
        let run = || -> anyhow::Result<()> {
            let (w, deq, bytes) = ggml_weight(qt, n, k, seed)?;
            let x = Rng::new(seed ^ 1).tensor(&[m, k], 2.0, DType::F32, &Device::Cpu)?;
            ensure_quant_bound(&w.forward(&x)?, &x, &deq, &min_terms(qt, &bytes, n, k), &format!("{qt} m={m} n={n} k={k}"))
        };
        prop_assert!(run().is_ok(), "{:?}", run().err());
    }
}

/// The GGUF file of SmolLM2-135M-Instruct (Q4_1, `scripts/fetch-smollm2.sh`) named by
/// `MULTILORA_SMOLLM2_GGUF`, or `None` after saying the test `name` is skipped (a failure when
/// `MULTILORA_REQUIRE_SMOLLM2=1`).
fn smollm2(name: &str) -> Option<std::path::PathBuf> {
    match std::env::var_os("MULTILORA_SMOLLM2_GGUF") {
        Some(p) => Some(p.into()),
        None if std::env::var("MULTILORA_REQUIRE_SMOLLM2").as_deref() == Ok("1") => {
            panic!("{name}: MULTILORA_REQUIRE_SMOLLM2=1 but MULTILORA_SMOLLM2_GGUF is not set")
        }
        None => {
            println!("SKIPPED {name}: MULTILORA_SMOLLM2_GGUF is not set");
            None
        }
    }
}

#[test]
fn smollm2_tensors_dequantize_and_multiply_as_ggml() -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file;
    let Some(path) = smollm2("smollm2_tensors_dequantize_and_multiply_as_ggml") else { return Ok(()) };
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    for name in ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight", "token_embd.weight"] {
        let q = content.tensor(&mut file, name, &Device::Cpu)?;
        let qt = crate::quant_type(q.dtype()).ok_or_else(|| anyhow::anyhow!("{name}: {:?}", q.dtype()))?;
        let (n, k) = q.shape().dims2()?;
        let bytes = q.data()?;
        let w = crate::QuantWeight::from_bytes(qt, n, k, &bytes)?;
        anyhow::ensure!(
            w.storage_bytes() == bytes.len(),
            "{name}: {} resident bytes for {}",
            w.storage_bytes(),
            bytes.len()
        );
        let deq = q.dequantize(&Device::Cpu)?;
        anyhow::ensure!(bits(&w.dequantize()?)? == bits(&deq)?, "{name}: dequantize differs from candle's");
        let ids = [0u32, 1, 2, n as u32 - 1, 17];
        let want = deq.index_select(&Tensor::new(&ids, &Device::Cpu)?, 0)?;
        anyhow::ensure!(bits(&w.dequantize_rows(&ids)?)? == bits(&want)?, "{name}: rows differ");
        let x = Rng::new(9).tensor(&[3, k], 1.0, DType::F32, &Device::Cpu)?;
        let mins = min_terms(qt, &bytes, n, k);
        for isa in Isa::available_of(&Isa::QUANT) {
            ensure_quant_bound(&w.forward_with(&x, isa)?, &x, &deq, &mins, &format!("{name} {qt} {isa:?}"))?;
        }
    }
    Ok(())
}
