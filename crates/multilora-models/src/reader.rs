//! The tensors of a checkpoint's safetensors files, read on demand with positioned reads rather
//! than through a memory map: a tensor's bytes are resident only while it is turned into a
//! tensor, so loading a model peaks at the model plus about one tensor, not at the model plus
//! the whole mapped file (the mapped pages count as resident until the map is dropped).
//!
//! Each file's header is parsed with the `safetensors` crate's `Metadata` and checked against the
//! file's length before anything is read: every tensor's bytes lie inside the file and match its
//! dtype and shape, and no name is in two shards.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use half::vec::HalfBitsVecExt;
use half::{bf16, f16};
use safetensors::tensor::{Dtype, Metadata};

use crate::error::{Error, Result};

/// The largest header read (the `safetensors` crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor: which file, where its bytes start, its dtype and shape.
#[derive(Debug)]
struct Entry {
    file: usize,
    start: u64,
    dtype: DType,
    shape: Vec<usize>,
}

/// The open files and where every tensor is.
#[derive(Debug)]
pub(crate) struct SafetensorsFiles {
    files: Vec<(PathBuf, File)>,
    index: HashMap<String, Entry>,
}

impl SafetensorsFiles {
    /// Opens every file and reads its header.
    pub(crate) fn open(paths: &[PathBuf]) -> Result<SafetensorsFiles> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let bad = |reason: String| Error::Config {
                path: path.clone(),
                reason: format!("not a readable safetensors file: {reason}"),
            };
            let io = |source| Error::Io { path: path.clone(), source };
            let mut file = File::open(path).map_err(io)?;
            let file_len = file.metadata().map_err(io)?.len();
            let mut n = [0u8; 8];
            file.read_exact(&mut n).map_err(|e| bad(format!("no header length ({e})")))?;
            let n = u64::from_le_bytes(n);
            if n > MAX_HEADER_BYTES || 8 + n > file_len {
                return Err(bad(format!("a header of {n} bytes in a file of {file_len}")));
            }
            let mut header = vec![0u8; n as usize];
            file.read_exact(&mut header).map_err(io)?;
            let meta: Metadata = serde_json::from_slice(&header).map_err(|e| bad(format!("its header: {e}")))?;
            let data_start = 8 + n;
            for (name, info) in meta.tensors() {
                let (lo, hi) = info.data_offsets;
                let elems: usize = info.shape.iter().product();
                let bytes = (elems * info.dtype.bitsize()).div_ceil(8);
                if lo > hi || data_start + hi as u64 > file_len || hi - lo != bytes {
                    return Err(bad(format!(
                        "tensor {name}: bytes {lo}..{hi} for {:?} {:?} in a file of {file_len}",
                        info.dtype, info.shape
                    )));
                }
                let dtype =
                    candle_dtype(info.dtype).ok_or_else(|| bad(format!("tensor {name}: dtype {:?}", info.dtype)))?;
                let entry = Entry { file: i, start: data_start + lo as u64, dtype, shape: info.shape.clone() };
                if index.insert(name.clone(), entry).is_some() {
                    return Err(bad(format!("tensor {name} is in two shards")));
                }
            }
            files.push((path.clone(), file));
        }
        Ok(SafetensorsFiles { files, index })
    }

    /// The shape of `name`, if the checkpoint has it.
    pub(crate) fn shape(&self, name: &str) -> Option<&[usize]> {
        self.index.get(name).map(|e| e.shape.as_slice())
    }

    /// Reads `name` as stored, on the CPU: its bytes straight into the tensor's own buffer (one
    /// allocation, no staging copy; safetensors is little-endian, as every target candle runs on).
    pub(crate) fn load(&self, name: &str) -> Result<Option<Tensor>> {
        let Some(e) = self.index.get(name) else { return Ok(None) };
        let (path, file) = &self.files[e.file];
        let io = |source| Error::Io { path: path.clone(), source };
        let mut f = file;
        f.seek(SeekFrom::Start(e.start)).map_err(io)?;
        let n: usize = e.shape.iter().product();
        let (shape, dev) = (e.shape.as_slice(), &Device::Cpu);
        let t = match e.dtype {
            DType::BF16 => Tensor::from_vec(read::<u16>(f, n).map_err(io)?.reinterpret_into::<bf16>(), shape, dev)?,
            DType::F16 => Tensor::from_vec(read::<u16>(f, n).map_err(io)?.reinterpret_into::<f16>(), shape, dev)?,
            DType::F32 => Tensor::from_vec(read::<f32>(f, n).map_err(io)?, shape, dev)?,
            DType::F64 => Tensor::from_vec(read::<f64>(f, n).map_err(io)?, shape, dev)?,
            DType::U32 => Tensor::from_vec(read::<u32>(f, n).map_err(io)?, shape, dev)?,
            DType::I64 => Tensor::from_vec(read::<i64>(f, n).map_err(io)?, shape, dev)?,
            _ => Tensor::from_vec(read::<u8>(f, n).map_err(io)?, shape, dev)?,
        };
        Ok(Some(t))
    }
}

/// `n` values of `T` read from where `f` stands.
fn read<T: bytemuck::Pod>(mut f: &File, n: usize) -> std::io::Result<Vec<T>> {
    let mut v = vec![T::zeroed(); n];
    f.read_exact(bytemuck::cast_slice_mut(&mut v))?;
    Ok(v)
}

/// candle's dtype for a safetensors one (those a checkpoint's tensors use).
fn candle_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}
