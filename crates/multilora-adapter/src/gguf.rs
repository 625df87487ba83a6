//! GGUF, llama.cpp's file format: the vocabulary the base-model reader (`multilora-models`) and
//! the GGUF LoRA reader ([`crate::load_gguf_lora`]) share. The files themselves are read with
//! candle's `gguf_file`; what is here is what candle does not give:
//!
//! - ggml's tensor names of each PEFT module ([`gguf_name`], [`module_of`]);
//! - the row order llama.cpp's converter gives the q / k projections of a llama-layout model
//!   ([`unpermute_rows`]), so that weights and adapters trained on the Hugging Face layout apply
//!   unchanged;
//! - the name of every ggml tensor type ([`ggml_type_name`]), and [`scan_tensor_types`], a walk of
//!   the header that finds which tensor has a type candle refuses (candle's error gives only the
//!   type's number), so the refusal names the tensor and its type.

use std::io::{Read, Seek, SeekFrom};

use multilora_types::ModuleKind;

use crate::module::ModuleId;

/// ggml's name of a tensor type id (`ggml_type` in ggml.h), or `"unknown"`.
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

/// The ggml name of a module's weight, as llama.cpp's converters write it: `blk.N.attn_q.weight`,
/// `token_embd.weight`, `output.weight`.
pub fn gguf_name(module: ModuleId) -> String {
    let stem = match module.kind {
        ModuleKind::EmbedTokens => return "token_embd.weight".to_string(),
        ModuleKind::LmHead => return "output.weight".to_string(),
        ModuleKind::QProj => "attn_q",
        ModuleKind::KProj => "attn_k",
        ModuleKind::VProj => "attn_v",
        ModuleKind::OProj => "attn_output",
        ModuleKind::GateProj => "ffn_gate",
        ModuleKind::UpProj => "ffn_up",
        ModuleKind::DownProj => "ffn_down",
    };
    format!("blk.{}.{stem}.weight", module.layer.unwrap_or(0))
}

/// The module a ggml weight name (`blk.N.attn_q.weight`, …; without a `.lora_a` suffix) belongs
/// to, if it is one a LoRA can target.
pub fn module_of(name: &str) -> Option<ModuleId> {
    match name {
        "token_embd.weight" => return Some(ModuleId::embed_tokens()),
        "output.weight" => return Some(ModuleId::lm_head()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?.strip_suffix(".weight")?;
    let (layer, stem) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    let kind = match stem {
        "attn_q" => ModuleKind::QProj,
        "attn_k" => ModuleKind::KProj,
        "attn_v" => ModuleKind::VProj,
        "attn_output" => ModuleKind::OProj,
        "ffn_gate" => ModuleKind::GateProj,
        "ffn_up" => ModuleKind::UpProj,
        "ffn_down" => ModuleKind::DownProj,
        _ => return None,
    };
    Some(ModuleId::layer(layer.parse().ok()?, kind))
}

/// The Hugging Face row order of a llama-layout q or k projection stored by llama.cpp's
/// converter: `rows` output rows (`n_head` heads of `rows / n_head`), each head's two rotary
/// halves interleaved for ggml's RoPE (`LlamaModel.permute`). Entry `i` is the stored row that
/// holds Hugging Face row `i`. `None` unless `n_head` divides `rows` into even head sizes.
///
/// The converter maps Hugging Face row `h·d + s·d/2 + j` (head `h` of size `d`, half `s`,
/// index `j`) to stored row `h·d + 2j + s`.
pub fn unpermute_rows(rows: usize, n_head: usize) -> Option<Vec<usize>> {
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return None;
    }
    let d = rows / n_head;
    let half = d / 2;
    Some((0..rows).map(|i| (i / d) * d + 2 * (i % half) + (i % d) / half).collect())
}

/// At most this many tensors or metadata entries are walked by [`scan_tensor_types`].
const SCAN_MAX_ENTRIES: u64 = 1 << 24;

/// The name and ggml type id of every tensor in a GGUF file's header, read without decoding
/// any value (metadata is skipped by length). For naming the tensor whose type candle's reader
/// refused; every length is checked against the file before it is used.
pub fn scan_tensor_types<R: Read + Seek>(r: &mut R) -> std::io::Result<Vec<(String, u32)>> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let len = r.seek(SeekFrom::End(0))?;
    r.seek(SeekFrom::Start(0))?;
    let magic = read_u32(r)?;
    if magic != 0x4655_4747 {
        return Err(bad(format!("not a gguf file (magic {magic:#010x})")));
    }
    let v1 = read_u32(r)? == 1;
    let count = |r: &mut R| if v1 { read_u32(r).map(u64::from) } else { read_u64(r) };
    let (tensors, kvs) = (count(r)?, count(r)?);
    if tensors > SCAN_MAX_ENTRIES || kvs > SCAN_MAX_ENTRIES {
        return Err(bad(format!("{tensors} tensors and {kvs} metadata entries")));
    }
    let skip = |r: &mut R, n: u64| -> std::io::Result<()> {
        let at = r.stream_position()?;
        if at.checked_add(n).is_none_or(|end| end > len) {
            return Err(bad(format!("an entry of {n} bytes at {at} runs past the end ({len})")));
        }
        r.seek(SeekFrom::Current(n as i64)).map(drop)
    };
    for _ in 0..kvs {
        let key_len = count(r)?;
        skip(r, key_len)?;
        let ty = read_u32(r)?;
        skip_value(r, ty, v1, &skip, 0)?;
    }
    let mut out = Vec::with_capacity(tensors.min(4096) as usize);
    for _ in 0..tensors {
        let name_len = count(r)?;
        if name_len > 1 << 16 {
            return Err(bad(format!("a tensor name of {name_len} bytes")));
        }
        let mut name = vec![0u8; name_len as usize];
        r.read_exact(&mut name)?;
        let dims = read_u32(r)?;
        if dims > 8 {
            return Err(bad(format!("a tensor of {dims} dimensions")));
        }
        skip(r, u64::from(dims) * if v1 { 4 } else { 8 })?;
        let ty = read_u32(r)?;
        skip(r, 8)?;
        out.push((String::from_utf8_lossy(&name).into_owned(), ty));
    }
    Ok(out)
}

