//! Our kernels ship compiled (feature `cuda`): every module's fatbin holds SASS for each
//! architecture it was built for, so a GPU of one of them loads it without compiling PTX, plus
//! the PTX for newer GPUs; and what `fatbin::entries` reads agrees with `cuobjdump`, NVIDIA's own
//! reader, where it is installed (CI installs it: `MULTILORA_REQUIRE_CUOBJDUMP=1` makes it a
//! failure to find none). Every `.cu` file is a module.
#![cfg(feature = "cuda")]

use multilora_kernels::Module;
use multilora_kernels::fatbin::{Code, entries};
use multilora_kernels::fatbins::{PTX, SASS};

#[test]
fn every_module_holds_sass_for_each_target_and_ptx() {
    for m in Module::ALL {
        let e = entries(m.fatbin()).unwrap_or_else(|err| panic!("{}: {err}", m.name()));
        let sass: Vec<&str> = e.iter().filter(|e| e.code == Code::Sass).map(|e| e.arch.as_str()).collect();
        let ptx: Vec<&str> = e.iter().filter(|e| e.code == Code::Ptx).map(|e| e.arch.as_str()).collect();
        assert_eq!(sass, SASS, "{}: SASS entries", m.name());
        assert_eq!(ptx, [PTX], "{}: PTX entries", m.name());
        assert!(e.iter().all(|e| e.bytes > 0), "{}: an empty entry", m.name());
        // An H100 / H200 (9.0) runs the sm_90a entry as it is: nothing compiled on first use.
        assert!(e.iter().any(|e| e.runs_as_is_on(9, 0)), "{}: no SASS an H100 runs as it is", m.name());
    }
}

#[test]
fn every_cu_file_is_a_module() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stems: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "cu").then(|| p.file_stem().unwrap().to_string_lossy().into_owned())
        })
        .collect();
    stems.sort();
    let mut modules: Vec<String> =
        Module::ALL.iter().map(|m| m.name().trim_start_matches("multilora_").to_string()).collect();
    modules.sort();
    assert_eq!(stems, modules);
}

#[test]
fn entries_agree_with_cuobjdump() {
    let found = std::process::Command::new("cuobjdump").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("MULTILORA_REQUIRE_CUOBJDUMP").is_none(),
            "MULTILORA_REQUIRE_CUOBJDUMP is set but cuobjdump cannot be run"
        );
        eprintln!("SKIPPED entries_agree_with_cuobjdump: no cuobjdump on PATH");
        return;
    }
    let dir = std::env::temp_dir().join(format!("multilora-fatbin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for m in Module::ALL {
        let path = dir.join(format!("{}.fatbin", m.name()));
        std::fs::write(&path, m.fatbin()).unwrap();
        let out =
            std::process::Command::new("cuobjdump").args(["--list-elf", "--list-ptx"]).arg(&path).output().unwrap();
        assert!(out.status.success(), "cuobjdump {}: {}", m.name(), String::from_utf8_lossy(&out.stderr));
        // "ELF file    1: name.1.sm_90a.cubin", "PTX file    1: name.1.sm_90.ptx"
        let theirs: Vec<(Code, String)> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let code = if l.starts_with("ELF file") {
                    Code::Sass
                } else if l.starts_with("PTX file") {
                    Code::Ptx
                } else {
                    return None;
                };
                let arch = l.rsplit('.').nth(1)?;
                let arch = match code {
                    Code::Sass => arch.to_string(),
                    Code::Ptx => arch.replacen("sm_", "compute_", 1),
                };
                Some((code, arch))
            })
            .collect();
        let ours: Vec<(Code, String)> = entries(m.fatbin()).unwrap().into_iter().map(|e| (e.code, e.arch)).collect();
        assert_eq!(ours, theirs, "{}: fatbin::entries against cuobjdump", m.name());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
