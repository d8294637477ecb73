//! KV representations: the element type an entry's KV is stored in and how its quantization
//! scales are laid out. A layout that publishes none keeps the behaviour of a layout without
//! representations (its pairs are planned byte for byte); two layouts whose paired entries
//! publish different representations are planned as a conversion (module `convert`).
//!
//! This module depends on no other: it names values; the rules that use them live in the
//! layout (consistency with the entry's sizes) and in `convert` (what converts to what).

/// The element type of an entry's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// bfloat16: 1 sign, 8 exponent, 7 mantissa bits.
    Bf16,
    /// IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits.
    Fp16,
    /// OCP FP8 E4M3 (`float8_e4m3fn`): no infinities, largest finite 448.
    Fp8E4m3,
    /// OCP FP8 E5M2 (`float8_e5m2`): IEEE-like, largest finite 57344.
    Fp8E5m2,
    /// Signed 8-bit integers.
    Int8,
}

impl KvDtype {
    /// Every dtype, in code order.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::Bf16,
        KvDtype::Fp16,
        KvDtype::Fp8E4m3,
        KvDtype::Fp8E5m2,
        KvDtype::Int8,
    ];

    /// The dtype's name as layouts spell it (`bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2`, `int8`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp16 => "fp16",
            KvDtype::Fp8E4m3 => "fp8_e4m3",
            KvDtype::Fp8E5m2 => "fp8_e5m2",
            KvDtype::Int8 => "int8",
        }
    }

    /// The dtype named `name` ([`KvDtype::as_str`]), if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.as_str() == name)
    }

    /// Bytes per element.
    pub fn size(self) -> u32 {
        match self {
            KvDtype::Bf16 | KvDtype::Fp16 => 2,
            KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2 | KvDtype::Int8 => 1,
        }
    }

    /// Whether the dtype is quantized: it needs scales to stand for higher-precision values.
    pub fn quantized(self) -> bool {
        self.size() == 1
    }

    /// The code of the dtype on the wire and in kernel-facing arrays (its position in
    /// [`KvDtype::ALL`]).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The dtype of code `code` ([`KvDtype::code`]), if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }
}

/// Where an entry's quantization scales are and what each one covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleLayout {
    /// No scales: the values are stored as they are.
    None,
    /// One scale for the whole tensor, calibrated by the engine (not derivable from a transfer).
    PerTensor,
    /// One float32 scale per token of the entry (over all of the rank's heads).
    PerToken,
    /// One float32 scale per token and KV head of the entry.
    PerTokenHead,
    /// OCP Microscaling (MX v1.0) block scales: one E8M0 scale (a power of two) per block of
    /// [`MX_BLOCK`] consecutive elements of a token. `fp8_e4m3` only (MXFP8).
    Mx,
}

impl ScaleLayout {
    /// Every scale layout, in code order.
    /// (Appended layouts keep the codes of the earlier ones.)
    pub const ALL: [ScaleLayout; 5] = [
        ScaleLayout::None,
        ScaleLayout::PerTensor,
        ScaleLayout::PerToken,
        ScaleLayout::PerTokenHead,
        ScaleLayout::Mx,
    ];

    /// The layout's name (`none`, `per_tensor`, `per_token`, `per_token_head`, `mx`).
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleLayout::None => "none",
            ScaleLayout::PerTensor => "per_tensor",
            ScaleLayout::PerToken => "per_token",
            ScaleLayout::PerTokenHead => "per_token_head",
            ScaleLayout::Mx => "mx",
        }
    }

    /// The scale layout named `name` ([`ScaleLayout::as_str`]), if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// The code of the layout on the wire (its position in [`ScaleLayout::ALL`]).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The scale layout of code `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// Whether the scales live in a page entry of their own, one or more per token (the
    /// entry's scale entry: see [`crate::peer::layout::Layout::with_representations`]):
    /// `per_token`, `per_token_head` and `mx`.
    pub fn per_token(self) -> bool {
        self.scale_format().is_some()
    }

    /// How one scale of the layout's scale entry is stored: float32 for `per_token` and
    /// `per_token_head`, E8M0 for `mx`; `None` for layouts without a scale entry. Every size
    /// of a scale entry, a scale area or a scale block derives from this.
    pub fn scale_format(self) -> Option<ScaleFormat> {
        match self {
            ScaleLayout::None | ScaleLayout::PerTensor => None,
            ScaleLayout::PerToken | ScaleLayout::PerTokenHead => Some(ScaleFormat::Float32),
            ScaleLayout::Mx => Some(ScaleFormat::E8m0),
        }
    }

    /// Bytes of one scale in the scale entry (0 for layouts without one).
    pub fn scale_bytes(self) -> u64 {
        self.scale_format().map_or(0, ScaleFormat::size)
    }
}

