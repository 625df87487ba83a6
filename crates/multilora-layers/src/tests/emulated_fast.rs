//! The decode-path kernels' own source (`kv_write.cu`, the BGMV-shaped LoRA kernels, the
//! split-context decode attention) run on the CPU by the host emulator with the parameters the
//! host plan makes, against their slow references: f32, bf16 and f16, odd and misaligned shapes
//! (the scalar tails), padding and empty slots, long contexts and GQA groups of 1, 3, 4 and 8.

use candle_core::{DType, Device, Tensor};
use multilora_kernels::{Emulator, kernel};

use super::emulated::{Buffers, bytes_tensor, tensor_bytes};
use super::{Rng, bits};
use crate::ops::kv_write::kv_write_launch;
use crate::paged_kv_write_slow;

/// The KV write against `scatter_set`: a strided source (V as a column range of the fused qkv
/// output), aligned and misaligned rows, a padding slot that writes nothing, in every dtype; the
/// caches must match bit for bit.
#[test]
fn emulated_kv_write_matches_scatter() -> anyhow::Result<()> {
    let Some(emu) = Emulator::for_tests() else { return Ok(()) };
    let dev = &Device::Cpu;
    let mut rng = Rng::new(17);
    // (tokens, width, columns of the fused source before the row, its total width, dtype)
    let cases = [
        (7, 128, 256, 512, DType::BF16),
        (5, 64, 64, 192, DType::F32),
        (9, 256, 512, 768, DType::F16),
        // 15 elements: rows 30 or 60 bytes long, never 16-byte aligned: the scalar tail only.
        (6, 15, 3, 33, DType::BF16),
        (4, 15, 1, 17, DType::F32),
        // Aligned rows with a tail (72 elements = 9 vectors of bf16; 36 f32 = 9 vectors).
        (3, 72, 8, 80, DType::F16),
        (1, 36, 0, 36, DType::F32),
    ];
    for (tokens, width, off, fused, dtype) in cases {
        let num_rows = 40;
        let src = rng.tensor(&[tokens, fused], 1.0, dtype, dev)?;
        let cache0 = rng.tensor(&[num_rows, width], 1.0, dtype, dev)?;
        let mut pool: Vec<u32> = (0..num_rows as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.range(0, i));
        }
        let mut slots: Vec<u32> = pool[..tokens].to_vec();
        // The last token is padding: no row.
        slots[tokens - 1] = u32::MAX;

        let want_k = cache0.copy()?;
        let want_v = cache0.copy()?;
        let live = tokens - 1;
        if live > 0 {
            let rows = src.narrow(0, 0, live)?.narrow(1, off, width)?;
            let idx = Tensor::from_vec(slots[..live].to_vec(), live, dev)?;
            paged_kv_write_slow(&want_k, &want_v, &rows, &rows, &idx)?;
        }

        let mut l = kv_write_launch(tokens, width, fused, dtype, num_rows)?;
        let mut bufs = Buffers::default();
        let s = bufs.add(tensor_bytes(&src)?);
        l.params.src = s + (off * dtype.size_in_bytes()) as u64;
        l.params.slots = bufs.add(slots.iter().flat_map(|v| v.to_le_bytes()).collect());
        l.params.cache = bufs.add(tensor_bytes(&cache0)?);
        emu.launch(kernel::PAGED_KV_WRITE, l.grid, l.block, &l.params.to_bytes(), &mut bufs.0)?;
        let got = bytes_tensor(bufs.get(l.params.cache), dtype, &[num_rows, width])?;
        anyhow::ensure!(
            bits(&got)? == bits(&want_k)?,
            "tokens {tokens} width {width} offset {off} of {fused} {dtype:?}: the cache differs from scatter_set"
        );
    }
    Ok(())
}
