//! The Q4_0 K/V element: llama.cpp's `block_q4_0` (an f16 scale and 32 four-bit values, 18
//! bytes for 32 values against 64 in f16: 3.56x the tokens per byte), as its
//! `-ctk q4_0 -ctv q4_0` stores K and V. A value is `d * (q - 8)`, exact in f32.

use half::f16;

use crate::block::KvBlock;

/// 32 values `d * (q - 8)`: value `i` in the low nibble of `qs[i]`, value `16 + i` in its
/// high nibble (llama.cpp's order).
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q4Block {
    pub d: f16,
    pub qs: [u8; 16],
}

impl KvBlock for Q4Block {
    const BYTES: usize = 2 + 16;
    const ZERO: Q4Block = Q4Block {
        d: f16::ZERO,
        qs: [0x88; 16],
    };

    /// llama.cpp's `quantize_row_q4_0_ref`: the value of largest magnitude, with its sign,
    /// maps to −8; each value is truncated from `x / d + 8.5` and capped at 15. Where C's
    /// conversion is undefined (a NaN, or an infinite quotient from a subnormal scale) the
    /// nibble is clamped to 0..=15, so a value never spills into its neighbour's.
    fn quantize(x: &[f32]) -> Q4Block {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in &x[..32] {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let nibble = |v: f32| ((v * id + 8.5) as i8).clamp(0, 15) as u8;
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = nibble(x[j]) | nibble(x[16 + j]) << 4;
        }
        Q4Block {
            d: f16::from_f32(d),
            qs,
        }
    }

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let (lo, hi) = out[..32].split_at_mut(16);
        for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&self.qs) {
            *l = d * f32::from(i16::from(q & 0x0f) - 8);
            *h = d * f32::from(i16::from(q >> 4) - 8);
        }
    }

    fn filled(value: f32) -> Q4Block {
        if value.is_nan() {
            Q4Block {
                d: f16::NAN,
                qs: [0x88; 16],
            }
        } else {
            Q4Block::quantize(&[value; 32])
        }
    }

    fn push_bytes(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    fn from_bytes(b: &[u8]) -> Q4Block {
        let mut qs = [0u8; 16];
        qs.copy_from_slice(&b[2..Self::BYTES]);
        Q4Block {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_magnitude_is_exact_and_the_rest_within_a_step() {
        // llama.cpp's reference on this block, worked by hand: max −20.5 at index 0, so
        // d = 2.5625 and index 31 (10.5) is 8 + 4.0976 + 0.5 → 12 → 4 · d = 10.25.
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 20.5).collect();
        let b = Q4Block::quantize(&x);
        assert_eq!(b.d.to_f32(), 2.5625);
        assert_eq!(b.qs[0] & 0x0f, 0);
        assert_eq!(b.qs[15] >> 4, 12);
        let mut y = [0f32; 32];
        b.dequantize(&mut y);
        assert_eq!(y[0], -20.5);
        assert_eq!(y[31], 10.25);
        for (a, e) in x.iter().zip(y) {
            assert!((a - e).abs() <= 2.5625, "{a} {e}");
        }
        // A subnormal scale makes an infinite reciprocal: every nibble still stays in range.
        let mut tiny = [0f32; 32];
        tiny[0] = -1e-39;
        tiny[1] = 1e-39;
        // (−inf and +inf quotients, NaN for the zeros: nibbles 0, 15 and 0; a plain cap at
        // 15 made the first 0x80, a high nibble of 8 for value 16.)
        let q = Q4Block::quantize(&tiny).qs;
        assert_eq!((q[0], q[1], q[2]), (0x00, 0x0f, 0x00));
        // A positive extreme takes −8 too: the scale is negative.
        let b = Q4Block::quantize(&[3.0; 32]);
        b.dequantize(&mut y);
        assert!(b.d.to_f32() < 0.0 && y.iter().all(|&v| v == 3.0));
        let mut z = [1f32; 32];
        Q4Block::ZERO.dequantize(&mut z);
        assert!(z.iter().all(|&v| v == 0.0));
        assert_eq!(Q4Block::quantize(&[0.0; 32]), Q4Block::ZERO);
        Q4Block::filled(f32::NAN).dequantize(&mut z);
        assert!(z.iter().all(|v| v.is_nan()));
    }
}
