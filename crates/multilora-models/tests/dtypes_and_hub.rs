//! Half precision against f32 on the fixture rows, loading by hub id from an offline cache, and
//! the public handle types being `Send + Sync`.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use common::*;
use multilora_adapter::HubConfig;
use multilora_models::{Batch, KvCache, KvCacheConfig, Model, ModelOptions, ModelSource, SeqInput};
use multilora_types::{LogitsWanted, SlotId};

/// bf16 / f16 logits against f32 on every fixture row, one flat batch each.
///
/// Tolerance, documented: the top token agrees at ≥ 95% of positions, and the largest absolute
/// logit difference stays under 0.25 for bf16 (8 mantissa bits, logits up to ~5) and under 0.05 for
/// f16 (11 bits). Observed values are printed.
fn half_precision_tracks_f32(dev: &Device) -> Result<()> {
    let rows = rows(true)?;
    let (f32_model, slots) = model_with_adapters_on(DType::F32, dev)?;
    let reference = Tensor::cat(&run_all_positions(&f32_model, &slots, &rows)?, 0)?;
    for (dtype, tol) in [(DType::BF16, 0.25f32), (DType::F16, 0.05)] {
        let (model, slots) = model_with_adapters_on(dtype, dev)?;
        let got = Tensor::cat(&run_all_positions(&model, &slots, &rows)?, 0)?;
        let same = got.argmax(1)?.eq(&reference.argmax(1)?)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
        let d = max_abs_diff(&got, &reference)?;
        println!("{dtype:?}: top-1 agreement {:.2}%, max abs logit diff {d}", same * 100.0);
        assert!(same >= 0.95, "{dtype:?}: top-1 agreement {same}");
        assert!(d <= tol, "{dtype:?}: max abs diff {d} > {tol}");
    }
    Ok(())
}
test_device!(half_precision_tracks_f32, half_precision_tracks_f32_cpu, half_precision_tracks_f32_cuda);

/// `log_softmax` over the vocabulary, in f32.
fn logprobs(logits: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?)
}

/// A bf16 checkpoint (the fixture's base rounded to bf16 and written out) served in its own
/// dtype, against transformers + PEFT's f32 reference on every fixture row: every prompt
/// logprob within 0.1 and the same top-1 token at ≥ 98% of positions. The `embed_target`
/// adapter carries the base embedding saved in f32, which rounds to the checkpoint's bf16 one:
/// accepted, as PEFT's copy over a bf16 model would change nothing.
#[test]
fn a_bf16_checkpoint_tracks_the_f32_reference() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = bf16_checkpoint(tmp.path())?;
    let cfg = multilora_models::ModelConfig::from_file(&dir.join("config.json"))?;
    assert_eq!(cfg.auto_dtype(), DType::BF16, "the copy names bfloat16");
    let (model, slots) = model_at_with_adapters(&dir, cfg.auto_dtype(), &Device::Cpu)?;
    assert_eq!(model.dtype(), DType::BF16);
    assert_eq!(model.activation_dtype(), DType::F32, "on the CPU the activations stay f32");
    let rows = rows(true)?;
    let got = run_all_positions(&model, &slots, &rows)?;
    let (mut worst, mut same, mut total) = (0f32, 0usize, 0usize);
    for (r, g) in rows.iter().zip(&got) {
        let (lg, lw) = (logprobs(g)?, logprobs(&r.expected)?);
        let d = max_abs_diff(&lg, &lw)?;
        assert!(d <= 0.1, "{} {} ({:?}): max abs logprob diff {d}", r.batch, r.tensor, r.adapter);
        worst = worst.max(d);
        let eq = lg.argmax(1)?.eq(&lw.argmax(1)?)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        same += eq as usize;
        total += r.ids.len();
    }
    let agree = same as f64 / total as f64;
    println!("bf16 checkpoint: max abs logprob diff {worst}, top-1 agreement {:.2}% of {total}", agree * 100.0);
    assert!(agree >= 0.98, "top-1 agreement {agree}");
    Ok(())
}

