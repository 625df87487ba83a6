//! The CPU decode attention ([`decode_attention_rows`]) against the gathered oracle
//! ([`paged_decode_attention_slow`]), and its exponential against f64's, on every instruction set
//! this CPU has.

use candle_core::{DType, Device, Tensor};
use multilora_cpu::Isa;

use super::{Rng, bits, rel_err};
use crate::ops::attention::cpu::decode_attention_rows_with;
use crate::{PagedDecodeDims, decode_attention_rows, paged_decode_attention_slow};

/// GQA groups of 1 to 4, head sizes with and without a vector tail (and past one pass of the
/// one-pass kernel's 64 columns), blocks of 16 and 5 tokens, contexts from 1 to past four blocks
/// through shuffled block tables, and contexts of up to 2,600 keys (attended in parts, merged);
/// f32, bf16 and f16 caches; on every instruction set this CPU has
/// (AVX-512 takes the one-pass kernel where the shape allows). Each row is then run alone and
/// must give the same bits as in the batch.
#[test]
fn decode_rows_match_the_oracle_and_are_batch_invariant() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    // The last two: contexts past two parts of `DECODE_PART` keys, attended in parts and merged.
    let cases = [
        (5, 9, 3, 64, 16, DType::F32, 70usize),
        (3, 4, 4, 40, 5, DType::F32, 70),
        (4, 8, 2, 64, 16, DType::BF16, 70),
        (2, 4, 1, 24, 16, DType::F16, 70),
        (6, 2, 2, 128, 5, DType::F32, 70),
        (4, 9, 3, 64, 16, DType::F16, 70),
        (3, 6, 3, 80, 16, DType::F16, 70),
        (3, 10, 2, 96, 4, DType::BF16, 70),
        (3, 9, 3, 64, 16, DType::F16, 2600),
        (3, 6, 3, 40, 16, DType::F32, 2600),
    ];
    for (n, heads, kv_heads, hd, bs, dtype, max_len) in cases {
        let d = PagedDecodeDims { heads, kv_heads, head_dim: hd, block_size: bs };
        let num_blocks = max_len.div_ceil(bs).max(20) + 4;
        let (mut lens, mut tables, mut max_blocks) = rng.paged_contexts(n, bs, num_blocks, max_len);
        // A long case draws again until one context takes three parts.
        while max_len > 70 && lens.iter().all(|&l| l <= 2048) {
            (lens, tables, max_blocks) = rng.paged_contexts(n, bs, num_blocks, max_len);
        }
        let rows: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let t = &tables[s * max_blocks..];
                (0..len).map(|p| t[(p as usize) / bs] * bs as u32 + p % bs as u32).collect()
            })
            .collect();
        let q = rng.tensor(&[n, heads, hd], 0.5, DType::F32, &dev)?;
        let k = rng.tensor(&[num_blocks * bs, kv_heads * hd], 1.0, dtype, &dev)?;
        let v = rng.tensor(&[num_blocks * bs, kv_heads * hd], 1.0, dtype, &dev)?;
        let bt = Tensor::from_vec(tables.clone(), (n, max_blocks), &dev)?;
        let cl = Tensor::from_vec(lens.clone(), n, &dev)?;
        let want = paged_decode_attention_slow(
            &q.to_dtype(DType::F32)?,
            &k.to_dtype(DType::F32)?,
            &v.to_dtype(DType::F32)?,
            &bt,
            &cl,
            d,
        )?;
        for isa in Isa::available_of(&Isa::FLOAT) {
            let got = decode_attention_rows_with(isa, &q, &k, &v, &rows, d)?.expect("f32 queries over a CPU cache");
            let err = rel_err(&got, &want)?;
            let case = format!("n {n} heads {heads}/{kv_heads} d {hd} bs {bs} {dtype:?} {isa:?}");
            anyhow::ensure!(err <= 1e-6, "{case}: relative error {err:e}");
            for (i, r) in rows.iter().enumerate() {
                let q1 = q.narrow(0, i, 1)?;
                let alone = decode_attention_rows_with(isa, &q1, &k, &v, std::slice::from_ref(r), d)?.expect("cpu");
                anyhow::ensure!(bits(&alone)? == bits(&got.narrow(0, i, 1)?)?, "{case}: row {i} differs alone");
            }
        }
        let best = decode_attention_rows(&q, &k, &v, &rows, d)?.expect("cpu");
        let on_best = decode_attention_rows_with(Isa::best(), &q, &k, &v, &rows, d)?.expect("cpu");
        anyhow::ensure!(bits(&best)? == bits(&on_best)?, "the default is the best instruction set");
    }
    Ok(())
}

/// A cache row past the end, an empty context and a query of the wrong shape are errors; a
/// query that is not f32 is left to the general path.
#[test]
fn decode_rows_refuse_bad_operands() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let d = PagedDecodeDims { heads: 4, kv_heads: 2, head_dim: 8, block_size: 4 };
    let q = Tensor::zeros((1, 4, 8), DType::F32, &dev)?;
    let c = Tensor::zeros((8, 16), DType::F32, &dev)?;
    assert!(decode_attention_rows(&q, &c, &c, &[vec![0, 8]], d).is_err(), "a row past the cache");
    assert!(decode_attention_rows(&q, &c, &c, &[vec![]], d).is_err(), "an empty context");
    assert!(decode_attention_rows(&q, &c, &c, &[vec![0], vec![1]], d).is_err(), "two rows for one query");
    let wide = Tensor::zeros((8, 12), DType::F32, &dev)?;
    assert!(decode_attention_rows(&q, &wide, &wide, &[vec![0]], d).is_err(), "a cache of the wrong width");
    let half = q.to_dtype(DType::BF16)?;
    assert!(decode_attention_rows(&half, &c, &c, &[vec![0]], d)?.is_none(), "bf16 queries");
    Ok(())
}
