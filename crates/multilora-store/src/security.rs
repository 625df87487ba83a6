//! Confinement of runtime sources: local directories, and the adapter files in them, and GGUF
//! LoRA files must lie inside the allowed roots once `..` and symlinks are resolved, and hub repos are allowed only
//! when hub loading at run time is on or when they are on the allow-list (a hub resolver's). A path outside the roots gets one answer whether it is a
//! directory, a file or nothing, and the answer does not name the roots: a source string is read
//! ([`parse_runtime_source`]) without touching the file system outside them. Adapters the
//! operator names at start never pass through here: they are trusted.

use std::path::{Component, Path, PathBuf};

use multilora_adapter::{CONFIG_FILE, SourceExt, WEIGHTS_FILE};
use multilora_types::AdapterSource;

use crate::config::StoreConfig;
use crate::error::{Error, Result};

/// Checks a runtime `source` for adapter `name` and returns it with a local path made canonical,
/// so that what is loaded, and loaded again after an eviction, is the directory that was checked.
pub(crate) fn confine(name: &str, source: &AdapterSource, config: &StoreConfig) -> Result<AdapterSource> {
    match source {
        AdapterSource::Local(path) => confine_path(name, path, &config.allowed_roots).map(AdapterSource::Local),
        AdapterSource::Gguf(path) => confine_path(name, path, &config.allowed_roots).map(AdapterSource::Gguf),
        AdapterSource::Hub { .. } if config.allow_hub_at_runtime => Ok(source.clone()),
        AdapterSource::Hub { repo, .. } if config.allowed_hub_repos.iter().any(|r| r == repo) => Ok(source.clone()),
        AdapterSource::Hub { repo, .. } => Err(Error::HubDisabled { name: name.to_string(), repo: repo.clone() }),
    }
}

/// Reads a client's source string for adapter `name` as [`AdapterSource::parse`] does, except
/// that the file system is asked about it only when it names a place inside an allowed root: a
/// string that lies lexically inside a root is parsed (a directory, or the error saying it is a
/// file or missing), a valid hub id `org/name[@revision]` outside them is a hub source (refused
/// by [`confine`] unless hub loading at run time is on), and anything else is
/// [`Error::PathOutsideRoots`], the same for a directory, a file and nothing at all.
pub(crate) fn parse_runtime_source(name: &str, source: &str, config: &StoreConfig) -> Result<AdapterSource> {
    let lexical = lexically_absolute(Path::new(source));
    let inside = config.allowed_roots.iter().any(|root| {
        lexical.starts_with(lexically_absolute(root)) || root.canonicalize().is_ok_and(|r| lexical.starts_with(r))
    });
    if inside {
        // A link inside a root that leads out of it is outside, whatever it leads to.
        if Path::new(source).exists() {
            confine_path(name, Path::new(source), &config.allowed_roots)?;
        }
        let parsed = AdapterSource::parse(source)?;
        return confine(name, &parsed, config);
    }
    match hub_id(source) {
        Some((repo, revision)) => confine(name, &AdapterSource::Hub { repo, revision }, config),
        None => Err(Error::PathOutsideRoots { name: name.to_string(), path: PathBuf::from(source) }),
    }
}

/// `org/name[@revision]` as the hub takes it (the adapter crate's rule, checked here without
/// asking the file system whether a local path of that name exists).
fn hub_id(source: &str) -> Option<(String, String)> {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && !p.contains("..")
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let (repo, revision) = source.split_once('@').unwrap_or((source, "main"));
    let revision_ok = !revision.is_empty()
        && revision.len() <= 128
        && !revision.contains("..")
        && revision.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    let (org, repo_name) = repo.split_once('/')?;
    (part(org) && part(repo_name) && revision_ok).then(|| (repo.to_string(), revision.to_string()))
}