/// Batch invariance in bf16: each row's logits are the same bits alone and among 64 requests of
/// mixed adapters (prompts of every fixture row, cycled), whatever its neighbours.
#[test]
fn bf16_rows_do_not_depend_on_the_batch() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (model, slots) = model_at_with_adapters(&bf16_checkpoint(tmp.path())?, DType::BF16, &Device::Cpu)?;
    let all = rows(true)?;
    let batch: Vec<Row> = all.iter().cycle().take(64).cloned().collect();
    let together = run_all_positions(&model, &slots, &batch)?;
    for (i, (r, t)) in batch.iter().zip(&together).enumerate().step_by(5) {
        let alone = run_all_positions(&model, &slots, std::slice::from_ref(r))?;
        assert_eq!(
            alone[0].flatten_all()?.to_vec1::<f32>()?,
            t.flatten_all()?.to_vec1::<f32>()?,
            "row {i} ({} {}, {:?}) differs alone and in the batch of 64",
            r.batch,
            r.tensor,
            r.adapter
        );
    }
    Ok(())
}

#[test]
fn loads_by_hub_id_offline_from_the_cache() -> Result<()> {
    let home = tempfile::tempdir()?;
    let hub = home.path().join("hub");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    let snap = hub.join("models--tiny-org--peft-tiny-base").join("snapshots").join(rev);
    std::fs::create_dir_all(&snap)?;
    std::fs::create_dir_all(hub.join("models--tiny-org--peft-tiny-base/refs"))?;
    std::fs::write(hub.join("models--tiny-org--peft-tiny-base/refs/main"), rev)?;
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join("base").join(f), snap.join(f))?;
    }
    let opts = ModelOptions::default().hub(HubConfig::new(&hub, true));
    let source = ModelSource::parse("tiny-org/peft-tiny-base")?;
    assert_eq!(
        source,
        ModelSource::Hub { repo: "tiny-org/peft-tiny-base".into(), revision: "main".into(), gguf_file: None }
    );
    let model = Model::load(&source, &opts)?;
    let local = Model::load(&ModelSource::parse(fixture().join("base").to_str().unwrap_or_default())?, &opts)?;
    let ids = vec![1u32, 294, 488, 497, 479];
    let run = |m: &Model| -> Result<Tensor> {
        let mut kv = m.new_kv_cache(KvCacheConfig::new(2, 8))?;
        Ok(m.forward(
            &Batch::new(vec![SeqInput::new(ids.clone(), 0, vec![1], None).with_logits(LogitsWanted::AllPrompt)]),
            &mut kv,
        )?)
    };
    assert_eq!(max_abs_diff(&run(&model)?, &run(&local)?)?, 0.0);
    assert_eq!(model.shapes(), local.shapes());
    // By commit, and a repo the cache does not hold.
    Model::load(&ModelSource::parse(&format!("tiny-org/peft-tiny-base@{rev}"))?, &opts)?;
    let err = Model::load(&ModelSource::parse("tiny-org/absent")?, &opts).unwrap_err();
    assert_eq!(err.kind(), "hub");
    assert!(err.to_string().contains("tiny-org/absent") && err.to_string().contains("offline"), "{err}");
    Ok(())
}

#[test]
fn capacity_numbers_and_batch_errors() -> Result<()> {
    let (model, _) = model_with_adapters(DType::F32)?;
    // 2 (K, V) · 4 layers · 2 kv heads · 32 · 4 bytes.
    assert_eq!(model.kv_bytes_per_token(), 2 * 4 * 64 * 4);
    let cfg = KvCacheConfig::for_budget(model.config(), DType::F32, 16, 1 << 20);
    assert_eq!(cfg.num_blocks, (1 << 20) / (2 * 4 * 64 * 4 * 16));
    let kv = model.new_kv_cache(cfg)?;
    assert_eq!(kv.nbytes(), cfg.num_blocks as u64 * 16 * model.kv_bytes_per_token());
    assert!(model.lora_slot_bytes() > 0);
    let mut kv = model.new_kv_cache(KvCacheConfig::new(2, 4))?;
    for (seq, kind) in [
        (SeqInput::new(vec![1, 2, 3, 4, 5], 0, vec![0], None), "blocks"),
        (SeqInput::new(vec![600], 0, vec![0], None), "vocabulary"),
        (SeqInput::new(vec![1], 0, vec![9], None), "block 9"),
        (SeqInput::new(vec![1], 0, vec![0], Some(SlotId::new(42))), "slot 42"),
        (SeqInput::new(vec![], 0, vec![0], None), "no new tokens"),
    ] {
        let err = model.forward(&Batch::new(vec![seq]), &mut kv).unwrap_err();
        assert_eq!(err.kind(), "invalid_batch");
        assert!(err.to_string().contains(kind), "{err}");
    }
    Ok(())
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Model>();
    check::<KvCache>();
    check::<multilora_models::Error>();
}
