//! IQ4_NL: 32 elements a block, an f16 scale `d` and 16 bytes of nibbles (element `j` in the
//! low nibble of byte `j`, element `j + 16` in the high one), each nibble an index into a
//! fixed non-linear table: `x = d * KVALUES_IQ4NL[q]`.

use half::f16;

/// ggml's `kvalues_iq4nl`.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

pub(crate) fn dequantize_iq4_nl(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    for j in 0..16 {
        let q = block[2 + j];
        out[j] = d * f32::from(KVALUES_IQ4NL[usize::from(q & 0x0f)]);
        out[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(q >> 4)]);
    }
}

/// The table index whose value is nearest `x` (ggml's `best_index_int8`).
fn best_index(x: f32) -> usize {
    let v = KVALUES_IQ4NL;
    if x <= f32::from(v[0]) {
        return 0;
    }
    if x >= f32::from(v[15]) {
        return 15;
    }
    let (mut lo, mut hi) = (0, 15);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < f32::from(v[mid]) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - f32::from(v[lo]) < f32::from(v[hi]) - x {
        lo
    } else {
        hi
    }
}

/// After ggml's `quantize_row_iq4_nl_ref` (one block of 32, no importance weights): the
/// scale from the value of largest magnitude, refined by a search over nearby scales that
/// minimizes the x²-weighted squared error, then every value to its nearest table entry.
pub(crate) fn quantize_iq4_nl(x: &[f32], out: &mut Vec<u8>) {
    let v = |i: usize| f32::from(KVALUES_IQ4NL[i]);
    let (mut amax, mut max) = (0f32, 0f32);
    for &e in x {
        if e.abs() > amax {
            amax = e.abs();
            max = e;
        }
    }
    let mut idx = [0usize; 32];
    let mut d = 0f32;
    if amax >= 1e-15 {
        d = -max / v(0);
        let fit = |id: f32, idx: &mut [usize; 32]| {
            let (mut sumqx, mut sumq2) = (0f32, 0f32);
            for (j, &e) in x.iter().enumerate() {
                idx[j] = best_index(id * e);
                let (q, w) = (v(idx[j]), e * e);
                sumqx += w * q * e;
                sumq2 += w * q * q;
            }
            (sumqx, sumq2)
        };
        let (sumqx, sumq2) = fit(1.0 / d, &mut idx);
        if sumq2 > 0.0 {
            d = sumqx / sumq2;
        }
        let mut best = d * sumqx;
        for itry in -7..=7 {
            let id = (itry as f32 + v(0)) / max;
            let mut trial = [0usize; 32];
            let (sumqx, sumq2) = fit(id, &mut trial);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (j, &e) in x.iter().enumerate() {
            idx[j] = best_index(id * e);
        }
    }
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        out.push(idx[j] as u8 | ((idx[j + 16] as u8) << 4));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;

    #[test]
    fn iq4_nl_dequantizes_per_definition() {
        let mut block = f16::from_f32(0.5).to_le_bytes().to_vec();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        GgmlType::IQ4_NL.dequantize(&block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * f32::from(KVALUES_IQ4NL[j]));
            assert_eq!(out[j + 16], 0.5 * f32::from(KVALUES_IQ4NL[15 - j]));
        }
    }

    /// Every value lands within the table's widest gap (24 of 127 steps of the scale, plus
    /// the refined scale's slack) of its input, and each table entry is the nearest to itself.
    #[test]
    fn iq4_nl_quantization_is_close() {
        for (i, &v) in KVALUES_IQ4NL.iter().enumerate() {
            assert_eq!(best_index(f32::from(v)), i);
        }
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let q = GgmlType::IQ4_NL.quantize(&x);
        assert_eq!(q.len() as u64, GgmlType::IQ4_NL.bytes_for(96).unwrap());
        let mut y = vec![0f32; 96];
        GgmlType::IQ4_NL.dequantize(&q, &mut y);
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= amax * 0.2, "{a} vs {b}");
            }
        }
        assert!(GgmlType::IQ4_NL
            .quantize(&[0.0; 32])
            .iter()
            .skip(2)
            .all(|&b| b == 0));
    }
}