/// `path` made canonical, if that lies inside one of `roots` (themselves made canonical; a root
/// that does not exist admits nothing), and so do the adapter files in it once their own
/// symlinks are resolved. A path outside the roots is refused the same way whether it exists or
/// not, so the error cannot be used to probe which paths exist; only a path that would lie inside
/// a root is reported missing.
pub(crate) fn confine_path(name: &str, path: &Path, roots: &[PathBuf]) -> Result<PathBuf> {
    let canonical_roots: Vec<PathBuf> = roots.iter().filter_map(|r| r.canonicalize().ok()).collect();
    let outside = || Error::PathOutsideRoots { name: name.to_string(), path: path.to_path_buf() };
    let canonical = match path.canonicalize() {
        Ok(c) => c,
        Err(source) => {
            let lexical = lexically_absolute(path);
            return if canonical_roots.iter().any(|root| lexical.starts_with(root)) {
                Err(Error::Adapter(multilora_adapter::Error::Io {
                    adapter: name.to_string(),
                    path: path.to_path_buf(),
                    source,
                }))
            } else {
                Err(outside())
            };
        }
    };
    // Component-wise `starts_with`, so `/data/lora-evil` is not inside `/data/lora`.
    let Some(root) = canonical_roots.iter().find(|root| canonical.starts_with(root)) else {
        return Err(outside());
    };
    for file in [CONFIG_FILE, WEIGHTS_FILE] {
        if let Ok(target) = canonical.join(file).canonicalize()
            && !target.starts_with(root)
        {
            return Err(Error::PathOutsideRoots { name: name.to_string(), path: path.join(file) });
        }
    }
    Ok(canonical)
}

