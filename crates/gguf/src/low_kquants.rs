//! The 2- and 3-bit k-quants, Q2_K and Q3_K: ggml's layouts, their dequantization (the
//! reference the kernels are tested against), and simple quantizers for synthetic files.
//!
//! Both store 256 elements as sixteen groups of 16 with a 4- or 6-bit scale each. The
//! quants are packed the same way: in each half of 128 elements, element `32j + l`
//! (j = 0..4, l = 0..32) is bits `2j..2j+2` of byte `l` of the half's 32 bytes. As in
//! `quants.rs`, the quantizers are not ggml's (no error-minimizing search).

use half::f16;

use crate::quants::QK_K;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn nearest(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// The two low bits of element `e` of a super-block from its 64 bytes of packed quants.
pub fn q2_bits(qs: &[u8], e: usize) -> u8 {
    let (half, i) = (e / 128, e % 128);
    (qs[32 * half + i % 32] >> (2 * (i / 32))) & 3
}

/// Q3_K's high bit of element `e`: bit `e / 32` of `hmask[e % 32]`.
pub fn q3_high_bit(hmask: &[u8], e: usize) -> u8 {
    (hmask[e % 32] >> (e / 32)) & 1
}

/// Q3_K's sixteen signed 6-bit group scales (`-32..32`) from its 12 packed bytes: group
/// `g` keeps its low nibble in byte `g` (g < 8, low nibble) or `g - 8` (high nibble), and
/// its top two bits at bits `2 (g / 4)..` of byte `8 + g % 4`.
pub fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (g, o) in out.iter_mut().enumerate() {
        let low = if g < 8 { s[g] & 0x0f } else { s[g - 8] >> 4 };
        let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

fn pack_q3_k_scales(sc: &[i8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (g, &v) in sc.iter().enumerate() {
        let u = (i32::from(v) + 32) as u8;
        if g < 8 {
            s[g] |= u & 0x0f;
        } else {
            s[g - 8] |= (u & 0x0f) << 4;
        }
        s[8 + g % 4] |= (u >> 4) << (2 * (g / 4));
    }
    s
}

fn pack_2bit(q: &[u8; QK_K], out: &mut Vec<u8>) {
    let mut qs = [0u8; 64];
    for (e, &v) in q.iter().enumerate() {
        let (half, i) = (e / 128, e % 128);
        qs[32 * half + i % 32] |= (v & 3) << (2 * (i / 32));
    }
    out.extend_from_slice(&qs);
}

/// Q2_K (84 bytes / 256): `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`; group `g`
/// of 16 has scale `scales[g] & 15` and min `scales[g] >> 4`, and
/// `x = d * scale * q - dmin * min` for `q` in `0..4`.
pub(crate) fn dequantize_q2_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let qs = &b[16..80];
    for (e, o) in out.iter_mut().enumerate().take(QK_K) {
        let sc = b[e / 16];
        let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
        *o = dl * f32::from(q2_bits(qs, e)) - ml;
    }
}

/// Q3_K (110 bytes / 256): `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`;
/// `x = d * scale_g * (q - 4)`, `q` the two low bits plus 4 times the high bit.
pub(crate) fn dequantize_q3_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 108);
    let hmask = &b[..32];
    let qs = &b[32..96];
    let sc = q3_k_scales(&b[96..108]);
    for (e, o) in out.iter_mut().enumerate().take(QK_K) {
        let q = i32::from(q2_bits(qs, e) | (q3_high_bit(hmask, e) << 2)) - 4;
        *o = d * f32::from(sc[e / 16]) * q as f32;
    }
}

