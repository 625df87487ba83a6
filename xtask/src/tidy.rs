//! `cargo xtask tidy`: every `.rs` file opens with `//!`, no file is over 800 lines, no
//! `todo!`/`unimplemented!` in shipped code, the crate dependency direction of the design holds
//! (read from `cargo metadata`), the shared vocabulary is defined once, in `multilora-types`,
//! and taken from there: never through the path of a crate that relays it, and `unsafe` is
//! allowed only where ARCHITECTURE.md says it lives (all CPU `unsafe` in `multilora-cpu`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const MAX_LINES: usize = 800;

/// Each workspace crate and the workspace crates it may depend on (normal and build dependencies),
/// besides `multilora-types`, which every crate may use and which itself uses none of ours. Pure
/// crates also may not pull in candle or threads of their own.
const ALLOWED: &[(&str, &[&str])] = &[
    ("multilora-types", &[]),
    ("multilora-cpu", &[]),
    ("multilora-adapter", &["multilora-cpu"]),
    ("multilora-prefix-cache", &[]),
    ("multilora-scheduler", &["multilora-prefix-cache"]),
    ("multilora-store", &["multilora-adapter"]),
    ("multilora-kernels", &[]),
    ("multilora-layers", &["multilora-cpu", "multilora-adapter", "multilora-kernels"]),
    ("multilora-models", &["multilora-cpu", "multilora-adapter", "multilora-layers", "multilora-kernels"]),
    (
        "multilora",
        &[
            "multilora-cpu",
            "multilora-adapter",
            "multilora-prefix-cache",
            "multilora-scheduler",
            "multilora-store",
            "multilora-kernels",
            "multilora-layers",
            "multilora-models",
        ],
    ),
    ("multilora-server", &["multilora"]),
    // The binary reads and writes the model formats itself (`plan`: a `config.json`; `demo`:
    // seeded adapters), which the engine's API does not carry (issue #49); it serves through the
    // engine's API only.
    ("multilora-cli", &["multilora", "multilora-server", "multilora-adapter", "multilora-models"]),
    // The GPU check binary: a tool, like xtask, but it reads the layers and the model directly.
    ("multilora-device-check", &["multilora", "multilora-adapter", "multilora-layers", "multilora-models"]),
];

/// Crates that must stay free of tensors and devices (the kernels crate is sources, a build
/// script and plain parameter structs; the CPU kernels take slices: the candle glue of both lives
/// in `multilora-layers`).
const PURE: &[&str] =
    &["multilora-types", "multilora-prefix-cache", "multilora-scheduler", "multilora-kernels", "multilora-cpu"];

/// The one sentence of docs/ARCHITECTURE.md on where `unsafe` lives, kept true by [`check_unsafe_rule`]
/// and [`unsafe_allowances`].
const UNSAFE_RULE: &str = "All CPU `unsafe` lives in `multilora-cpu`";

/// The crates whose code may allow `unsafe`: the CPU kernels, and the CUDA side's.
const UNSAFE_CRATES: &[&str] = &["crates/multilora-cpu/", "crates/multilora-kernels/"];

/// Outside them, the CUDA glue of the layers (launches, page-locked buffers, device copies), its
/// `unsafe` compiled only with the `cuda` feature.
const CUDA_GLUE: &[&str] = &[
    "crates/multilora-layers/src/ops/cuda.rs",
    "crates/multilora-layers/src/upload.rs",
    "crates/multilora-layers/src/readback.rs",
];

/// The bottom crate everyone may use.
const TYPES: &str = "multilora-types";

/// The shared vocabulary: defined in `multilora-types` only, so no crate translates another's copy.
const VOCABULARY: &[&str] = &[
    "struct AdapterId",
    "struct Fingerprint",
    "struct AdapterGen",
    "struct SlotId",
    "struct LoraLimits",
    "enum FinishReason",
    "enum LogitsWanted",
    "struct Histogram",
    "enum ModuleKind",
    "enum StepTime",
];

