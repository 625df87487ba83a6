//! Project chores, run as `cargo xtask <task>`: `tidy` checks what the house style asks and a script
//! can see.

mod tidy;

use anyhow::{Result, bail};

fn main() -> Result<()> {
    let task = std::env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "tidy" => tidy::run(),
        _ => bail!(
            "usage: cargo xtask tidy\n  tidy  //! on every .rs file, crate dependency direction, files under 800 lines"
        ),
    }
}
