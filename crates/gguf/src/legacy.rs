//! ggml's first block formats, 32 elements with an f16 scale: Q4_0 `x = (q - 8) * d`, Q4_1
//! `x = q * d + m`, Q8_0 `x = q * d`. In the 4-bit blocks byte `j` holds element `j` in its
//! low nibble and element `j + 16` in its high nibble.

use half::f16;

pub(crate) fn dequantize_q4_0(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    for j in 0..16 {
        let q = block[2 + j];
        out[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

pub(crate) fn dequantize_q4_1(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
    for j in 0..16 {
        let q = block[4 + j];
        out[j] = (q & 0x0f) as f32 * d + m;
        out[j + 16] = (q >> 4) as f32 * d + m;
    }
}

pub(crate) fn dequantize_q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    for j in 0..32 {
        out[j] = block[2 + j] as i8 as f32 * d;
    }
}

pub(crate) fn quantize_q4_0(x: &[f32], out: &mut Vec<u8>) {
    // ggml: d = max / -8 where max is the signed value of largest magnitude.
    let mut max = 0f32;
    for &v in x {
        if v.abs() > max.abs() {
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        let lo = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
        let hi = ((x[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
        out.push(lo | (hi << 4));
    }
}

pub(crate) fn quantize_q4_1(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
    for j in 0..16 {
        let lo = (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        let hi = (((x[j + 16] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        out.push(lo | (hi << 4));
    }
}

pub(crate) fn quantize_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    for &v in x {
        out.push((v * id).round() as i8 as u8);
    }
}