/// The crates below the engine, as paths are spelled. A name of `multilora-types` is taken from
/// `multilora_types` itself, never through one of these (the engine, `multilora`, re-exports a few
/// for its embedders: that is its public API, and the server and the CLI use it).
const INNER: &[&str] = &[
    "multilora_adapter",
    "multilora_prefix_cache",
    "multilora_scheduler",
    "multilora_store",
    "multilora_kernels",
    "multilora_layers",
    "multilora_models",
];

pub(crate) fn run() -> Result<()> {
    let root = workspace_root()?;
    let mut problems = Vec::new();
    let names = vocabulary_names(&root)?;
    check_files(&root, &names, &mut problems)?;
    check_unsafe_rule(&root, &mut problems)?;
    let users = check_dependencies(&root, &mut problems)?;
    if problems.is_empty() {
        println!("tidy: {TYPES} (depends on none of ours) is used by {}", users.join(", "));
        println!("tidy: ok");
        Ok(())
    } else {
        for p in &problems {
            eprintln!("tidy: {p}");
        }
        bail!("tidy found {} problem(s)", problems.len())
    }
}

fn workspace_root() -> Result<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(Path::to_path_buf).context("xtask has no parent directory")
}

/// The public names of `multilora-types`: what its `lib.rs` exports with `pub use`.
fn vocabulary_names(root: &Path) -> Result<Vec<String>> {
    let lib = root.join("crates/multilora-types/src/lib.rs");
    let text = std::fs::read_to_string(&lib).with_context(|| format!("read {}", lib.display()))?;
    let mut names = Vec::new();
    for stmt in text.split(';') {
        let Some(at) = stmt.find("pub use ") else { continue };
        let tree = &stmt[at + "pub use ".len()..];
        let leaves = match (tree.find('{'), tree.rfind('}')) {
            (Some(open), Some(close)) => &tree[open + 1..close],
            _ => tree.rsplit("::").next().unwrap_or(""),
        };
        names.extend(idents(leaves).filter(|n| *n != "self").map(str::to_string));
    }
    if names.is_empty() {
        bail!("{}: no `pub use` names found", lib.display());
    }
    Ok(names)
}

/// The identifiers in `text`.
fn idents(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|s| !s.is_empty())
}

/// The names a path or use tree starting at `rest` (just after `crate::`) takes: every segment of
/// `a::b::C`, every identifier of a `{…}` group.
fn tree_names(rest: &str) -> Vec<&str> {
    let rest = rest.trim_start();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut depth = 1;
        let mut end = inner.len();
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        return idents(&inner[..end]).collect();
    }
    let len = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
    let mut names = vec![&rest[..len]];
    if let Some(more) = rest[len..].strip_prefix("::") {
        names.extend(tree_names(more));
    }
    names
}

/// Problems for each name of `multilora-types` that `text` takes through an inner crate's path.
fn relayed_vocabulary(rel: &str, text: &str, names: &[String], problems: &mut Vec<String>) {
    for krate in INNER {
        let prefix = format!("{krate}::");
        for (at, _) in text.match_indices(&prefix) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            for name in tree_names(&text[at + prefix.len()..]) {
                if names.iter().any(|n| n == name) {
                    let line = text[..at].matches('\n').count() + 1;
                    problems
                        .push(format!("{rel}:{line}: `{name}` taken through `{krate}`: use multilora_types::{name}"));
                }
            }
        }
    }
}

