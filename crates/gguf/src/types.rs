use crate::quants::QK_K;
use crate::{float, iq4_nl, legacy, low_kquants, quants};

/// Tensor element types that kvwarden can load. Values are ggml's type ids; the k-quants
/// keep ggml's names (`Q4_K`), which rustc's naming lint would turn into `Q4K`.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    BF16,
}

/// ggml's name for a type id, for error messages about types kvwarden cannot load.
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 43] = [
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
        "NVFP4",
        "Q1_0",
        "Q2_0",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

/// One GGUF tensor type: its ggml id, block shape and reference (de)quantization. The table
/// below is the only place that says what a type is; adding one is a variant and a line.
struct Layout {
    ty: GgmlType,
    id: u32,
    block_elems: usize,
    block_bytes: usize,
    /// One block's bytes to its `block_elems` values.
    dequantize: fn(&[u8], &mut [f32]),
    /// One block's values appended as bytes, the way ggml's reference quantizer does.
    quantize: fn(&[f32], &mut Vec<u8>),
}

/// In the enum's order, so that a type's entry is `LAYOUTS[ty as usize]` (a test checks it).
const LAYOUTS: [Layout; 14] = [
    layout(
        GgmlType::F32,
        0,
        1,
        4,
        float::dequantize_f32,
        float::quantize_f32,
    ),
    layout(
        GgmlType::F16,
        1,
        1,
        2,
        float::dequantize_f16,
        float::quantize_f16,
    ),
    layout(
        GgmlType::Q4_0,
        2,
        32,
        2 + 16,
        legacy::dequantize_q4_0,
        legacy::quantize_q4_0,
    ),
    layout(
        GgmlType::Q4_1,
        3,
        32,
        2 + 2 + 16,
        legacy::dequantize_q4_1,
        legacy::quantize_q4_1,
    ),
    layout(
        GgmlType::Q5_0,
        6,
        32,
        2 + 4 + 16,
        quants::dequantize_q5_0,
        quants::quantize_q5_0,
    ),
    layout(
        GgmlType::Q5_1,
        7,
        32,
        2 + 2 + 4 + 16,
        quants::dequantize_q5_1,
        quants::quantize_q5_1,
    ),
    layout(
        GgmlType::Q8_0,
        8,
        32,
        2 + 32,
        legacy::dequantize_q8_0,
        legacy::quantize_q8_0,
    ),
    layout(
        GgmlType::Q2_K,
        10,
        QK_K,
        16 + 64 + 2 + 2,
        low_kquants::dequantize_q2_k,
        low_kquants::quantize_q2_k,
    ),
    layout(
        GgmlType::Q3_K,
        11,
        QK_K,
        32 + 64 + 12 + 2,
        low_kquants::dequantize_q3_k,
        low_kquants::quantize_q3_k,
    ),
    layout(
        GgmlType::Q4_K,
        12,
        QK_K,
        2 + 2 + 12 + 128,
        quants::dequantize_q4_k,
        quants::quantize_q4_k,
    ),
    layout(
        GgmlType::Q5_K,
        13,
        QK_K,
        2 + 2 + 12 + 32 + 128,
        quants::dequantize_q5_k,
        quants::quantize_q5_k,
    ),
    layout(
        GgmlType::Q6_K,
        14,
        QK_K,
        128 + 64 + 16 + 2,
        quants::dequantize_q6_k,
        quants::quantize_q6_k,
    ),
    layout(
        GgmlType::IQ4_NL,
        20,
        32,
        2 + 16,
        iq4_nl::dequantize_iq4_nl,
        iq4_nl::quantize_iq4_nl,
    ),
    layout(
        GgmlType::BF16,
        30,
        1,
        2,
        float::dequantize_bf16,
        float::quantize_bf16,
    ),
];

const fn layout(
    ty: GgmlType,
    id: u32,
    block_elems: usize,
    block_bytes: usize,
    dequantize: fn(&[u8], &mut [f32]),
    quantize: fn(&[f32], &mut Vec<u8>),
) -> Layout {
    Layout {
        ty,
        id,
        block_elems,
        block_bytes,
        dequantize,
        quantize,
    }
}

impl GgmlType {
    fn layout(self) -> &'static Layout {
        &LAYOUTS[self as usize]
    }

    pub fn from_id(id: u32) -> Option<Self> {
        LAYOUTS.iter().find(|l| l.id == id).map(|l| l.ty)
    }

    pub fn id(self) -> u32 {
        self.layout().id
    }

    /// Elements per block; a row's length must be a multiple of it.
    pub fn block_elems(self) -> usize {
        self.layout().block_elems
    }

    /// Bytes per block, as ggml lays them out.
    pub fn block_bytes(self) -> usize {
        self.layout().block_bytes
    }

    /// Bytes of `n` elements, or `None` when `n` is not whole blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes() as u64)
    }

    /// Dequantizes whole blocks from `src` into `dst` (`dst.len()` elements), by ggml's
    /// definitions (each type's file describes its layout).
    pub fn dequantize(self, src: &[u8], dst: &mut [f32]) {
        let l = self.layout();
        assert_eq!(dst.len() % l.block_elems, 0, "dequantize: partial block");
        assert!(
            src.len() >= dst.len() / l.block_elems * l.block_bytes,
            "dequantize: short source"
        );
        for (block, out) in src
            .chunks_exact(l.block_bytes)
            .zip(dst.chunks_exact_mut(l.block_elems))
        {
            (l.dequantize)(block, out);
        }
    }

    /// Quantizes `src` (whole blocks) the way ggml's reference quantizers do; used by the
    /// synthetic-model writer and by tests.
    pub fn quantize(self, src: &[f32]) -> Vec<u8> {
        let l = self.layout();
        assert_eq!(src.len() % l.block_elems, 0, "quantize: partial block");
        let mut out = Vec::with_capacity(src.len() / l.block_elems * l.block_bytes);
        for x in src.chunks_exact(l.block_elems) {
            (l.quantize)(x, &mut out);
        }
        out
    }
}