/// `path` made absolute and its `.` and `..` resolved by name alone (it may not exist).
fn lexically_absolute(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut out = PathBuf::new();
    for component in absolute.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_dot_and_sibling_prefixes_escape_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("loras");
        std::fs::create_dir_all(root.join("sql")).unwrap();
        std::fs::create_dir_all(tmp.path().join("loras-evil")).unwrap();
        std::fs::create_dir_all(tmp.path().join("secret")).unwrap();
        let roots = vec![root.clone()];

        let ok = confine_path("sql", &root.join("sql"), &roots).unwrap();
        assert_eq!(ok, root.join("sql").canonicalize().unwrap());
        for escape in [root.join("../secret"), root.join("sql/../../secret"), tmp.path().join("loras-evil")] {
            let err = confine_path("x", &escape, &roots).unwrap_err();
            assert_eq!(err.kind(), "path_outside_roots", "{}", escape.display());
            assert!(err.to_string().contains("outside the allowed roots"), "{err}");
        }
        let missing = confine_path("x", &root.join("nope"), &roots).unwrap_err();
        assert_eq!(missing.kind(), "io");
        // Outside the roots, a missing path and an existing one read the same: nothing to probe.
        let absent = confine_path("x", &tmp.path().join("absent"), &roots).unwrap_err();
        let present = confine_path("x", &tmp.path().join("secret"), &roots).unwrap_err();
        assert_eq!((absent.kind(), present.kind()), ("path_outside_roots", "path_outside_roots"));
        let strip = |e: &Error, p: &Path| e.to_string().replace(&p.display().to_string(), "P");
        assert_eq!(
            strip(&absent, &tmp.path().join("absent")),
            strip(&present, &tmp.path().join("secret")),
            "the two refusals differ only by the path given"
        );
        assert_eq!(confine_path("sql", &root.join("sql"), &[]).unwrap_err().kind(), "path_outside_roots");
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_out_of_the_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("loras");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(tmp.path().join("outside")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("outside"), root.join("link")).unwrap();
        let err = confine_path("link", &root.join("link"), std::slice::from_ref(&root)).unwrap_err();
        assert_eq!(err.kind(), "path_outside_roots");
    }

    /// A directory inside the root whose config or weights file is a symlink out of it.
    #[cfg(unix)]
    #[test]
    fn a_file_symlinked_out_of_the_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("loras");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::create_dir_all(root.join("b")).unwrap();
        std::fs::write(tmp.path().join("secret.json"), "{}").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret.json"), root.join("a").join(CONFIG_FILE)).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret.json"), root.join("b").join(WEIGHTS_FILE)).unwrap();
        let roots = std::slice::from_ref(&root);
        for dir in ["a", "b"] {
            let err = confine_path(dir, &root.join(dir), roots).unwrap_err();
            assert_eq!(err.kind(), "path_outside_roots", "{dir}: {err}");
        }
        // A symlink that stays inside the root is fine.
        std::fs::create_dir_all(root.join("c")).unwrap();
        std::fs::write(root.join("shared.json"), "{}").unwrap();
        std::os::unix::fs::symlink(root.join("shared.json"), root.join("c").join(CONFIG_FILE)).unwrap();
        assert!(confine_path("c", &root.join("c"), roots).is_ok());
    }

    /// A client's source string outside the roots: a missing directory, an existing directory,
    /// an existing file, a path through `..`, and a link out of a root all get one answer, which
    /// names neither the roots nor anything about the file system; inside a root the answer may
    /// say what is wrong.
    #[test]
    fn one_answer_for_every_path_outside_the_roots() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("loras");
        std::fs::create_dir_all(root.join("dir")).unwrap();
        std::fs::create_dir_all(tmp.path().join("secret")).unwrap();
        std::fs::write(tmp.path().join("secret.txt"), "x").unwrap();
        std::fs::write(root.join("file.txt"), "x").unwrap();
        let config = StoreConfig::default().allowed_root(&root);
        let answer = |source: &std::path::Path| {
            let source = source.display().to_string();
            let err = parse_runtime_source("x", &source, &config).unwrap_err();
            (err.kind(), err.to_string().replace(&source, "P"))
        };
        std::fs::write(tmp.path().join("secret.gguf"), "GGUF").unwrap();
        let mut outside = vec![
            tmp.path().join("absent"),
            tmp.path().join("secret.gguf"),
            root.join("../secret.gguf"),
            tmp.path().join("secret"),
            tmp.path().join("secret.txt"),
            root.join("../secret.txt"),
            std::path::PathBuf::from("/dev/null"),
        ];
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(tmp.path().join("secret.txt"), root.join("to-file")).unwrap();
            std::os::unix::fs::symlink(tmp.path().join("secret"), root.join("to-dir")).unwrap();
            std::os::unix::fs::symlink(tmp.path().join("secret.gguf"), root.join("to.gguf")).unwrap();
            outside.extend([root.join("to-file"), root.join("to-dir"), root.join("to.gguf")]);
        }
        let answers: Vec<_> = outside.iter().map(|p| answer(p)).collect();
        let want = ("path_outside_roots", r#"adapter "x": source P is outside the allowed roots"#.to_string());
        for (path, got) in outside.iter().zip(&answers) {
            assert_eq!(got, &want, "{}", path.display());
        }
        let roots = root.display().to_string();
        assert!(answers.iter().all(|(_, m)| !m.contains(&roots)), "the roots are not named");
        // A hub id outside the roots is a hub source (refused with hub loading off), whether a
        // relative path of that name is a file (the tests run in the crate's directory), a
        // directory or nothing.
        for hub in ["org/name", "src/lib.rs", "tests/common", "org/name@v1"] {
            assert_eq!(parse_runtime_source("x", hub, &config).unwrap_err().kind(), "hub_disabled", "{hub}");
        }
        // Inside the root: a directory is served, a GGUF LoRA file too (made canonical, so a link
        // inside the root to one inside it is the file itself), a file of another kind or a
        // missing path is named as such.
        assert!(parse_runtime_source("x", &root.join("dir").display().to_string(), &config).is_ok());
        std::fs::write(root.join("dir/pirate.gguf"), "GGUF").unwrap();
        let gguf = parse_runtime_source("x", &root.join("dir/../dir/pirate.gguf").display().to_string(), &config);
        assert_eq!(gguf.unwrap(), AdapterSource::Gguf(root.join("dir/pirate.gguf").canonicalize().unwrap()));
        for inside in [root.join("file.txt"), root.join("missing")] {
            let err = parse_runtime_source("x", &inside.display().to_string(), &config).unwrap_err();
            assert_eq!(err.kind(), "source", "{}: {err}", inside.display());
        }
    }

    #[test]
    fn hub_sources_need_the_switch() {
        let hub = AdapterSource::parse("org/sql-lora").unwrap();
        let mut config = StoreConfig::default();
        assert_eq!(confine("sql", &hub, &config).unwrap_err().kind(), "hub_disabled");
        config.allowed_hub_repos.push("org/other".into());
        assert_eq!(confine("sql", &hub, &config).unwrap_err().kind(), "hub_disabled");
        config.allowed_hub_repos.push("org/sql-lora".into());
        assert_eq!(confine("sql", &hub, &config).unwrap(), hub);
        config.allowed_hub_repos.clear();
        config.allow_hub_at_runtime = true;
        assert_eq!(confine("sql", &hub, &config).unwrap(), hub);
    }
}
