//! The fuzz targets' mutator, shared by the adapter, model and server crates' targets: the fuzzer's
//! input bytes, read four at a time, are edits applied to a valid seed file (overwrite, insert or
//! delete a byte, splice in a value a parser finds hostile, duplicate a span), so random inputs
//! reach deep into a parser instead of failing at its first byte.

/// Values that break parsers: huge, negative, non-finite, deep, empty, wrong-typed.
const HOSTILE: &[&str] = &[
    "1000000000",
    "-1",
    "1e309",
    "-0",
    "18446744073709551616",
    "null",
    "[]",
    "{}",
    "\"\"",
    "true",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
    "\"\\ud800\"",
    "\u{FEFF}",
    "NaN",
];

/// `seed` with the edits `ops` describes applied in order.
pub(crate) fn mutate(seed: &[u8], ops: &[u8]) -> Vec<u8> {
    let mut out = seed.to_vec();
    for op in ops.chunks_exact(4) {
        let at = usize::from(u16::from_le_bytes([op[1], op[2]]));
        let at = if out.is_empty() { 0 } else { at % (out.len() + 1) };
        match op[0] % 5 {
            0 if at < out.len() => out[at] = op[3],
            1 => out.insert(at, op[3]),
            2 if at < out.len() => {
                out.remove(at);
            }
            3 => {
                let v = HOSTILE[usize::from(op[3]) % HOSTILE.len()].as_bytes();
                out.splice(at..at, v.iter().copied());
            }
            4 => {
                let end = (at + usize::from(op[3])).min(out.len());
                let span = out[at.min(end)..end].to_vec();
                out.splice(end..end, span);
            }
            _ => {}
        }
        if out.len() > 1 << 20 {
            out.truncate(1 << 20);
        }
    }
    out
}
