//! The float types: one element per block, F32 as is, F16 and BF16 widened exactly.

use half::{bf16, f16};

pub(crate) fn dequantize_f32(block: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
}

pub(crate) fn dequantize_f16(block: &[u8], out: &mut [f32]) {
    out[0] = f16::from_le_bytes([block[0], block[1]]).to_f32();
}

pub(crate) fn dequantize_bf16(block: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([block[0], block[1]]).to_f32();
}

pub(crate) fn quantize_f32(x: &[f32], out: &mut Vec<u8>) {
    out.extend_from_slice(&x[0].to_le_bytes());
}

pub(crate) fn quantize_f16(x: &[f32], out: &mut Vec<u8>) {
    out.extend_from_slice(&f16::from_f32(x[0]).to_le_bytes());
}

pub(crate) fn quantize_bf16(x: &[f32], out: &mut Vec<u8>) {
    out.extend_from_slice(&bf16::from_f32(x[0]).to_le_bytes());
}
