//! CPU benchmarks of the LoRA layers (filled in below).
fn main() {}
