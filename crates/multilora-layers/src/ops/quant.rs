//! Quantized CPU products for GGUF weights as candle tensors: [`QuantWeight`] holds a
//! `multilora_cpu::quant::QuantMatrix` (GGML blocks regrouped for the integer kernels, about the
//! file's bytes) and takes and gives tensors; the kernels, their exactness and their plans are
//! the CPU crate's ([`multilora_cpu::quant`]). Also the mapping between GGML's dtypes and
//! [`QuantType`].

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Storage, Tensor};
use multilora_cpu::Isa;
use multilora_cpu::quant::{QuantMatrix, QuantType};

use crate::error::{Error, Result};

/// [`quant_type`] and [`ggml_dtype`] from one list of pairs, each an exhaustive match.
macro_rules! ggml_pairs {
    ($($q:ident => $g:ident),* $(,)?) => {
        /// The type of a GGML dtype; `None` for the float types and for `Q8_1` / `Q8_K`, which
        /// GGUF files use only for activations.
        pub fn quant_type(t: GgmlDType) -> Option<QuantType> {
            match t {
                $(GgmlDType::$g => Some(QuantType::$q),)*
                _ => None,
            }
        }

        /// The GGML dtype of a [`QuantType`].
        pub fn ggml_dtype(t: QuantType) -> GgmlDType {
            match t {
                $(QuantType::$q => GgmlDType::$g,)*
            }
        }
    };
}

ggml_pairs!(Q4_0 => Q4_0, Q4_1 => Q4_1, Q5_0 => Q5_0, Q5_1 => Q5_1, Q8_0 => Q8_0, Q2K => Q2K, Q3K => Q3K, Q4K => Q4K, Q5K => Q5K, Q6K => Q6K);

/// A GGML-quantized weight `W: [n, k]` (PyTorch's `[out, in]`), held in its blocks and multiplied
/// by [`QuantWeight::forward`] without dequantizing. Several weights of the same `k` and any types
/// stack into one ([`QuantWeight::stack`]: fused q/k/v or gate/up) without copying. Cloning is
/// cheap (the blocks are shared).
#[derive(Clone)]
pub struct QuantWeight(QuantMatrix);

impl std::fmt::Debug for QuantWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ((n, k), types) = (self.dims(), self.types());
        let types: Vec<&str> = types.iter().map(|t| t.name()).collect();
        write!(f, "QuantWeight[{n}, {k}, {}]", types.join("+"))
    }
}

impl QuantWeight {
    /// One `[n, k]` weight from GGML block bytes, rows in order, each row `k / block_elems`
    /// blocks (the GGUF layout). The bytes are regrouped, not kept.
    pub fn from_bytes(qtype: QuantType, n: usize, k: usize, bytes: &[u8]) -> Result<QuantWeight> {
        Ok(QuantWeight(QuantMatrix::from_bytes(qtype, n, k, bytes)?))
    }

    /// The weights' rows one after another (e.g. q, k and v of a fused projection): one weight
    /// whose output columns are the parts' in order. The parts may have different types (Q4_K_M
    /// files mix Q4_K and Q6_K) but must share `k`; their blocks are shared, not copied.
    pub fn stack(parts: Vec<QuantWeight>) -> Result<QuantWeight> {
        Ok(QuantWeight(QuantMatrix::stack(parts.into_iter().map(|p| p.0).collect())?))
    }

    /// `(n, k)`: output and input features.
    pub fn dims(&self) -> (usize, usize) {
        self.0.dims()
    }

    /// The distinct types of its row segments, in order of first appearance.
    pub fn types(&self) -> Vec<QuantType> {
        self.0.types()
    }

    /// Bytes it holds in memory (its blocks; about the GGUF bytes of the weight).
    pub fn storage_bytes(&self) -> usize {
        self.0.storage_bytes()
    }

    /// One line for the start-up log: per type, the kernel and the instruction set it runs on.
    pub fn describe(&self) -> String {
        self.0.describe()
    }

    /// `x: [m, k]` · `Wᵀ` → `[m, n]` f32, with the best kernels of this CPU. `x` is a 2-D CPU
    /// tensor (any `m`, contiguous or not; a non-f32 one is converted).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Isa::best())
    }

    /// [`QuantWeight::forward`] with a chosen instruction set (for tests and benchmarks); an
    /// error when the CPU lacks it. Every set gives the same bits.
    pub fn forward_with(&self, x: &Tensor, isa: Isa) -> Result<Tensor> {
        self.forward_ahead(x, isa, &[])
    }

    /// [`QuantWeight::forward_with`], asking along the way for the bytes of `ahead` (`(address,
    /// bytes)` ranges of what the caller reads next) to be brought into the caches.
    pub(crate) fn forward_ahead(&self, x: &Tensor, isa: Isa, ahead: &[(usize, usize)]) -> Result<Tensor> {
        if !x.device().is_cpu() {
            return Err(Error::InvalidLayer {
                module: "quantized linear".into(),
                reason: format!("the input is on {:?}; quantized weights run on the cpu", x.device().location()),
            });
        }
        let (n, k) = self.dims();
        let &[m, kx] = x.dims() else {
            let rows = x.dims().first().copied().unwrap_or(0);
            return Err(Error::shape("quantized linear", "input", x.dims(), &[rows, k]));
        };
        if kx != k {
            return Err(Error::shape("quantized linear", "input", x.dims(), &[m, k]));
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let (storage, l) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Err(Error::shape("quantized linear", "input", x.dims(), &[m, k]));
        };
        let xs = &cpu.as_slice::<f32>()?[l.start_offset()..l.start_offset() + m * k];
        let y = self.0.product(xs, m, isa, ahead)?;
        drop(storage);
        Ok(Tensor::from_vec(y, (m, n), &Device::Cpu)?)
    }

    /// `[n, k]` f32: every value as ggml dequantizes it, bit for bit.
    pub fn dequantize(&self) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.0.dequantize(), self.dims(), &Device::Cpu)?)
    }

    /// `[rows.len(), k]` f32: the rows `rows` of [`QuantWeight::dequantize`] (the embedding
    /// gather of a quantized `token_embd`); every index is checked `< n` first.
    pub fn dequantize_rows(&self, rows: &[u32]) -> Result<Tensor> {
        let w = self.0.dequantize_rows(rows)?;
        Ok(Tensor::from_vec(w, (rows.len(), self.dims().1), &Device::Cpu)?)
    }
}
