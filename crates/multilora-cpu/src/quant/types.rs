//! The GGML block types a [`super::QuantMatrix`] holds ([`QuantType`]).

/// A GGML block-quantized weight type: blocks of 32 values (`Q4_0` … `Q8_0`) or super-blocks of
/// 256 (the K-quants), each with its own scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
