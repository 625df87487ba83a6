//! Writes the adapters of the llama.cpp comparison (`benches/peers/compare.py`): eight LoRA
//! adapters for SmolLM2-135M-Instruct, each as a llama.cpp GGUF LoRA file (what llama.cpp serves;
//! this engine serves the same files): the fixture's `pirate` and `shout` as llama.cpp's
//! converter wrote them, and six seeded PEFT adapters (ranks 4–32 over different modules)
//! written as llama.cpp's converter would write them.
//!
//! `cargo run --release -p multilora-adapter --example peer_adapters -- OUT_DIR`

use std::path::PathBuf;

use multilora_adapter::{LoadOptions, ModelShapes, SyntheticAdapter};
use multilora_types::ModuleKind;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: peer_adapters OUT_DIR")?);
    std::fs::create_dir_all(&out)?;
    // SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, vocab 49152, 9 heads / 3 KV heads.
    let shapes = ModelShapes::llama(30, 576, 1536, 49152, 9, 3);
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2/gguf-lora");
    for name in ["pirate", "shout"] {
        std::fs::copy(fixtures.join(format!("{name}.gguf")), out.join(format!("{name}.gguf")))?;
    }
    use ModuleKind::{DownProj as D, GateProj as G, KProj as K, OProj as O, QProj as Q, UpProj as U, VProj as V};
    let synthetic: [(&str, usize, &[ModuleKind]); 6] = [
        ("s1", 8, &[Q, V]),
        ("s2", 16, &[Q, K, V, O]),
        ("s3", 4, &[Q, K, V, O, G, U, D]),
        ("s4", 32, &[Q, V]),
        ("s5", 16, &[G, U, D]),
        ("s6", 8, &[Q, K, V, O, G, U, D]),
    ];
    let tmp = out.join("peft");
    for (k, (name, rank, targets)) in synthetic.iter().enumerate() {
        let dir = tmp.join(name);
        SyntheticAdapter::new(*rank, targets, 0x5EED + k as u64).write(&dir, &shapes)?;
        let adapter = multilora_adapter::load_dir(name, &dir, &shapes, &LoadOptions::default().max_lora_rank(64))?;
        multilora_adapter::write_gguf_lora(&adapter, &shapes, &out.join(format!("{name}.gguf")))?;
    }
    std::fs::remove_dir_all(&tmp)?;
    println!("{}", out.display());
    Ok(())
}
