//! Where an adapter's files are: [`AdapterSource`], the one spelling of it that the adapter
//! loader reads, the store registers, resolvers answer and embedders name. Parsing a client's
//! string and fetching a hub repository live with the loader (`multilora_adapter::SourceExt`).

use std::fmt;
use std::path::PathBuf;

/// An adapter's source. Exhaustive, like the other shared enums: every crate that reads one
/// handles every kind.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AdapterSource {
    /// A directory holding `adapter_config.json` and `adapter_model.safetensors`.
    Local(PathBuf),
    /// A llama.cpp LoRA file (`convert_lora_to_gguf.py`'s output, named `*.gguf`).
    Gguf(PathBuf),
    /// A hub repository at a revision (branch, tag or commit; `main` by default).
    Hub {
        /// `org/name`.
        repo: String,
        /// The revision.
        revision: String,
    },
}

impl fmt::Display for AdapterSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdapterSource::Local(dir) | AdapterSource::Gguf(dir) => write!(f, "{}", dir.display()),
            AdapterSource::Hub { repo, revision } if revision == "main" => f.write_str(repo),
            AdapterSource::Hub { repo, revision } => write!(f, "{repo}@{revision}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_path_or_the_repo_and_a_non_default_revision() {
        assert_eq!(AdapterSource::Local(PathBuf::from("a/b")).to_string(), "a/b");
        let hub = |rev: &str| AdapterSource::Hub { repo: "org/x".into(), revision: rev.into() };
        assert_eq!(hub("main").to_string(), "org/x");
        assert_eq!(hub("v2").to_string(), "org/x@v2");
    }
}
