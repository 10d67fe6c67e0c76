//! The f32 dot product (f32 weights, attention scores), in one fixed order.

/// f32 dot product with eight independent accumulators, reduced in the same order as the
/// SIMD kernels (a fixed order, so deterministic).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] = a[i * 8 + j].mul_add(b[i * 8 + j], acc[j]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for i in chunks * 8..a.len() {
        s = a[i].mul_add(b[i], s);
    }
    s
}