/// A valid Q2_K block near `x`: per group of 16 the range `[min(0, min), max]` in three
/// steps; 4-bit scales rounded up so the range still fits.
pub(crate) fn quantize_q2_k(x: &[f32], out: &mut Vec<u8>) {
    let mut step = [0f32; 16];
    let mut offset = [0f32; 16];
    for g in 0..16 {
        let grp = &x[16 * g..16 * g + 16];
        let mn = grp.iter().copied().fold(0f32, f32::min);
        let mx = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        step[g] = (mx - mn) / 3.0;
        offset[g] = -mn;
    }
    let d = f16_round(step.iter().fold(0f32, |a, &v| a.max(v)) / 15.0);
    let dmin = f16_round(offset.iter().fold(0f32, |a, &v| a.max(v)) / 15.0);
    let mut scales = [0u8; 16];
    for g in 0..16 {
        let sc = if d > 0.0 {
            (step[g] / d).ceil().clamp(0.0, 15.0) as u8
        } else {
            0
        };
        let m = if dmin > 0.0 {
            nearest(offset[g] / dmin).clamp(0, 15) as u8
        } else {
            0
        };
        scales[g] = sc | (m << 4);
    }
    let mut q = [0u8; QK_K];
    for (e, qe) in q.iter_mut().enumerate() {
        let sc = scales[e / 16];
        let s = d * f32::from(sc & 0x0f);
        let m = dmin * f32::from(sc >> 4);
        *qe = if s > 0.0 {
            nearest((x[e] + m) / s).clamp(0, 3) as u8
        } else {
            0
        };
    }
    out.extend_from_slice(&scales);
    pack_2bit(&q, out);
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&f16::from_f32(dmin).to_le_bytes());
}

