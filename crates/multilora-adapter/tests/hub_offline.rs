//! Loading by hub repo id with no network: the fixture adapter laid out as the Hugging Face cache
//! lays it out, under a temporary `HF_HOME`, with `HF_HUB_OFFLINE=1`.
//!
//! This file holds one test so that setting the process environment cannot race another test.

mod common;

use common::{base_shapes, fixtures};
use multilora_adapter::{HubConfig, LoadOptions, SourceExt};
use multilora_types::AdapterSource;

/// Lays out `models--org--name/{refs/main, snapshots/<rev>/…, blobs/…}` as `huggingface_hub` does.
fn lay_out_cache(hub: &std::path::Path, repo: &str, rev: &str) {
    let root = hub.join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::create_dir_all(root.join("snapshots").join(rev)).unwrap();
    std::fs::write(root.join("refs/main"), rev).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        let blob = root.join("blobs").join(format!("blob-{file}"));
        std::fs::copy(fixtures().join("adapters/qv_r8").join(file), &blob).unwrap();
        std::os::unix::fs::symlink(&blob, root.join("snapshots").join(rev).join(file)).unwrap();
    }
}

#[test]
fn loads_by_repo_id_from_the_cache_offline() {
    let home = tempfile::tempdir().unwrap();
    let rev = "0123456789abcdef0123456789abcdef01234567";
    lay_out_cache(&home.path().join("hub"), "acme/qv-lora", rev);
    // SAFETY: this test binary runs this single test, so no other thread reads the environment.
    unsafe {
        std::env::set_var("HF_HOME", home.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
    }
    let shapes = base_shapes();
    let opts = LoadOptions::default();
    let local = multilora_adapter::load_dir("qv", &fixtures().join("adapters/qv_r8"), &shapes, &opts).unwrap();

    for spec in ["acme/qv-lora", &format!("acme/qv-lora@{rev}")] {
        let source = AdapterSource::parse(spec).unwrap();
        assert!(matches!(source, AdapterSource::Hub { .. }));
        let adapter = multilora_adapter::load("qv", &source, &shapes, &opts).unwrap();
        assert_eq!(adapter.fingerprint(), local.fingerprint(), "{spec}");
    }

    // Not cached and offline: a clear error naming the repo, not a network attempt.
    let err = multilora_adapter::load("x", &AdapterSource::parse("acme/absent").unwrap(), &shapes, &opts).unwrap_err();
    assert_eq!(err.kind(), "hub");
    assert!(err.to_string().contains("acme/absent") && err.to_string().contains("offline"), "{err}");

    // Explicit settings work the same without the environment.
    let hub = HubConfig::new(home.path().join("hub"), true);
    let dir = AdapterSource::parse("acme/qv-lora").unwrap().resolve_with(&hub).unwrap();
    assert!(dir.join("adapter_config.json").exists());
}
