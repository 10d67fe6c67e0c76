//! The 5-bit and k-quant block formats: ggml's layouts, its dequantization (the scalar
//! reference every kernel is tested against), and simple quantizers for synthetic files.
//!
//! The quantizers here produce valid blocks that dequantize close to their input; they are
//! not ggml's (which search for the scales minimizing a weighted error), so a file written
//! by them is not byte-identical to one `llama-quantize` would write.

use half::f16;

/// Elements of a k-quant super-block.
pub const QK_K: usize = 256;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

fn push_f16(out: &mut Vec<u8>, x: f32) {
    out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
}

fn nearest(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Q5_0 (22 bytes / 32): `d: f16, qh: u32, qs: [u8; 16]`; `x = (q - 16) * d`, where the
/// low nibble of `qs[j]` and bit `j` of `qh` make element `j`, the high nibble and bit
/// `j + 16` element `j + 16`.
pub(crate) fn dequantize_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j];
        let lo = (q & 0x0f) as i32 | (((qh >> j) & 1) << 4) as i32;
        let hi = (q >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
        out[j] = (lo - 16) as f32 * d;
        out[j + 16] = (hi - 16) as f32 * d;
    }
}

/// Q5_1 (24 bytes / 32): `d: f16, m: f16, qh: u32, qs: [u8; 16]`; `x = q * d + m`.
pub(crate) fn dequantize_q5_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j];
        let lo = (q & 0x0f) as u32 | (((qh >> j) & 1) << 4);
        let hi = (q >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        out[j] = lo as f32 * d + m;
        out[j + 16] = hi as f32 * d + m;
    }
}

fn pack_5bit(qs: &[u8; 32], out: &mut Vec<u8>) {
    let mut qh = 0u32;
    for j in 0..16 {
        qh |= u32::from(qs[j] >> 4) << j;
        qh |= u32::from(qs[j + 16] >> 4) << (j + 16);
    }
    out.extend_from_slice(&qh.to_le_bytes());
    for j in 0..16 {
        out.push((qs[j] & 0x0f) | ((qs[j + 16] & 0x0f) << 4));
    }
}

/// ggml's reference Q5_0 quantizer.
pub(crate) fn quantize_q5_0(x: &[f32], out: &mut Vec<u8>) {
    let mut max = 0f32;
    for &v in x {
        if v.abs() > max.abs() {
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    let mut qs = [0u8; 32];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = ((v * id + 16.5) as i8).clamp(0, 31) as u8;
    }
    pack_5bit(&qs, out);
}

/// ggml's reference Q5_1 quantizer.
pub(crate) fn quantize_q5_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    push_f16(out, d);
    push_f16(out, min);
    let mut qs = [0u8; 32];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (((v - min) * id + 0.5) as i32).clamp(0, 31) as u8;
    }
    pack_5bit(&qs, out);
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block, from its
/// 12 packed bytes: sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` and `j + 4`;
/// 4..8 split theirs between the low/high nibble of byte `j + 4` and the top two bits of
/// bytes `j - 4` and `j`.
pub fn k4_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn pack_k4_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j] & 63;
            s[j + 4] |= m[j] & 63;
        } else {
            s[j + 4] = (sc[j] & 0x0f) | ((m[j] & 0x0f) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

/// Q4_K (144 bytes / 256): `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`; eight
/// sub-blocks of 32, `x = d * sc * q - dmin * m`. Bytes `32c..32c+32` of `qs` hold
/// sub-block `2c` in their low nibbles and `2c + 1` in their high nibbles.
pub(crate) fn dequantize_q4_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for j in 0..8 {
        let (sc, m) = k4_scale_min(j, scales);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        for (l, &q) in bytes.iter().enumerate() {
            let q = if j % 2 == 0 { q & 0x0f } else { q >> 4 };
            out[32 * j + l] = d1 * q as f32 - m1;
        }
    }
}

/// Q5_K (176 bytes / 256): Q4_K's layout with `qh: [u8; 32]` before `qs`; bit `j` of
/// `qh[l]` is the fifth bit of element `l` of sub-block `j`.
pub(crate) fn dequantize_q5_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for j in 0..8 {
        let (sc, m) = k4_scale_min(j, scales);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        for (l, &q) in bytes.iter().enumerate() {
            let lo = if j % 2 == 0 { q & 0x0f } else { q >> 4 };
            let q = lo | (((qh[l] >> j) & 1) << 4);
            out[32 * j + l] = d1 * q as f32 - m1;
        }
    }
}

