//! The engine's public surface, held to a checked-in list (`tests/public_api.txt`) and to the
//! "API boundary" section of `docs/ARCHITECTURE.md`: a name added to or removed from `src/lib.rs`
//! fails here until the list and the doc change with it.
//!
//! The surface is read from `lib.rs` by a plain text scan (every public name is exported there:
//! `pub use` of private modules, as the house style asks), so no new dependency is needed.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn read(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The names `lib.rs` makes public: each leaf (or `as` alias) of its `pub use` trees, and its
/// `pub mod` / `pub fn` / `pub struct` / … items.
fn public_names(lib: &str) -> BTreeSet<String> {
    let code: Vec<&str> = lib.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
    let code = code.join("\n");
    let mut names = BTreeSet::new();
    for stmt in code.split(';') {
        let Some(at) = stmt.find("pub use ") else { continue };
        for item in stmt[at + "pub use ".len()..].split(['{', '}', ',']) {
            let item = item.split_whitespace().collect::<Vec<_>>().join(" ");
            let name = match item.split_once(" as ") {
                Some((_, alias)) => alias,
                None => item.rsplit("::").next().unwrap_or(""),
            };
            if !name.is_empty() && name != "self" {
                names.insert(name.to_string());
            }
        }
    }
    let kinds = ["mod", "fn", "struct", "enum", "trait", "type", "const", "static"];
    for line in code.lines() {
        let Some(rest) = line.strip_prefix("pub ") else { continue };
        for kind in kinds {
            if let Some(item) = rest.strip_prefix(kind).and_then(|r| r.strip_prefix(' ')) {
                let name: String = item.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                names.insert(name);
            }
        }
    }
    names
}

/// The checked-in list: one name a line, `#` lines and blank lines skipped.
fn listed() -> BTreeSet<String> {
    read("tests/public_api.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_public_surface_is_the_checked_in_list() {
    let surface = public_names(&read("src/lib.rs"));
    let list = listed();
    let added: Vec<_> = surface.difference(&list).collect();
    let removed: Vec<_> = list.difference(&surface).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "the public API of multilora changed: new in src/lib.rs {added:?}, gone from it {removed:?}; \
         update tests/public_api.txt and docs/ARCHITECTURE.md's \"API boundary\" with it"
    );
}

#[test]
fn every_public_name_is_in_the_architecture_api_boundary() {
    let doc = read("../../docs/ARCHITECTURE.md");
    let start = doc.find("\n## API boundary").expect("docs/ARCHITECTURE.md has an \"## API boundary\" section");
    let section = &doc[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |end| end + 3)];
    let words: BTreeSet<&str> = section.split(|c: char| !(c.is_alphanumeric() || c == '_')).collect();
    let missing: Vec<_> = listed().into_iter().filter(|n| !words.contains(n.as_str())).collect();
    assert!(missing.is_empty(), "public names missing from ARCHITECTURE.md's \"API boundary\": {missing:?}");
}

/// The scan itself, on a small `lib.rs`.
#[test]
fn the_scan_reads_use_trees_aliases_and_items() {
    let lib = "//! pub use doc::Ignored;\nmod a;\npub use a::{B, c::{D, E as F}};\n/// x\npub use g::H;\n\
               pub(crate) use i::J;\npub mod k;\npub fn l() {}\npub const M: u8 = 0;\n";
    let names: Vec<String> = public_names(lib).into_iter().collect();
    assert_eq!(names, ["B", "D", "F", "H", "M", "k", "l"]);
}
