//! Confinement of runtime sources: local directories must lie inside the allowed roots once `..`
//! and symlinks are resolved, and hub repos are allowed only when hub loading at run time is on.
//! Adapters the operator names at start never pass through here: they are trusted.

use std::path::{Path, PathBuf};

use multilora_adapter::AdapterSource;

use crate::config::StoreConfig;
use crate::error::{Error, Result};

/// Checks a runtime `source` for adapter `name` and returns it with a local path made canonical,
/// so that what is loaded, and loaded again after an eviction, is the directory that was checked.
pub(crate) fn confine(name: &str, source: &AdapterSource, config: &StoreConfig) -> Result<AdapterSource> {
    match source {
        AdapterSource::Local(path) => confine_path(name, path, &config.allowed_roots).map(AdapterSource::Local),
        AdapterSource::Hub { .. } if config.allow_hub_at_runtime => Ok(source.clone()),
        AdapterSource::Hub { repo, .. } => Err(Error::HubDisabled { name: name.to_string(), repo: repo.clone() }),
        // A kind of source added later is refused until this function knows how to confine it.
        other => Err(Error::Adapter(multilora_adapter::Error::Source {
            source_str: other.to_string(),
            reason: "this kind of source is not allowed at run time".to_string(),
        })),
    }
}

/// `path` made canonical, if that lies inside one of `roots` (themselves made canonical; a root
/// that does not exist admits nothing).
pub(crate) fn confine_path(name: &str, path: &Path, roots: &[PathBuf]) -> Result<PathBuf> {
    let canonical = path.canonicalize().map_err(|source| {
        Error::Adapter(multilora_adapter::Error::Io { adapter: name.to_string(), path: path.to_path_buf(), source })
    })?;
    // Component-wise `starts_with`, so `/data/lora-evil` is not inside `/data/lora`.
    let inside = roots.iter().filter_map(|r| r.canonicalize().ok()).any(|root| canonical.starts_with(&root));
    if inside {
        Ok(canonical)
    } else {
        Err(Error::PathOutsideRoots { name: name.to_string(), path: canonical, roots: roots.to_vec() })
    }
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

    #[test]
    fn hub_sources_need_the_switch() {
        let hub = AdapterSource::parse("org/sql-lora").unwrap();
        let mut config = StoreConfig::default();
        assert_eq!(confine("sql", &hub, &config).unwrap_err().kind(), "hub_disabled");
        config.allow_hub_at_runtime = true;
        assert_eq!(confine("sql", &hub, &config).unwrap(), hub);
    }
}