/// A valid Q3_K block near `x`: per group the value of largest magnitude maps to -4, as
/// ggml's reference does; `d` maps the largest group scale to -32.
pub(crate) fn quantize_q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut group = [0f32; 16];
    for (g, s) in group.iter_mut().enumerate() {
        let mut max = 0f32;
        for &v in &x[16 * g..16 * g + 16] {
            if v.abs() > max.abs() {
                max = v;
            }
        }
        *s = max / -4.0;
    }
    let mut max_scale = 0f32;
    for &s in &group {
        if s.abs() > max_scale.abs() {
            max_scale = s;
        }
    }
    let d = f16_round(max_scale / -32.0);
    let mut sc = [0i8; 16];
    for (o, &s) in sc.iter_mut().zip(&group) {
        *o = if d != 0.0 {
            nearest(s / d).clamp(-32, 31) as i8
        } else {
            0
        };
    }
    let mut q = [0u8; QK_K];
    let mut hmask = [0u8; 32];
    for (e, qe) in q.iter_mut().enumerate() {
        let s = d * f32::from(sc[e / 16]);
        let v = if s != 0.0 {
            nearest(x[e] / s).clamp(-4, 3) + 4
        } else {
            4
        } as u8;
        *qe = v & 3;
        hmask[e % 32] |= (v >> 2) << (e / 32);
    }
    out.extend_from_slice(&hmask);
    pack_2bit(&q, out);
    out.extend_from_slice(&pack_q3_k_scales(&sc));
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's `dequantize_row_q2_K` loop, transcribed step by step (walking pointers and
    /// shifts), as an oracle for the index formulas above.
    fn ggml_order_q2(b: &[u8]) -> Vec<f32> {
        let (d, min) = (f16_at(b, 80), f16_at(b, 82));
        let mut y = Vec::new();
        let mut is = 0;
        for n in 0..2 {
            let q = &b[16 + 32 * n..];
            for shift in [0, 2, 4, 6] {
                for off in [0, 16] {
                    let sc = b[is];
                    is += 1;
                    let (dl, ml) = (d * f32::from(sc & 0xf), min * f32::from(sc >> 4));
                    for l in 0..16 {
                        y.push(dl * f32::from((q[l + off] >> shift) & 3) - ml);
                    }
                }
            }
        }
        y
    }

    /// ggml's `dequantize_row_q3_K` loop, transcribed (its scale unpacking through four
    /// 32-bit words included).
    fn ggml_order_q3(b: &[u8]) -> Vec<f32> {
        let d = f16_at(b, 108);
        let w = |i: usize| u32::from_le_bytes([b[96 + i], b[97 + i], b[98 + i], b[99 + i]]);
        let (a0, a1, tmp) = (w(0), w(4), w(8));
        let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
        let aux = [
            (a0 & k2) | ((tmp & k1) << 4),
            (a1 & k2) | (((tmp >> 2) & k1) << 4),
            ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
            ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
        ];
        let scales: Vec<i32> = aux
            .iter()
            .flat_map(|a| a.to_le_bytes())
            .map(|s| i32::from(s as i8))
            .collect();
        let mut y = Vec::new();
        let (mut is, mut m) = (0, 1u8);
        for n in 0..2 {
            let q = &b[32 + 32 * n..];
            for shift in [0, 2, 4, 6] {
                for off in [0, 16] {
                    let dl = d * (scales[is] - 32) as f32;
                    is += 1;
                    for l in 0..16 {
                        let hi = if b[l + off] & m != 0 { 0 } else { 4 };
                        y.push(dl * (i32::from((q[l + off] >> shift) & 3) - hi) as f32);
                    }
                }
                m <<= 1;
            }
        }
        y
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    /// Arbitrary bytes (with finite, small scales) dequantize as ggml's own loops do.
    #[test]
    fn dequantization_follows_ggml_loops() {
        for seed in 0..50 {
            let mut b = bytes(84, seed);
            b[80..82].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
            b[82..84].copy_from_slice(&f16::from_f32(-0.375).to_le_bytes());
            let mut out = [0f32; QK_K];
            dequantize_q2_k(&b, &mut out);
            assert_eq!(out.to_vec(), ggml_order_q2(&b), "Q2_K seed {seed}");

            let mut b = bytes(110, seed + 1000);
            b[108..110].copy_from_slice(&f16::from_f32(0.0625).to_le_bytes());
            dequantize_q3_k(&b, &mut out);
            assert_eq!(out.to_vec(), ggml_order_q3(&b), "Q3_K seed {seed}");
        }
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        bytes(n, seed)
            .iter()
            .enumerate()
            // Super-blocks of different magnitudes, one of them all positive.
            .map(|(i, &b)| {
                let u = f32::from(b) / 127.5 - 1.0;
                let sb = i / QK_K;
                if sb == 2 {
                    u.abs() + 0.5
                } else {
                    u * (1 + sb) as f32
                }
            })
            .collect()
    }

    /// Quantizing then dequantizing stays within each group's error bound (derived in the
    /// comments), so the quantizers and dequantizers agree on the layout.
    #[test]
    fn quantize_then_dequantize_is_close() {
        let x = values(4 * QK_K, 9);
        for ty in [crate::GgmlType::Q2_K, crate::GgmlType::Q3_K] {
            let b = ty.quantize(&x);
            assert_eq!(b.len(), 4 * ty.block_bytes(), "{ty:?}");
            let mut y = vec![0f32; x.len()];
            ty.dequantize(&b, &mut y);
            for (xs, ys) in x.chunks(QK_K).zip(y.chunks(QK_K)) {
                let groups: Vec<&[f32]> = xs.chunks(16).collect();
                let amax_sb = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                let max_step = groups.iter().fold(0f32, |a, g| {
                    let (mn, mx) = range(g);
                    a.max((mx - mn) / 3.0)
                });
                let max_off = groups.iter().fold(0f32, |a, g| a.max(-range(g).0));
                for (g, (xg, yg)) in groups.iter().zip(ys.chunks(16)).enumerate() {
                    let (mn, mx) = range(xg);
                    let amax = xg.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let tol = if ty == crate::GgmlType::Q2_K {
                        // Step rounded up by at most d, min rounded by dmin / 2.
                        ((mx - mn) / 3.0 + max_step / 15.0) / 2.0 + max_off / 30.0
                    } else {
                        // The scale may round down by |d| / 2, and the value of largest
                        // magnitude of the other sign clamps at 3 steps instead of 4.
                        amax / 4.0 + 3.0 * amax_sb / 128.0
                    } * 1.01
                        + 1e-6;
                    for (a, b) in xg.iter().zip(yg) {
                        assert!((a - b).abs() <= tol, "{ty:?} group {g}: {a} -> {b} ({tol})");
                    }
                }
            }
        }
    }

    fn range(g: &[f32]) -> (f32, f32) {
        (
            g.iter().copied().fold(0f32, f32::min),
            g.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        )
    }

    #[test]
    fn q3_k_scales_round_trip() {
        let sc: [i8; 16] = [
            -32, 31, 0, -1, 5, -17, 16, 15, -16, 7, -8, 30, -31, 1, 2, -3,
        ];
        assert_eq!(q3_k_scales(&pack_q3_k_scales(&sc)), sc);
    }
}
