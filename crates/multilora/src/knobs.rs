//! The engine's own knobs for where and in what precision it runs: [`Device`] and [`DType`],
//! converted to candle's inside the engine, so the API names no candle type and candle changes
//! without changing it.

use std::fmt;

/// Where the model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// The host's CPU (the default).
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal, on a stream of its own (so the builder's uploads and the
    /// engine loop's steps, on other threads, are ordered by the stream itself). Needs the
    /// `cuda` feature; the device is opened by [`crate::EngineBuilder::build`], which fails with
    /// `invalid_config` when it cannot be.
    Cuda(usize),
}

impl Device {
    /// candle's device: the CPU, or a CUDA device on its own stream.
    pub(crate) fn open(self) -> candle_core::Result<candle_core::Device> {
        match self {
            Device::Cpu => Ok(candle_core::Device::Cpu),
            Device::Cuda(ordinal) => candle_core::Device::new_cuda_with_stream(ordinal),
        }
    }
}

impl fmt::Display for Device {
    /// `cpu` or `cuda:N`, as `--device` spells it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A floating-point precision the engine holds weights, adapters or the KV cache in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit floats.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// The name `torch_dtype` gives it: `float32`, `float16` or `bfloat16`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    pub(crate) fn to_candle(self) -> candle_core::DType {
        match self {
            DType::F32 => candle_core::DType::F32,
            DType::F16 => candle_core::DType::F16,
            DType::BF16 => candle_core::DType::BF16,
        }
    }

    /// The engine's spelling of a candle dtype, when it is a precision the engine serves in.
    pub(crate) fn from_candle(dtype: candle_core::DType) -> Option<DType> {
        match dtype {
            candle_core::DType::F32 => Some(DType::F32),
            candle_core::DType::F16 => Some(DType::F16),
            candle_core::DType::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_keep_every_value() {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(DType::from_candle(dt.to_candle()), Some(dt));
        }
        assert_eq!(DType::from_candle(candle_core::DType::F64), None);
        assert_eq!((Device::Cpu.to_string(), Device::Cuda(1).to_string()), ("cpu".into(), "cuda:1".into()));
    }
}