/// Q6_K (210 bytes / 256): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`;
/// `x = d * scales[e / 16] * (q - 32)`. In each half of 128 elements (`ql` 64 bytes, `qh`
/// 32), element `l + 32k` (k = 0..4) takes the low (k even) or high nibble of
/// `ql[l + 32 (k % 2)]` and bits `2k..2k+2` of `qh[l]`.
pub(crate) fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        for l in 0..32 {
            for k in 0..4 {
                let e = 128 * half + l + 32 * k;
                let q = q6_at(ql, qh, l, k);
                out[e] = d * (b[192 + e / 16] as i8) as f32 * q as f32;
            }
        }
    }
}

/// The signed 6-bit value (`q - 32`) of element `l + 32k` of a Q6_K half.
pub fn q6_at(ql: &[u8], qh: &[u8], l: usize, k: usize) -> i8 {
    let low = ql[l + 32 * (k % 2)];
    let low = if k < 2 { low & 0x0f } else { low >> 4 };
    let high = (qh[l] >> (2 * k)) & 3;
    (low | (high << 4)) as i8 - 32
}

/// A valid Q6_K block near `x`: per 16 elements the scale `amax / 31`, the super-block
/// scale `d = max scale / 127`.
pub(crate) fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut group = [0f32; 16];
    for (g, s) in group.iter_mut().enumerate() {
        *s = x[16 * g..16 * g + 16]
            .iter()
            .fold(0f32, |a, v| a.max(v.abs()))
            / 31.0;
    }
    let d = f16_round(group.iter().fold(0f32, |a, &v| a.max(v)) / 127.0);
    let mut sc = [0i8; 16];
    for (s, &g) in sc.iter_mut().zip(&group) {
        *s = if d > 0.0 {
            nearest(g / d).clamp(0, 127) as i8
        } else {
            0
        };
    }
    let mut q = [0u8; QK_K];
    for (e, qe) in q.iter_mut().enumerate() {
        let step = d * sc[e / 16] as f32;
        let v = if step > 0.0 { nearest(x[e] / step) } else { 0 };
        *qe = (v + 32).clamp(0, 63) as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        for l in 0..32 {
            for k in 0..4 {
                let v = q[128 * half + l + 32 * k];
                let at = 64 * half + l + 32 * (k % 2);
                ql[at] |= if k < 2 { v & 0x0f } else { (v & 0x0f) << 4 };
                qh[32 * half + l] |= (v >> 4) << (2 * k);
            }
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    push_f16(out, d);
}

/// A valid Q4_K (`levels` 15) or Q5_K (31) block near `x`: per 32 elements the range
/// `[min(0, min), max]` split into `levels` steps.
fn quantize_k4_like(x: &[f32], levels: u8, out: &mut Vec<u8>) -> [u8; QK_K] {
    let mut step = [0f32; 8];
    let mut offset = [0f32; 8];
    for g in 0..8 {
        let blk = &x[32 * g..32 * g + 32];
        let mn = blk.iter().copied().fold(0f32, f32::min);
        let mx = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        step[g] = (mx - mn) / levels as f32;
        offset[g] = -mn;
    }
    let d = f16_round(step.iter().fold(0f32, |a, &v| a.max(v)) / 63.0);
    let dmin = f16_round(offset.iter().fold(0f32, |a, &v| a.max(v)) / 63.0);
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for g in 0..8 {
        // Round the scale up so the top of the range stays within `levels` steps.
        sc[g] = if d > 0.0 {
            (step[g] / d).ceil().clamp(0.0, 63.0) as u8
        } else {
            0
        };
        m[g] = if dmin > 0.0 {
            nearest(offset[g] / dmin).clamp(0, 63) as u8
        } else {
            0
        };
    }
    let mut q = [0u8; QK_K];
    for (e, qe) in q.iter_mut().enumerate() {
        let g = e / 32;
        let s = d * sc[g] as f32;
        let v = if s > 0.0 {
            nearest((x[e] + dmin * m[g] as f32) / s)
        } else {
            0
        };
        *qe = v.clamp(0, i32::from(levels)) as u8;
    }
    push_f16(out, d);
    push_f16(out, dmin);
    out.extend_from_slice(&pack_k4_scales(&sc, &m));
    q
}

fn pack_k4_nibbles(q: &[u8; QK_K], out: &mut Vec<u8>) {
    for c in 0..4 {
        for l in 0..32 {
            out.push((q[64 * c + l] & 0x0f) | ((q[64 * c + 32 + l] & 0x0f) << 4));
        }
    }
}

pub(crate) fn quantize_q4_k(x: &[f32], out: &mut Vec<u8>) {
    let q = quantize_k4_like(x, 15, out);
    pack_k4_nibbles(&q, out);
}

pub(crate) fn quantize_q5_k(x: &[f32], out: &mut Vec<u8>) {
    let q = quantize_k4_like(x, 31, out);
    let mut qh = [0u8; 32];
    for (e, &v) in q.iter().enumerate() {
        qh[e % 32] |= (v >> 4) << (e / 32);
    }
    out.extend_from_slice(&qh);
    pack_k4_nibbles(&q, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0;
                // Blocks of very different magnitudes, and one all-zero block.
                if i / 256 == 2 {
                    0.0
                } else {
                    u * (1 + i / 256) as f32
                }
            })
            .collect()
    }

    /// Every new format round-trips within its resolution: the quantizers and the
    /// dequantizers agree on the layout.
    #[test]
    fn quantize_then_dequantize_is_close() {
        for (ty, levels) in [
            (GgmlType::Q5_0, 15.0),
            (GgmlType::Q5_1, 31.0),
            (GgmlType::Q4_K, 15.0),
            (GgmlType::Q5_K, 31.0),
            (GgmlType::Q6_K, 31.0),
        ] {
            let x = values(4 * 256, 42);
            let bytes = ty.quantize(&x);
            assert_eq!(
                bytes.len(),
                x.len() / ty.block_elems() * ty.block_bytes(),
                "{ty:?}"
            );
            let mut y = vec![0f32; x.len()];
            ty.dequantize(&bytes, &mut y);
            let be = ty.block_elems().min(32);
            for (xb, yb) in x.chunks(be).zip(y.chunks(be)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in xb.iter().zip(yb) {
                    // Half a step of the block's own scale, plus the k-quants' 6-bit
                    // scale rounding.
                    let tol = amax / levels * 1.1 + 1e-6;
                    assert!((a - b).abs() <= tol, "{ty:?}: {a} -> {b} (amax {amax})");
                }
            }
        }
    }

    #[test]
    fn five_bit_layout() {
        // Element j: low nibble of qs[j] and bit j of qh; element j + 16: high nibble and
        // bit j + 16.
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..6].copy_from_slice(&((1u32 << 3) | (1u32 << 19)).to_le_bytes());
        b[6 + 3] = 0x52;
        let mut out = [0f32; 32];
        dequantize_q5_0(&b, &mut out);
        assert_eq!(out[3], (0x12 - 16) as f32);
        assert_eq!(out[19], (0x15 - 16) as f32);
        assert_eq!(out[0], -16.0);
    }

    #[test]
    fn k4_scales_round_trip() {
        let sc = [1, 63, 17, 32, 5, 62, 33, 48];
        let m = [63, 0, 7, 40, 61, 16, 2, 31];
        let packed = pack_k4_scales(&sc, &m);
        for j in 0..8 {
            assert_eq!(k4_scale_min(j, &packed), (sc[j], m[j]), "sub-block {j}");
        }
    }
}