/// A metadata value. Arrays keep their element type so that an empty array still says what
/// it is an array of.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// Any integer type that fits a u64 without loss.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v as u64),
            Self::U16(v) => Some(v as u64),
            Self::U32(v) => Some(v as u64),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::U8(v) => Some(v as i64),
            Self::U16(v) => Some(v as i64),
            Self::U32(v) => Some(v as i64),
            Self::U64(v) => i64::try_from(v).ok(),
            Self::I8(v) => Some(v as i64),
            Self::I16(v) => Some(v as i64),
            Self::I32(v) => Some(v as i64),
            Self::I64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v as f64),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    pub(crate) fn type_id(&self) -> u32 {
        match self {
            Self::U8(_) => 0,
            Self::I8(_) => 1,
            Self::U16(_) => 2,
            Self::I16(_) => 3,
            Self::U32(_) => 4,
            Self::I32(_) => 5,
            Self::F32(_) => 6,
            Self::Bool(_) => 7,
            Self::String(_) => 8,
            Self::Array(_) => 9,
            Self::U64(_) => 10,
            Self::I64(_) => 11,
            Self::F64(_) => 12,
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    #[test]
    fn every_type_is_its_own_table_line() {
        for (i, l) in LAYOUTS.iter().enumerate() {
            assert_eq!(l.ty as usize, i, "{:?} is not at its enum index", l.ty);
            assert_eq!(GgmlType::from_id(l.id), Some(l.ty));
            assert_eq!(
                ggml_type_name(l.id),
                format!("{:?}", l.ty),
                "ggml's name for {}",
                l.id
            );
        }
        let ids: std::collections::BTreeSet<u32> = LAYOUTS.iter().map(|l| l.id).collect();
        assert_eq!(ids.len(), LAYOUTS.len(), "two lines with one id");
    }

    #[test]
    fn q4_1_dequantizes_per_definition() {
        // d = 0.5, m = -1.0, byte j = (j+1)%16 low, (15-j) high.
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16u8 {
            block.push(((j + 1) % 16) | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        GgmlType::Q4_1.dequantize(&block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], ((j as u8 + 1) % 16) as f32 * 0.5 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q4_0_dequantizes_per_definition() {
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(0.25).to_le_bytes());
        for j in 0..16u8 {
            block.push(j | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        GgmlType::Q4_0.dequantize(&block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.25);
            assert_eq!(out[j + 16], (15.0 - j as f32 - 8.0) * 0.25);
        }
    }

    #[test]
    fn q8_0_dequantizes_per_definition() {
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(2.0).to_le_bytes());
        for j in 0..32i32 {
            block.push((j * 8 - 128) as i8 as u8);
        }
        let mut out = [0f32; 32];
        GgmlType::Q8_0.dequantize(&block, &mut out);
        for (j, v) in out.iter().enumerate() {
            assert_eq!(*v, (j as f32 * 8.0 - 128.0) * 2.0);
        }
    }

    #[test]
    fn half_types_dequantize() {
        let mut out = [0f32; 2];
        let mut src = f16::from_f32(1.5).to_le_bytes().to_vec();
        src.extend_from_slice(&f16::from_f32(-2.25).to_le_bytes());
        GgmlType::F16.dequantize(&src, &mut out);
        assert_eq!(out, [1.5, -2.25]);
        let mut src = bf16::from_f32(3.0).to_le_bytes().to_vec();
        src.extend_from_slice(&bf16::from_f32(-0.5).to_le_bytes());
        GgmlType::BF16.dequantize(&src, &mut out);
        assert_eq!(out, [3.0, -0.5]);
    }

    #[test]
    fn quantize_roundtrip_error_is_bounded() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F16,
        ] {
            let q = ty.quantize(&x);
            assert_eq!(q.len() as u64, ty.bytes_for(64).unwrap());
            let mut y = vec![0f32; 64];
            ty.dequantize(&q, &mut y);
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let step = match ty {
                GgmlType::Q4_0 | GgmlType::Q4_1 => amax / 7.0,
                GgmlType::Q8_0 => amax / 127.0,
                _ => 1e-3,
            };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= step, "{ty:?}: {a} vs {b}");
            }
        }
    }
}