fn check_files(root: &Path, names: &[String], problems: &mut Vec<String>) -> Result<()> {
    let mut files = Vec::new();
    for dir in ["crates", "xtask", "benches", "tests"] {
        collect_rs(&root.join(dir), &mut files)?;
    }
    for file in files {
        let text = std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?;
        let rel = file.strip_prefix(root).unwrap_or(&file).display().to_string();
        if !text.starts_with("//!") {
            problems.push(format!("{rel}: does not open with a //! line saying what it holds"));
        }
        let lines = text.lines().count();
        if lines > MAX_LINES {
            problems.push(format!("{rel}: {lines} lines, over {MAX_LINES}: split it"));
        }
        unsafe_allowances(&rel, &text, problems);
        let shipped = rel.contains("/src/") && !rel.contains("/tests/");
        if !rel.starts_with("crates/multilora-types/") && !rel.starts_with("xtask/") {
            relayed_vocabulary(&rel, &text, names, problems);
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if let Some(item) =
                    VOCABULARY.iter().find(|v| code.contains(&format!("{v} ")) || code.contains(&format!("{v}(")))
                {
                    problems.push(format!("{rel}:{}: `{item}` is shared vocabulary: use multilora-types'", n + 1));
                }
            }
        }
        if shipped {
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                // Spelled in pieces so that this file does not flag itself.
                let stubs = [concat!("todo", "!("), concat!("unimplemented", "!(")];
                if stubs.iter().any(|s| code.contains(s)) {
                    problems.push(format!("{rel}:{}: stub in shipped code", n + 1));
                }
            }
        }
    }
    Ok(())
}

/// ARCHITECTURE.md states [`UNSAFE_RULE`].
fn check_unsafe_rule(root: &Path, problems: &mut Vec<String>) -> Result<()> {
    let arch = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).context("read docs/ARCHITECTURE.md")?;
    if !arch.contains(UNSAFE_RULE) {
        problems.push(format!("docs/ARCHITECTURE.md: does not say \"{UNSAFE_RULE}\""));
    }
    Ok(())
}

/// [`UNSAFE_RULE`] holds in the file `rel`: outside [`UNSAFE_CRATES`] only the [`CUDA_GLUE`]
/// files allow `unsafe`.
fn unsafe_allowances(rel: &str, text: &str, problems: &mut Vec<String>) {
    // Spelled in pieces so that this file does not flag itself.
    let allow = concat!("allow(unsafe", "_code)");
    if UNSAFE_CRATES.iter().any(|c| rel.starts_with(c)) || CUDA_GLUE.contains(&rel) {
        return;
    }
    for (n, line) in text.lines().enumerate() {
        if line.split("//").next().unwrap_or("").contains(allow) {
            problems.push(format!("{rel}:{}: `unsafe` outside multilora-cpu and the CUDA glue ({UNSAFE_RULE})", n + 1));
        }
    }
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "fixtures") && !name.starts_with('.') {
                collect_rs(&path, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Checks the dependency table; returns the crates that take the shared vocabulary from
/// `multilora-types`.
fn check_dependencies(root: &Path, problems: &mut Vec<String>) -> Result<Vec<String>> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root)
        .output()
        .context("run cargo metadata")?;
    if !output.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&output.stdout).context("parse cargo metadata")?;
    let packages = meta["packages"].as_array().context("metadata has no packages")?;
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut users = Vec::new();
    for package in packages {
        let name = package["name"].as_str().unwrap_or("?");
        if name == "xtask" || name.starts_with("multilora-bench") {
            continue;
        }
        let Some((_, allowed)) = ALLOWED.iter().find(|(n, _)| *n == name) else {
            problems.push(format!(
                "{name}: not in the dependency table of xtask/src/tidy.rs (and the crate table of DESIGN.md)"
            ));
            continue;
        };
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let dep_name = dep["name"].as_str().unwrap_or("?");
            let kind = dep["kind"].as_str();
            if kind == Some("dev") {
                continue;
            }
            if dep_name == TYPES && name != TYPES {
                users.push(name.to_string());
                continue;
            }
            if members.contains(&dep_name) && !allowed.contains(&dep_name) {
                problems.push(format!("{name} depends on {dep_name}, which the design does not allow"));
            }
            if PURE.contains(&name) && dep_name.starts_with("candle") {
                problems.push(format!("{name} is pure and may not depend on {dep_name}"));
            }
        }
    }
    users.sort();
    Ok(users)
}
