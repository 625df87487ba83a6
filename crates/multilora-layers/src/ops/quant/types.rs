//! The GGML block types a [`super::QuantWeight`] holds ([`QuantType`]) and the instruction sets
//! its kernels run on ([`QuantIsa`]).

use candle_core::quantized::GgmlDType;

/// A GGML block-quantized weight type: blocks of 32 values (`Q4_0` … `Q8_0`) or super-blocks of
/// 256 (the K-quants), each with its own scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QuantType {
    /// 4-bit, one f16 scale per 32: `d · (q − 8)`.
    Q4_0,
    /// 4-bit, an f16 scale and minimum per 32: `d · q + m`.
    Q4_1,
    /// 5-bit, one f16 scale per 32: `d · (q − 16)`.
    Q5_0,
    /// 5-bit, an f16 scale and minimum per 32: `d · q + m`.
    Q5_1,
    /// 8-bit, one f16 scale per 32: `d · q`.
    Q8_0,
    /// 2-bit K-quant: 4-bit scales and minima per 16, f16 super-scales per 256.
    Q2K,
    /// 3-bit K-quant: 6-bit scales per 16, an f16 super-scale per 256.
    Q3K,
    /// 4-bit K-quant: 6-bit scales and minima per 32, f16 super-scales per 256.
    Q4K,
    /// 5-bit K-quant: 6-bit scales and minima per 32, f16 super-scales per 256.
    Q5K,
    /// 6-bit K-quant: 8-bit scales per 16, an f16 super-scale per 256.
    Q6K,
}

impl QuantType {
    /// Every type, in GGML's order.
    pub const ALL: [QuantType; 10] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2K,
        QuantType::Q3K,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
    ];

    /// The type of a GGML dtype; `None` for the float types and for `Q8_1` / `Q8_K`, which GGUF
    /// files use only for activations.
    pub fn from_ggml(t: GgmlDType) -> Option<QuantType> {
        Some(match t {
            GgmlDType::Q4_0 => QuantType::Q4_0,
            GgmlDType::Q4_1 => QuantType::Q4_1,
            GgmlDType::Q5_0 => QuantType::Q5_0,
            GgmlDType::Q5_1 => QuantType::Q5_1,
            GgmlDType::Q8_0 => QuantType::Q8_0,
            GgmlDType::Q2K => QuantType::Q2K,
            GgmlDType::Q3K => QuantType::Q3K,
            GgmlDType::Q4K => QuantType::Q4K,
            GgmlDType::Q5K => QuantType::Q5K,
            GgmlDType::Q6K => QuantType::Q6K,
            _ => return None,
        })
    }

    /// Its GGML dtype.
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q5_1 => GgmlDType::Q5_1,
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Q2K => GgmlDType::Q2K,
            QuantType::Q3K => GgmlDType::Q3K,
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5K => GgmlDType::Q5K,
            QuantType::Q6K => GgmlDType::Q6K,
        }
    }

    /// Values per GGML block: 32, or 256 for the K-quants.
    pub fn block_elems(self) -> usize {
        match self {
            QuantType::Q2K | QuantType::Q3K | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per GGML block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q8_0 => 34,
            QuantType::Q2K => 84,
            QuantType::Q3K => 110,
            QuantType::Q4K => 144,
            QuantType::Q5K => 176,
            QuantType::Q6K => 210,
        }
    }

    /// GGML's name: `"Q4_1"`, `"Q4_K"`, ….
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q2K => "Q2_K",
            QuantType::Q3K => "Q3_K",
            QuantType::Q4K => "Q4_K",
            QuantType::Q5K => "Q5_K",
            QuantType::Q6K => "Q6_K",
        }
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which integer dot-product instructions the quantized kernels use. Every one computes the
/// same exact integer sums and the same f32 operations on them, so all give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QuantIsa {
    /// Plain Rust (i32 arithmetic the compiler vectorises as it can); runs everywhere.
    Portable,
    /// x86-64 AVX2 (+ FMA, F16C): `vpmaddubsw` / `vpmaddwd`, 8 output columns per vector.
    Avx2,
    /// x86-64 AVX-VNNI (256-bit `vpdpbusd`), 8 output columns per vector.
    AvxVnni,
    /// x86-64 AVX-512 VNNI (F, BW, VL, VNNI: 512-bit `vpdpbusd`), 16 output columns per vector.
    Avx512Vnni,
}

impl QuantIsa {
    /// The fastest instruction set this CPU has, within [`crate::Isa::set_max`]'s cap.
    pub fn best() -> QuantIsa {
        let allowed = |i: &QuantIsa| match i {
            // AVX-VNNI is 256-bit, but the AVX2-only CPUs the `Avx2` cap stands for lack it.
            QuantIsa::Avx512Vnni | QuantIsa::AvxVnni => crate::Isa::Avx512.allowed(),
            QuantIsa::Avx2 => crate::Isa::Avx2.allowed(),
            QuantIsa::Portable => true,
        };
        [QuantIsa::Avx512Vnni, QuantIsa::AvxVnni, QuantIsa::Avx2]
            .into_iter()
            .find(|i| i.available() && allowed(i))
            .unwrap_or(QuantIsa::Portable)
    }

    /// Whether this CPU can run it.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = || has!("avx2") && has!("fma") && has!("f16c");
            match self {
                QuantIsa::Portable => true,
                QuantIsa::Avx2 => avx2(),
                QuantIsa::AvxVnni => avx2() && has!("avxvnni"),
                QuantIsa::Avx512Vnni => {
                    avx2() && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == QuantIsa::Portable
        }
    }

    /// Every instruction set this CPU can run, the portable one first.
    pub fn all_available() -> Vec<QuantIsa> {
        [QuantIsa::Portable, QuantIsa::Avx2, QuantIsa::AvxVnni, QuantIsa::Avx512Vnni]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    /// How the start-up log names it.
    pub fn describe(self) -> &'static str {
        match self {
            QuantIsa::Portable => "portable",
            QuantIsa::Avx2 => "AVX2",
            QuantIsa::AvxVnni => "AVX-VNNI",
            QuantIsa::Avx512Vnni => "AVX-512 VNNI",
        }
    }
}