/// Skips one metadata value of type `ty` (arrays recursively, to a depth of 4).
fn skip_value<R: Read + Seek>(
    r: &mut R,
    ty: u32,
    v1: bool,
    skip: &impl Fn(&mut R, u64) -> std::io::Result<()>,
    depth: usize,
) -> std::io::Result<()> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let fixed = |ty: u32| match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    };
    let count = |r: &mut R| if v1 { read_u32(r).map(u64::from) } else { read_u64(r) };
    match ty {
        8 => {
            let n = count(r)?;
            skip(r, n)
        }
        9 => {
            if depth >= 4 {
                return Err(bad("metadata arrays nested too deep".to_string()));
            }
            let elem = read_u32(r)?;
            let n = count(r)?;
            match fixed(elem) {
                Some(size) => skip(r, n.checked_mul(size).ok_or_else(|| bad(format!("an array of {n}")))?),
                None => {
                    if n > SCAN_MAX_ENTRIES {
                        return Err(bad(format!("an array of {n} values")));
                    }
                    (0..n).try_for_each(|_| skip_value(r, elem, v1, skip, depth + 1))
                }
            }
        }
        other => match fixed(other) {
            Some(size) => skip(r, size),
            None => Err(bad(format!("metadata value type {other}"))),
        },
    }
}

fn read_u32<R: Read>(r: &mut R) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64<R: Read>(r: &mut R) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in ModuleKind::ALL {
            let id = match kind {
                ModuleKind::EmbedTokens => ModuleId::embed_tokens(),
                ModuleKind::LmHead => ModuleId::lm_head(),
                k => ModuleId::layer(17, k),
            };
            assert_eq!(module_of(&gguf_name(id)), Some(id), "{id}");
        }
        assert_eq!(module_of("blk.3.attn_q.weight"), Some(ModuleId::layer(3, ModuleKind::QProj)));
        for bad in ["blk.03.attn_q.weight", "blk..attn_q.weight", "blk.1.attn_qkv.weight", "blk.1.attn_q.bias", "x"] {
            assert_eq!(module_of(bad), None, "{bad}");
        }
    }

    /// llama.cpp's `LlamaModel.permute` written out with numpy's reshape / swapaxes semantics,
    /// applied to row indices, must be undone by `unpermute_rows`.
    #[test]
    fn unpermute_undoes_the_converters_permutation() {
        for (rows, heads) in [(8, 2), (576, 9), (192, 3), (64, 1)] {
            let d = rows / heads;
            // permute: reshape (heads, 2, d/2) -> swapaxes(1, 2) -> (heads, d/2, 2) -> flat.
            let mut stored = vec![0usize; rows];
            for h in 0..heads {
                for j in 0..d / 2 {
                    for s in 0..2 {
                        stored[h * d + 2 * j + s] = h * d + s * (d / 2) + j;
                    }
                }
            }
            let order = unpermute_rows(rows, heads).unwrap();
            let back: Vec<usize> = order.iter().map(|&i| stored[i]).collect();
            assert_eq!(back, (0..rows).collect::<Vec<_>>(), "{rows} rows, {heads} heads");
        }
        assert_eq!(unpermute_rows(6, 4), None);
        assert_eq!(unpermute_rows(6, 2), None, "odd head size");
        assert_eq!(unpermute_rows(6, 0), None);
    }

    #[test]
    fn type_names() {
        assert_eq!(ggml_type_name(3), "Q4_1");
        assert_eq!(ggml_type_name(14), "Q6_K");
        assert_eq!(ggml_type_name(23), "IQ4_XS");
        assert_eq!(ggml_type_name(39), "MXFP4");
        assert_eq!(ggml_type_name(1000), "unknown");
    }
}