/// Elements per block of the `mx` scale layout: one E8M0 scale per 32 consecutive elements of
/// a token (OCP MX v1.0).
pub const MX_BLOCK: u64 = 32;

/// How a scale is stored in a scale entry and in a conversion plan's scale area (the code in
/// `ConvertRows::scale_formats`, so a kernel knows how to read and write it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleFormat {
    /// IEEE binary32, little-endian: the scale the values are divided by.
    Float32,
    /// E8M0 (OCP MX): one unsigned byte `e`, the scale `2^(e - 127)`; `0xFF` is NaN.
    E8m0,
}

impl ScaleFormat {
    /// Every scale format, in code order.
    pub const ALL: [ScaleFormat; 2] = [ScaleFormat::Float32, ScaleFormat::E8m0];

    /// The format's name (`float32`, `e8m0`).
    pub fn as_str(self) -> &'static str {
        match self {
            ScaleFormat::Float32 => "float32",
            ScaleFormat::E8m0 => "e8m0",
        }
    }

    /// Bytes of one scale.
    pub fn size(self) -> u64 {
        match self {
            ScaleFormat::Float32 => 4,
            ScaleFormat::E8m0 => 1,
        }
    }

    /// The code of the format in kernel-facing arrays (its position in [`ScaleFormat::ALL`]).
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// An entry's KV representation: its dtype and its scale layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Representation {
    /// The element type.
    pub dtype: KvDtype,
    /// Where the scales are.
    pub scales: ScaleLayout,
}

impl Representation {
    /// A representation without scales.
    pub fn plain(dtype: KvDtype) -> Self {
        Self {
            dtype,
            scales: ScaleLayout::None,
        }
    }

    /// `dtype` alone when it has no scales, else `dtype:scales` (`fp8_e4m3:per_token`): the
    /// text [`Representation::parse`] reads.
    pub fn text(&self) -> String {
        match self.scales {
            ScaleLayout::None => self.dtype.as_str().to_owned(),
            scales => format!("{}:{}", self.dtype.as_str(), scales.as_str()),
        }
    }

    /// Whether the scale layout suits the dtype: scales only on quantized dtypes, and `mx`
    /// only on `fp8_e4m3` (MXFP8).
    pub fn consistent(&self) -> bool {
        match self.scales {
            ScaleLayout::None => true,
            ScaleLayout::Mx => self.dtype == KvDtype::Fp8E4m3,
            _ => self.dtype.quantized(),
        }
    }

    /// Reads [`Representation::text`]'s form; `None` for an unknown dtype or scale layout.
    pub fn parse(text: &str) -> Option<Self> {
        let (dtype, scales) = text.split_once(':').unwrap_or((text, "none"));
        Some(Self {
            dtype: KvDtype::parse(dtype.trim())?,
            scales: ScaleLayout::parse(scales.trim())?,
        })
    }

    /// The representation as one wire value: dtype code in the low byte, scale layout code in
    /// the next.
    pub fn to_code(&self) -> u64 {
        u64::from(self.dtype.code()) | u64::from(self.scales.code()) << 8
    }

    /// The representation of wire value `code` ([`Representation::to_code`]), if valid.
    pub fn from_code(code: u64) -> Option<Self> {
        if code >> 16 != 0 {
            return None;
        }
        Some(Self {
            dtype: KvDtype::from_code((code & 0xff) as u8)?,
            scales: ScaleLayout::from_code((code >> 8) as u8)?,
        })
    }
}

/// The role of the scale entry of an entry with role `role`: `role` + `_scale` (`k` →
/// `k_scale`, `kv` → `kv_scale`).
pub fn scale_role(role: &str) -> String {
    format!("{role}_scale")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_codes_round_trip() {
        for dtype in KvDtype::ALL {
            for scales in ScaleLayout::ALL {
                let r = Representation { dtype, scales };
                assert_eq!(Representation::parse(&r.text()), Some(r));
                assert_eq!(Representation::from_code(r.to_code()), Some(r));
            }
        }
        assert_eq!(Representation::parse("fp9"), None);
        assert_eq!(Representation::parse("bf16:per_block"), None);
        assert_eq!(Representation::from_code(0x0500), None);
        assert_eq!(
            Representation::parse("fp8_e4m3:mx").unwrap().to_code(),
            0x0402
        );
        assert!(Representation::parse("fp8_e4m3:mx").unwrap().consistent());
        assert!(!Representation::parse("fp8_e5m2:mx").unwrap().consistent());
        assert!(!Representation::parse("int8:mx").unwrap().consistent());
        assert_eq!(ScaleLayout::Mx.scale_bytes(), 1);
        assert_eq!(ScaleLayout::PerToken.scale_bytes(), 4);
        assert_eq!(ScaleLayout::PerTensor.scale_bytes(), 0);
        assert_eq!(Representation::from_code(1 << 16), None);
    }
}
