//! The Q8_0 K/V element: llama.cpp's `block_q8_0` (an f16 scale and 32 signed bytes, 34
//! bytes for 32 values against 64 in f16), as its `-ctk q8_0 -ctv q8_0` stores K and V.
//!
//! K/V rows are written once per token, so the scalar quantization costs nothing that
//! matters. Dequantization is exact in f32 (an 11-bit scale times a byte): see
//! `crate::block` for what that gives attention.

use half::f16;

use crate::block::KvBlock;

/// Values per block.
pub const Q8_VALUES: usize = 32;

/// 32 values `d * qs[i]`.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q8Block {
    pub d: f16,
    pub qs: [i8; Q8_VALUES],
}

/// Bytes of one block on the wire: `d` little-endian, then the 32 bytes.
pub const Q8_BLOCK_BYTES: usize = 2 + Q8_VALUES;

impl KvBlock for Q8Block {
    const BYTES: usize = Q8_BLOCK_BYTES;
    const ZERO: Q8Block = Q8Block {
        d: f16::ZERO,
        qs: [0; Q8_VALUES],
    };

    /// llama.cpp's `quantize_row_q8_0_ref`: the scale maps the largest magnitude to 127,
    /// each value rounds half away from zero.
    fn quantize(x: &[f32]) -> Q8Block {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; Q8_VALUES];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        Q8Block {
            d: f16::from_f32(d),
            qs,
        }
    }

    fn filled(value: f32) -> Q8Block {
        if value.is_nan() {
            Q8Block {
                d: f16::NAN,
                qs: [0; Q8_VALUES],
            }
        } else {
            Q8Block::quantize(&[value; Q8_VALUES])
        }
    }

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * f32::from(q);
        }
    }

    fn push_bytes(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend(self.qs.iter().map(|&q| q as u8));
    }

    fn from_bytes(b: &[u8]) -> Q8Block {
        let mut qs = [0i8; Q8_VALUES];
        for (q, &x) in qs.iter_mut().zip(&b[2..Q8_BLOCK_BYTES]) {
            *q = x as i8;
        }
        Q8Block {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_magnitude_is_127_and_error_is_within_half_a_step() {
        let x: Vec<f32> = (0..Q8_VALUES).map(|i| i as f32 - 20.5).collect();
        let b = Q8Block::quantize(&x);
        assert_eq!(b.qs.iter().map(|q| q.unsigned_abs()).max(), Some(127));
        let mut y = [0f32; Q8_VALUES];
        b.dequantize(&mut y);
        let step = b.d.to_f32();
        for (a, e) in x.iter().zip(y) {
            assert!(
                (a - e).abs() <= 0.5 * step + 1e-3 * step.abs() + 20.5 / 1024.0,
                "{a} {e}"
            );
        }
        assert_eq!(Q8Block::quantize(&[0.0; Q8_VALUES]), Q8Block::ZERO);
        let mut nan = [0f32; Q8_VALUES];
        Q8Block::filled(f32::NAN).dequantize(&mut nan);
        assert!(nan.iter().all(|v| v.is_nan()));
    }
}
